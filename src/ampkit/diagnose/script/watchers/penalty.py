"""The gradient-penalty watcher: ``torch.autograd.grad`` of a scaled loss, used without the unscale.

Gradients that ``torch.autograd.grad`` returns for ``scaler.scale(loss)`` carry the loss scale.  A
gradient penalty formed from them (a gradient norm, R1, WGAN-GP) without dividing them by the
scale is ``scale`` (or ``scale**2``) times too large, and it changes with every back-off of the
scale: GRADIENT_PENALTY_SCALED.  torch's recipe unscales first:
``grads = [g * (1 / scaler.get_scale()) for g in scaled_grads]``.

How it is judged: ``autograd.grad(..., create_graph=True)`` on a scaled output notes the autograd
nodes of the gradients it returns; the next backward walks the graph of its loss and looks for a
path to those nodes that crosses no multiplication by ``1/scale`` (nor a division by ``scale``).
Cost: nothing unless the script takes such gradients; then one walk of the loss's graph (a
Python visit per node) at the next backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import override

from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.findings import Finding

__all__ = ["GradPenaltyWatch", "reaches_unscaled"]

_UNSCALE_NODES = ("MulBackward0", "DivBackward0")


@dataclass
class _ScaledGrads:
    nodes: list[Any]
    """The autograd nodes of the returned gradients (kept alive: their ids stay theirs)."""
    scale: torch.Tensor
    location: str | None
    step: int


def _is_unscale(node: Any, scale: float) -> bool:
    """A multiplication by ``1/scale`` or a division by ``scale`` (a scalar operand saved by the node)."""
    name = node.name()
    if name not in _UNSCALE_NODES:
        return False
    for attr in ("_saved_other", "_saved_self"):
        value = getattr(node, attr, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            factor = float(value) * scale if name == "MulBackward0" else float(value) / scale
            if abs(factor - 1.0) < 1e-3:
                return True
    return False


def reaches_unscaled(root: Any, targets: list[Any], scale: float) -> bool:
    """Whether a path from the autograd node ``root`` reaches one of ``targets`` without crossing an unscale."""
    wanted = {id(t) for t in targets}
    stack: list[tuple[Any, bool]] = [(root, False)]
    seen: set[tuple[int, bool]] = set()
    while stack:
        node, unscaled = stack.pop()
        if node is None or (id(node), unscaled) in seen:
            continue
        seen.add((id(node), unscaled))
        if id(node) in wanted:
            if not unscaled:
                return True
            continue
        unscaled = unscaled or _is_unscale(node, scale)
        stack.extend((nxt, unscaled) for nxt, _ in node.next_functions)
    return False


class GradPenaltyWatch(Watcher):
    """``torch.autograd.grad`` on a scaled loss, and whether the next backward's loss uses its gradients unscaled."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        self._noted: list[_ScaledGrads] = []

    @override
    def install(self, patches: PatchSet) -> None:
        patches.wrap(torch.autograd, "grad", self._wrap_grad)

    def _wrap_grad(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def grad(outputs: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(outputs, *args, **kwargs)
            if not self.state.models.paused and kwargs.get("create_graph", False):
                self._note(outputs, out)
            return out
        return grad

    def _note(self, outputs: Any, grads: Any) -> None:
        flat = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        src = next((s for s in map(self.state.scalers.peek_scaled, flat) if s is not None), None)
        if src is None or src.scale is None or not src.enabled:
            return
        tensors = [g for g in (grads if isinstance(grads, (list, tuple)) else [grads]) if isinstance(g, torch.Tensor)]
        nodes = [g.grad_fn for g in tensors if g.grad_fn is not None]
        if nodes:
            self._noted.append(_ScaledGrads(nodes, src.scale, self.state.frames.caller(), self.state.step))
        if tensors:
            # Gradients that overflowed at this scale make a loss built from them non-finite: that is the
            # scaler's ordinary back-off (the step is skipped), not a forward failure.
            step = self.state.step
            overflow = torch.stack([torch.isfinite(g.detach()).all().logical_not() for g in tensors]).any()
            self.state.pending.read(overflow, lambda v: self.state.scalers.penalty_overflow.add(step) if v > 0 else None)

    @override
    def before_backward(self, tensors: list[torch.Tensor]) -> None:
        if self._noted:
            self._judge(tensors[0])

    def _judge(self, loss: torch.Tensor) -> None:
        noted, self._noted = self._noted, []
        if loss.grad_fn is None:
            return
        for n in noted:
            scale = float(n.scale)  # a host read, once per backward that follows such gradients
            if reaches_unscaled(loss.grad_fn, n.nodes, scale):
                self.state.ledger.add(Finding(
                    code="GRADIENT_PENALTY_SCALED", severity="error", location=n.location, step=n.step,
                    message=(f"torch.autograd.grad of a scaled loss (loss × {scale:g}) returned gradients that "
                             "still carry the loss scale, and the loss of the next backward uses them without "
                             "dividing by it: a penalty formed from them (a gradient norm, R1, WGAN-GP) is "
                             "scale (or scale²) times too large and changes with every back-off of the scale"),
                    fix=("unscale them first, as torch's recipe does: `inv_scale = 1.0 / scaler.get_scale()`, "
                         "`grads = [g * inv_scale for g in scaled_grads]`, then form the penalty from `grads` "
                         "(inside autocast) and add it to the loss before `scaler.scale(loss).backward()`"),
                    evidence={"loss_scale": scale}), key=n.location)
