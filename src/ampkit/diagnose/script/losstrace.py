"""The loss-side trace: the op between a model's output and the loss that first made a value inf/NaN.

When a loss goes non-finite while every model output was finite, the culprit is code with no module
(a distance, a similarity matrix, a normalisation): a replay of the model cannot show it.  The next
iteration then runs under this ``TorchFunctionMode`` from the end of the model's forward to its
loss's backward, and records the first op whose floating inputs were all finite and whose output is not:
the op that made the first bad value, with its user line.  A later op that turns that inf into NaN
(``inf - inf``) has a non-finite input, so it never wins: the first bad value decides the finding.

Cost: every op of that one iteration is checked (a read of each tensor and a host sync per op);
nothing is traced before a loss went non-finite, nor after the traced iteration.

A failure that depends on the batch (one batch's sum passes 65504) leaves the next iteration clean, so
the failing iteration itself is kept: ``LossSideTape`` records, on every iteration that ran a model in
low precision, each call between the end of the model's forward and the loss's backward with references
to its inputs and output, and reads nothing.  When that iteration's loss or gradients turn out
non-finite, its calls are checked in order (``first_bad``), on the failing batch itself.  Cost on every
such iteration: a Python call and a short stack walk per loss-side op (at most ``TAPE_LIMIT`` of them),
no host sync, and the references that keep those tensors alive until the iteration ends (most of them
autograd keeps anyway for the backward).  Its mode is on the stack only while loss code can run
(``LossTapes``): off during a model's forward, and off once the loss is scaled or an optimizer steps
(left on, it would add a Python dispatch to every op of the backward's watchers and of the optimizer:
about 1 ms a step on bench_doctor_ab's mlp loop).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ampkit._util.dtypes import dtype_name
from ampkit._util.frames import UserFrames
from ampkit._util.trees import leaves
from ampkit.diagnose.core.modules import float_tensors, upcast
from ampkit.diagnose.script.lossgrad import LossCall, LossGrads, op_name, rerun_aside
from ampkit.diagnose.step.nanorigin import cause_of, nan_text

__all__ = [
    "HIDDEN_LOSS_CODE",
    "TAPE_LIMIT",
    "FirstBad",
    "LossSideTape",
    "LossSideTrace",
    "LossTapes",
    "explain_nan",
    "first_bad",
    "hidden_code_text",
    "loss_code_text",
]


@dataclass(frozen=True)
class FirstBad:
    op: str
    """torch's name of the call (``script.lossgrad.op_name``)."""
    location: str | None
    nan: bool
    """NaN in the output (else only ±inf: an overflow)."""
    out_dtype: str
    in_absmax: float
    cause: str | None = None
    """For a NaN: its cause (``nanorigin``'s names: ``zero_over_zero``, ``negative_domain`` ...), from the
    aten op inside the call that made it."""
    nan_in_fp32: bool | None = None
    """For a NaN: whether the same call on fp32 copies of its inputs makes it too (then it is not precision)."""


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for t in float_tensors(obj) if t.numel()]


