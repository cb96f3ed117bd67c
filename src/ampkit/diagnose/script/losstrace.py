"""The loss-side trace: the op between a model's output and the loss that first made a value inf/NaN.

When a loss goes non-finite while every model output was finite, the culprit is code with no module
(a distance, a similarity matrix, a normalisation): a replay of the model cannot show it.  The next
iteration then runs under this ``TorchFunctionMode`` from the end of the model's forward to its
loss's backward, and records the first op whose floating inputs were all finite and whose output is not:
the op that made the first bad value, with its user line.  A later op that turns that inf into NaN
(``inf - inf``) has a non-finite input, so it never wins: the first bad value decides the finding.

Cost: every op of that one iteration is checked (a read of each tensor and a host sync per op);
nothing is traced before a loss went non-finite, nor after the traced iteration.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten

from ampkit._util.dtypes import dtype_name
from ampkit._util.frames import UserFrames

__all__ = ["FirstBad", "LossSideTrace"]


@dataclass(frozen=True)
class FirstBad:
    op: str
    """torch's name of the call, in the findings' ``namespace::name`` form: ``torch::matmul``,
    ``torch::Tensor.__matmul__``, ``torch::nn.functional.linear``."""
    location: str | None
    nan: bool
    """NaN in the output (else only ±inf: an overflow)."""
    out_dtype: str
    in_absmax: float


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def _op_name(func: Any) -> str:
    name = str(resolve_name(func) or getattr(func, "__qualname__", None) or getattr(func, "__name__", "op"))
    return f"torch::{name.removeprefix('torch.')}"


class LossSideTrace(TorchFunctionMode):
    """Checks every op called in its thread while entered; ``first`` is the first finite -> non-finite op."""

    def __init__(self, frames: UserFrames, paused: Callable[[], bool]) -> None:
        super().__init__()
        self.frames = frames
        self.paused = paused
        self.thread = threading.get_ident()
        self.first: FirstBad | None = None
        self.stopped = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            self.stopped = True  # the loss is made: what follows (gradients, the step) is not loss code
        out = func(*args, **(kwargs or {}))
        if self.first is None and not self.stopped and threading.get_ident() == self.thread and not self.paused():
            self._check(func, (args, kwargs or {}), out)
        return out

    def _check(self, func: Any, inputs: Any, out: Any) -> None:
        if getattr(func, "__name__", "") == "__get__":
            return  # an attribute read (``t.grad``) returns a stored tensor, it computes nothing
        ins, outs = _floats(inputs), _floats(out)
        if not ins or not outs or not all(bool(torch.isfinite(t).all()) for t in ins):
            return
        bad = [o for o in outs if not bool(torch.isfinite(o).all())]
        if bad:
            self.first = FirstBad(op=_op_name(func),
                                  location=self.frames.caller(), nan=any(bool(torch.isnan(o).any()) for o in bad),
                                  out_dtype=dtype_name(bad[0].dtype),
                                  in_absmax=max(float(t.detach().abs().max()) for t in ins))
