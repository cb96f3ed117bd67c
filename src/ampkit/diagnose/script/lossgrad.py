"""The loss-side backward: the op between a model's output and the loss whose backward first made a
gradient inf/NaN.

When a step's gradient is already non-finite where it reaches a model's output, the overflow
happened in the backward of code with no module (a distance, a norm, a similarity in the loss).
The loss-side trace (``script.losstrace``) then notes, for one iteration, the autograd node of every
op it sees between the model's output and the loss, and hooks those nodes when the loss's backward
starts.  The first node, in backward order, whose incoming gradients are finite and whose outgoing
ones are not made the first bad value of the backward; its forward op and the user's line name it.

It is then judged the way the step doctor judges a backward producer (``step.backward``): a
derivative singularity (sqrt, a norm or pow(x, p < 1) at 0, acos/asin at ±1) overflows at any
scale; any other op is re-run with the incoming gradient divided by the loss scale, and an op that
is finite at scale 1 is ordinary dynamic loss scaling.  The whole loss-side code of that iteration is also
re-run from fp32 copies of what it received (model outputs, targets), with autocast off: whether
its gradients are finite tells precision from a bug that fp32 has too.

Cost: a hook per loss-side node of the one traced iteration, and the references that keep its
calls' inputs and outputs alive until the step ends; when a gradient goes non-finite, one re-run of
the op and one fp32 re-run of the loss code.  Nothing otherwise.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import resolve_name
from torch.utils._pytree import tree_flatten, tree_map

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.core.modules import float_tensors
from ampkit.diagnose.step.backward import node_singularity, remedy

__all__ = ["FirstBadGrad", "LossCall", "LossGrads", "loss_grad_text", "op_name", "rerun_aside"]


@dataclass(slots=True)
class LossCall:
    """One call of the loss-side code, as a loss-side trace or tape saw it: the function, references to
    its inputs and output, and its user line."""

    func: Any
    args: Any
    kwargs: dict[str, Any]
    out: Any
    location: str | None


def op_name(func: Any) -> str:
    """torch's name of a call, in the findings' ``namespace::name`` form: ``torch::matmul``,
    ``torch::Tensor.__matmul__``, ``torch::nn.functional.linear``."""
    name = str(resolve_name(func) or getattr(func, "__qualname__", None) or getattr(func, "__name__", "op"))
    return f"torch::{name.removeprefix('torch.')}"


@dataclass(frozen=True)
class FirstBadGrad:
    """The loss-side op whose backward made the first non-finite gradient, judged."""

    op: str
    location: str | None
    node: str
    """The autograd node (``SqrtBackward0``)."""
    grad_dtype: str
    singular: tuple[str, str] | None
    """(function, point) of a derivative singularity (``("sqrt", "0")``), else None."""
    finite_at_scale_1: bool | None
    """Whether the op's backward is finite with the incoming gradient divided by the loss scale."""
    fp32_finite: bool | None
    """Whether the step's loss code, re-run in fp32 from what it received, has finite gradients there."""

    @property
    def persists(self) -> bool:
        """It overflows whatever the loss scale: an error, not ordinary dynamic scaling."""
        return self.singular is not None or self.finite_at_scale_1 is False


class LossGrads:
    """The loss-side calls of one iteration and their autograd nodes; after the backward, ``judge`` says
    which of them first made a gradient non-finite."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.ops: dict[Any, LossCall] = {}
        self.calls: list[LossCall] = []
        """Every loss-side call in order: the chain ``fp32_chain_finite`` re-runs."""
        self.root: torch.Tensor | None = None
        self._handles: list[Any] = []
        self._found: tuple[LossCall, str, tuple[torch.Tensor, ...]] | None = None

    def note(self, call: LossCall) -> None:
        """A loss-side op ran: keep it and its node (its inputs too, to re-run it if its backward goes bad)."""
        self.calls.append(call)
        made = {t.grad_fn for t in float_tensors(call.out) if t.grad_fn is not None}
        given = {t.grad_fn for t in float_tensors((call.args, call.kwargs)) if t.grad_fn is not None}
        for node in made - given - self.ops.keys():  # an op returning its input unchanged made no node
            self.ops[node] = call

    def arm(self, root: Any) -> None:
        """The loss's backward starts from ``root``: hook every noted node."""
        self.root = root if isinstance(root, torch.Tensor) else None
        for node, op in self.ops.items():
            self._handles.append(node.register_hook(self._hook(op, node.name())))

    def _hook(self, op: LossCall, node: str) -> Any:
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            if self._found is not None:
                return
            incoming = [g for g in grad_outputs if g is not None]
            outgoing = [g for g in grad_inputs if g is not None]
            if incoming and all(bool(torch.isfinite(g).all()) for g in incoming) and \
                    any(not bool(torch.isfinite(g).all()) for g in outgoing):
                self._found = (op, node, tuple(g.detach().clone() for g in incoming))
        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def judge(self) -> FirstBadGrad | None:
        """The first loss-side op whose backward went non-finite, re-run to judge it; None if none did."""
        self.close()
        try:
            if self._found is None:
                return None
            op, node, incoming = self._found
            singular = node_singularity(node, _exponent(op))
            return FirstBadGrad(
                op=op_name(op.func), location=op.location, node=node, grad_dtype=dtype_name(incoming[0].dtype),
                singular=singular,
                finite_at_scale_1=None if singular else _backward_finite(op, incoming, 1.0 / self.scale),
                fp32_finite=self.fp32_chain_finite())
        finally:  # what kept the iteration's tensors alive goes, judged or not
            self.ops.clear()
            self.calls.clear()

    def fp32_chain_finite(self) -> bool | None:
        """Whether the loss-side code, re-run from fp32 copies of what it received (model outputs, targets)
        with autocast off, has finite gradients at those inputs: the fp32 reference of the loss code.
        None when it cannot be re-run (no recorded root, a call that fails on the copies)."""
        if self.root is None:
            return None
        copies: dict[int, torch.Tensor] = {}
        leaves: list[torch.Tensor] = []

        def fp32(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return x
            if id(x) not in copies:  # a value the loss code received: an fp32 leaf
                copies[id(x)] = x.detach().float().requires_grad_(x.requires_grad)
                if x.requires_grad:
                    leaves.append(copies[id(x)])
            return copies[id(x)]

        received = [t for call in self.calls for t in float_tensors((call.args, call.kwargs))]
        try:
            with rerun_aside(received, grad=True, fp32=True):
                for call in self.calls:
                    again = call.func(*tree_map(fp32, call.args), **tree_map(fp32, call.kwargs))
                    for old, new in zip(tree_flatten(call.out)[0], tree_flatten(again)[0]):
                        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
                            copies[id(old)] = new
                loss = copies.get(id(self.root))
                if loss is None or not loss.requires_grad or not leaves:
                    return None
                grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
        except (RuntimeError, TypeError, ValueError):
            return None
        return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)