class _LossSideMode(TorchFunctionMode):
    """Sees, in its thread while entered and not ``paused``, each call of the loss-side code (``on_call``)
    until the loss's backward starts; ``stopped`` from then on."""

    def __init__(self, frames: UserFrames, paused: Callable[[], bool], grads: LossGrads | None = None) -> None:
        super().__init__()
        self.frames = frames
        self.paused = paused
        self.thread = threading.get_ident()
        self.stopped = False
        self.grads = grads
        """Also follow the loss-side ops' backward (``script.lossgrad``), when given: armed at that backward."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        mine = threading.get_ident() == self.thread
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            if self.grads is not None and mine and not self.stopped:
                self.grads.arm(args[0] if args else kwargs.get("tensors"))
            self.stopped = True  # the loss is made: what follows (gradients, the step) is not loss code
        out = func(*args, **kwargs)
        if not self.stopped and mine and not self.paused():
            self.on_call(func, args, kwargs, out)
        return out

    def on_call(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        raise NotImplementedError


class LossSideTrace(_LossSideMode):
    """Checks every op called in its thread while entered; ``first`` is the first finite -> non-finite op."""

    def __init__(self, frames: UserFrames, paused: Callable[[], bool], grads: LossGrads | None = None) -> None:
        super().__init__(frames, paused, grads)
        self.first: FirstBad | None = None

    def on_call(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        # An attribute read (``t.grad``, ``t.T``) cannot make the first bad value, but a view it returns
        # is part of the loss code that the backward judgement re-runs.
        if self.first is None and getattr(func, "__name__", "") != "__get__":
            self.first = first_bad(func, (args, kwargs), out, self.frames.caller)
        if self.grads is not None:
            self.grads.note(LossCall(func, args, kwargs, out, self.frames.caller()))


def first_bad(func: Any, inputs: tuple[Any, dict[str, Any]], out: Any,
              location: Callable[[], str | None]) -> FirstBad | None:
    """The finding's facts when ``func`` turned finite floating inputs into a non-finite output, else None
    (a read of each tensor: failure path only)."""
    ins, outs = _floats(inputs), _floats(out)
    if not ins or not outs or not all(bool(torch.isfinite(t).all()) for t in ins) or _nonfinite_constant(inputs):
        return None  # a non-finite constant (``masked_fill(mask, float("inf"))``) is written on purpose
    bad = [o for o in outs if not bool(torch.isfinite(o).all())]
    if not bad:
        return None
    nan = any(bool(torch.isnan(o).any()) for o in bad)
    cause, fp32_nan = explain_nan(func, *inputs) if nan else (None, None)
    return FirstBad(op=op_name(func), location=location(), nan=nan, out_dtype=dtype_name(bad[0].dtype),
                    in_absmax=max(float(t.detach().abs().max()) for t in ins), cause=cause, nan_in_fp32=fp32_nan)


def _nonfinite_constant(inputs: Any) -> bool:
    return any(isinstance(x, float) and not math.isfinite(x) for x in leaves(inputs))


HIDDEN_LOSS_CODE = "loss-code-hidden"
"""The ledger key of a loss-side op whose inf/NaN the loss hid and the backward did not (``hidden_code_text``)."""

TAPE_LIMIT = 256
"""Loss-side calls a ``LossSideTape`` keeps per iteration; a longer loss code is judged by its first ones."""


class LossSideTape(_LossSideMode):
    """Records, in its thread, each call from the end of a model's forward to the loss's backward, with
    references to its inputs and output and its user line; reads nothing (``first_bad`` judges them)."""

    def __init__(self, frames: UserFrames, paused: Callable[[], bool], step: int) -> None:
        super().__init__(frames, paused)
        self.step = step
        """The optimizer step the recorded iteration belongs to."""
        self.calls: list[LossCall] = []
        self.closed = False
        """Its mode is off the stack (a model's forward runs, or the loss was made)."""
        self.done = False
        """The loss was made (scaled, or an optimizer stepped): the mode does not come back."""

    def on_call(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        # Not kept: attribute reads, and ``torch.autograd.grad`` (a gradient penalty's; or a wrapper of it):
        # its outputs are gradients, which the backward's watchers judge.
        if len(self.calls) < TAPE_LIMIT and getattr(func, "__name__", "") not in ("__get__", "grad"):
            self.calls.append(LossCall(func, args, kwargs, out, self.frames.caller()))

    def first_bad(self) -> FirstBad | None:
        """The first recorded call that turned finite inputs into inf/NaN (reads each tensor)."""
        for c in self.calls:
            found = first_bad(c.func, (c.args, c.kwargs), c.out, functools.partial(getattr, c, "location"))
            if found is not None:
                return found
        return None

    def release(self) -> None:
        self.calls.clear()


class LossTapes:
    """The loss-side tape of the current iteration and when its mode is on the stack: from the end of a
    model's forward (``resume``) to the start of the next one (``pause``: a model's forward must take the
    kernels it takes without the doctor, and under a torch-function mode some take another path) or to
    the loss being scaled or an optimizer step (``stop``: the mode would cost a Python dispatch per op of
    the backward's watchers and of the optimizer).  Its calls are kept until the iteration ends (``end``)."""

    def __init__(self, frames: UserFrames, paused: Callable[[], bool]) -> None:
        self.frames, self.paused = frames, paused
        self.tape: LossSideTape | None = None

    def resume(self, step: int, low_precision: bool) -> None:
        tape = self.tape
        if tape is not None and not tape.closed:
            return  # one tape at a time (one another thread left on stays the only one)
        if tape is not None and tape.step == step and not tape.done and tape.thread == threading.get_ident():
            tape.__enter__()  # the same iteration's loss code goes on after another model's forward
            tape.closed = False
        elif low_precision:
            self.tape = LossSideTape(self.frames, self.paused, step)
            self.tape.__enter__()

    def pause(self, *_: Any) -> None:
        tape = self.tape
        if tape is not None and not tape.closed and tape.thread == threading.get_ident():
            depth = torch._C._len_torch_function_stack()
            if depth and torch._C._get_function_stack_at(depth - 1) is tape:
                tape.__exit__(None, None, None)  # only itself: never another mode on top of it
            tape.closed = True

    def stop(self, *_: Any) -> None:
        self.pause()
        if self.tape is not None:
            self.tape.done = True

    def end(self) -> None:
        self.stop()
        if self.tape is not None and self.tape.closed:
            self.tape.release()

    def first_bad(self, step: int) -> FirstBad | None:
        """The first loss-side call of ``step`` itself that made a non-finite value, else None."""
        tape = self.tape
        return None if tape is None or tape.step != step else tape.first_bad()


class _FirstNaN(TorchDispatchMode):
    """The first aten op of a call that makes NaN from NaN-free inputs, and whether they held +inf / -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.found: tuple[str, bool, bool] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            ins, outs = _floats((args, kwargs or {})), _floats(out)
            if any(bool(torch.isnan(o).any()) for o in outs) and not any(bool(torch.isnan(t).any()) for t in ins):
                self.found = (func._schema.name, any(bool((t == math.inf).any()) for t in ins),
                              any(bool((t == -math.inf).any()) for t in ins))
        return out


def explain_nan(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[str, bool | None]:
    """(cause, nan_in_fp32) of the NaN that ``func(*args, **kwargs)`` made from finite inputs.

    The call runs twice more, without gradients and with the RNG put back: once op by op at the aten
    level, where the op inside it that made the NaN names the cause (``F.normalize`` of a zero row is a
    ``div`` of 0 by 0), and once on fp32 copies of its inputs with autocast off, which tells whether
    fp32 makes the same NaN.  A call that writes to its arguments is not run again (cause ``other``).
    Costs two calls, once per traced failure."""
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__" \
            or kwargs.get("out") is not None:
        return "other", None
    given = _floats((args, kwargs))
    probe = _FirstNaN()
    with rerun_aside(given, grad=False), probe:
        func(*args, **kwargs)
    cause = cause_of(probe.found[0], pos_inf=probe.found[1], neg_inf=probe.found[2]) if probe.found else "other"
    wide_args, wide_kwargs = tree_map(upcast, (args, kwargs))
    with rerun_aside(given, grad=False, fp32=True):
        out = func(*wide_args, **wide_kwargs)
    return cause, any(bool(torch.isnan(o).any()) for o in _floats(out))


def loss_code_text(first: FirstBad, label: str, became: str, step: int, *, recorded: bool = False) -> dict[str, Any]:
    """The message, fix and evidence of the finding for ``first``: the op between the outputs of the model
    ``label`` and the loss that made the step's first non-finite value (the loss became ``became``);
    ``recorded``: found among the failing step's own calls (``LossSideTape``), else by tracing the next step."""
    evidence: dict[str, Any] = {"traced_step": step if recorded else step + 1, "input_absmax": first.in_absmax,
                                "output_dtype": first.out_dtype}
    made, why, fix = "±inf", "", ("compute this op in fp32: `.float()` on its inputs, or run it under "
                                  "`torch.autocast(..., enabled=False)`; or bring its inputs into range first "
                                  "(normalise the features, divide by sqrt(d))")
    if first.nan:
        made = "NaN"
        what, fix = nan_text(first.cause or "other", first.out_dtype)
        why = f" ({what})"
        evidence["cause"] = first.cause or "other"
        if first.nan_in_fp32 is not None:
            evidence["nan_in_fp32"] = first.nan_in_fp32
        if first.nan_in_fp32:
            why += "; the same call on fp32 inputs makes the NaN too: this is not a precision problem"
    message = (f"{first.op}, between the outputs of {label} and the loss (no module), turned finite inputs "
               f"(largest |x| = {first.in_absmax:.4g}) into {made} in {first.out_dtype}{why}: the first non-finite "
               f"value of the step, which made the loss {became} at step {step} "
               f"({'found among the loss-side calls of that step itself' if recorded else 'the op was found by tracing the next step'})")
    return {"message": message, "fix": fix, "evidence": evidence}


def hidden_code_text(first: FirstBad, label: str, step: int) -> dict[str, Any]:
    """The message, fix and evidence of the finding for ``first`` when the loss stayed finite and only the
    gradients went non-finite: the op between the outputs of ``label`` and the loss made ±inf/NaN that the
    loss discarded (``torch.where``, a mask, a clip), and its backward multiplied a zero gradient by the
    infinite derivative there.  That op is the root cause; the backward overflow is its consequence."""
    made = "NaN" if first.nan else "±inf"
    message = (f"{first.op}, between the outputs of {label} and the loss (no module), turned finite inputs "
               f"(largest |x| = {first.in_absmax:.4g}) into {made} in {first.out_dtype} at step {step}. The loss "
               "stayed finite (the value was discarded by a where/mask or clipped), but the backward multiplies "
               "the zero gradient it gets there by an infinite derivative (0 × inf = NaN): this op is why the "
               "step's gradients became non-finite (found among the loss-side calls of that step itself)")
    fix = (f"compute this op in fp32 (`.float()` on its inputs, or `torch.autocast(..., enabled=False)`). A bound "
           f"or epsilon near 1 does not survive {first.out_dtype}: `clamp(max=1 - 1e-6)` rounds to 1.0 in bf16 "
           "(spacing 2^-8 below 1) and fp16 (2^-11), so log(1 - p) or log1p(-p) of a saturated p is -inf; clamp "
           "in fp32, or use `torch.finfo(p.dtype).eps` as the bound")
    evidence: dict[str, Any] = {"traced_step": step, "input_absmax": first.in_absmax,
                                "output_dtype": first.out_dtype, "loss_finite": True, "gradients_finite": False}
    if first.cause is not None:
        evidence["cause"] = first.cause
    return {"message": message, "fix": fix, "evidence": evidence}
