"""What "one step" means to the doctor: a forward that ends in something to backpropagate.

Two kinds:

* ``LossProgram`` — the caller's ``run(model) -> loss`` (forward + loss under the caller's
  autocast); backward is ``(loss * scale).backward()``, the scale a 0-d float32 tensor exactly
  as ``GradScaler.scale`` applies it (so an fp16 loss stays fp16 and can overflow the same way).
* ``OutputGradProgram`` — a replayed step of a live training run, where the loss function is
  not known: the model is called again on the captured inputs under the captured autocast
  state, and backward starts from the model's outputs with the gradient they received in the
  original step (captured by a tensor hook; it already contains the loss scale and the
  1/grad_accumulation factor).  What happens between the outputs and the loss is therefore
  not re-traced; everything inside the model is.

Backward modes: ``scaled`` (as trained), ``unit`` (the same gradients divided by the loss
scale: does the overflow happen at scale 1 too?) and ``fp32`` (the shadow: unscaled, fp32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ampkit.diagnose.core.modules import float_tensors

__all__ = ["ForwardOut", "LossProgram", "OutputGradProgram", "StepProgram", "usable_seed"]


@dataclass
class ForwardOut:
    loss: torch.Tensor | None
    """The scalar loss (``LossProgram``), else None."""
    roots: list[torch.Tensor]
    """Tensors backward starts from."""
    results: list[torch.Tensor] = field(default_factory=list)
    """A forward run without gradients (a frozen teacher under ``torch.no_grad``): its floating
    outputs, the only thing its finiteness can be judged by (no loss, no backward)."""


class StepProgram(Protocol):
    loss_scale: float
    """The factor the backward seed carries (1.0 without loss scaling)."""

    def forward(self, model: nn.Module, *, fp32: bool) -> ForwardOut: ...

    def backward(self, out: ForwardOut, mode: str) -> None: ...


class LossProgram:
    """``run(model)`` returns the loss; see the module docstring."""

    def __init__(self, run: Callable[[nn.Module], torch.Tensor], loss_scale: float | None = None) -> None:
        if not callable(run):
            raise TypeError(f"diagnose_step(run=...) must be a callable run(model) -> loss, got {run!r}")
        if loss_scale is not None and not (loss_scale > 0 and loss_scale < float("inf")):
            raise ValueError(f"loss_scale={loss_scale!r} must be a finite number > 0 (or None for no scaling)")
        self.run = run
        self.loss_scale = float(loss_scale) if loss_scale is not None else 1.0

    def forward(self, model: nn.Module, *, fp32: bool) -> ForwardOut:
        loss = self.run(model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {list(loss.shape)}"
            raise TypeError(f"run(model) must return the scalar loss tensor, got {got}; reduce it (loss.mean()) "
                            "and return it from the function passed to diagnose_step")
        return ForwardOut(loss=loss, roots=[loss])

    def backward(self, out: ForwardOut, mode: str) -> None:
        loss = out.loss
        assert loss is not None
        if not loss.requires_grad:
            return
        if mode == "scaled" and self.loss_scale != 1.0:
            loss = loss * torch.tensor(self.loss_scale, dtype=torch.float32, device=loss.device)
        loss.reshape(()).backward()


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


class OutputGradProgram:
    """A captured model call replayed with its output gradients; see the module docstring."""

    def __init__(
        self, args: tuple, kwargs: dict[str, Any], grads: Sequence[torch.Tensor | None], *, loss_scale: float,
        autocast: tuple[str, torch.dtype, bool],
    ) -> None:
        self.args = tree_map(_detach, args)
        self.kwargs = tree_map(_detach, kwargs)
        self.grads = list(grads)
        self.loss_scale = float(loss_scale)
        self.device_type, self.dtype, self.enabled = autocast

    def forward(self, model: nn.Module, *, fp32: bool) -> ForwardOut:
        ctx = (contextlib.nullcontext() if fp32 or not self.enabled
               else torch.autocast(device_type=self.device_type, dtype=self.dtype))
        with ctx:
            out = model(*self.args, **self.kwargs)
        outputs = float_tensors(out)
        roots = [t for t in outputs if t.requires_grad]
        return ForwardOut(loss=None, roots=roots, results=[] if roots else [t.detach() for t in outputs])

    def backward(self, out: ForwardOut, mode: str) -> None:
        pairs = [(r, g) for r, g in zip(out.roots, self.grads) if g is not None and g.shape == r.shape]
        if not pairs:
            return
        if mode == "scaled":
            seeds = [g.to(r.dtype) for r, g in pairs]
        else:
            inv = 1.0 / self.loss_scale
            seeds = [(g.float() * inv).to(r.dtype) for r, g in pairs]
        torch.autograd.backward([r for r, _ in pairs], seeds)


def usable_seed(grad: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """A captured output gradient, made usable as an ``OutputGradProgram`` backward seed.

    A non-finite loss sends NaN back only into the output rows that were non-finite (each
    row's gradient depends on its own values); those entries are zeroed so that a trial that
    fixes the forward can also finish its backward.  A gradient that is non-finite everywhere
    carries no information: it is replaced by the gradient of a mean over the output
    (``scale / numel`` per element), the right order of magnitude for a mean-reduced loss.
    Host reads of the gradient's finiteness: the replay path only.
    """
    if grad is None:
        return None
    finite = torch.isfinite(grad)
    if bool(finite.all()):
        return grad
    if bool(finite.any()):
        return torch.where(finite, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return torch.full(grad.shape, scale / max(1, grad.numel()), dtype=torch.float32, device=grad.device)