@contextlib.contextmanager
def rerun_aside(tensors: Iterable[torch.Tensor], *, grad: bool, fp32: bool = False) -> Iterator[None]:
    """Around a re-run of the user's code on the side: the RNG is put back afterwards (a dropout in it
    takes nothing from the run's random stream), autograd is on or off as ``grad`` says, and with
    ``fp32`` autocast is off on the devices of ``tensors``."""
    devices = sorted({t.device.type for t in tensors} & {"cpu", "cuda"})
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[] if "cuda" not in devices else None))
        stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
        if fp32:
            for device in devices:
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _exponent(op: LossCall) -> float | None:
    """The scalar exponent of a ``pow`` call (``x ** 0.5``), else None."""
    if "pow" not in op_name(op.func):
        return None
    value = op.args[1] if len(op.args) > 1 else op.kwargs.get("exponent")
    return float(value) if isinstance(value, numbers.Real) else None


def _backward_finite(op: LossCall, incoming: tuple[torch.Tensor, ...], factor: float) -> bool | None:
    """Whether ``op``'s backward is finite for ``incoming`` times ``factor``, re-run on detached copies of its
    inputs in their own dtypes; None when it cannot be re-run."""
    def leaf(x: Any) -> Any:
        return x.detach().clone().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    args, kwargs = tree_map(leaf, (op.args, op.kwargs))
    leaves = [t for t in float_tensors((args, kwargs)) if t.requires_grad]
    try:
        with rerun_aside(leaves, grad=True):
            outs = [t for t in float_tensors(op.func(*args, **kwargs)) if t.requires_grad]
            if len(outs) != len(incoming) or any(o.shape != g.shape for o, g in zip(outs, incoming)):
                return None
            grads = torch.autograd.grad(outs, leaves, [(g * factor).to(o.dtype) for g, o in zip(incoming, outs)],
                                        allow_unused=True)
    except (RuntimeError, TypeError, ValueError):
        return None  # an op that cannot run again on copies (in place, out=) is left unjudged
    return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)


def loss_grad_text(bad: FirstBadGrad, label: str, step: int) -> dict[str, Any]:
    """Severity, message, fix and evidence of the BACKWARD_OVERFLOW finding for ``bad``, an op between
    the outputs of the model ``label`` and the loss (first seen at ``step``)."""
    evidence: dict[str, Any] = {"node": bad.node, "forward_op": bad.op, "traced_step": step + 1,
                                "overflows_at_any_scale": bad.persists, "fp32_gradients_finite": bad.fp32_finite}
    where = f"the backward of {bad.op} ({bad.node}), between the outputs of {label} and the loss (no module),"
    fp32 = (" The loss code re-run in fp32 has finite gradients: precision is the cause." if bad.fp32_finite else
            " The loss code re-run in fp32 has non-finite gradients too: fix the code, not the precision."
            if bad.fp32_finite is False else "")
    if bad.singular is not None:
        function, point = bad.singular
        evidence["singularity"] = {"function": function, "at": point, "confirmed": True}
        message = (f"{where} turned finite gradients into inf/NaN: the derivative of {function} at {point} is "
                   f"infinite, and {bad.grad_dtype} rounding put its argument exactly there (an epsilon below 6e-8 "
                   f"is 0 in fp16), so it overflows at any loss scale.{fp32}")
        fix = (f"keep this computation in fp32 with the epsilon inside: {remedy(function)}; changing the loss "
               "scale is not the remedy")
        return {"severity": "error", "message": message, "fix": fix, "evidence": evidence}
    if bad.persists:
        message = (f"{where} turned finite gradients into inf/NaN, and still does with the gradient divided by the "
                   f"loss scale: the gradient itself exceeds {bad.grad_dtype}'s range, so no loss scale helps.{fp32}")
        fix = "compute this op in fp32: `.float()` on its inputs (outside autocast), or bring its inputs into range"
        return {"severity": "error", "message": message, "fix": fix, "evidence": evidence}
    message = (f"{where} turned finite gradients into inf/NaN at the current loss scale; at scale 1 it is finite: "
               "ordinary dynamic loss scaling, the scale backs off")
    return {"severity": "info", "message": message, "fix": "nothing to change if the scale settles",
            "evidence": evidence}
