"""The live doctor's per-step capture: what one step ran (``Call``, ``StepCapture``), the hooks
that keep its output gradients, and what a replay is built from.

Kept by reference, never copied: the capture costs a few Python objects per step (see
``ampkit.diagnose.live.doctor`` for what is kept and how long).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampkit._util.host import HostCopy

if TYPE_CHECKING:
    from ampkit.diagnose.step.programs import OutputGradProgram

__all__ = ["Call", "GradKeeper", "StepCapture", "WideKeeper", "failure_flag", "replay_program", "scale_value"]


@dataclass
class Call:
    """One captured forward call of a prepared model."""

    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    rng_cpu: torch.Tensor
    rng_accel: torch.Tensor | None
    autocast: tuple[str, torch.dtype, bool]
    grads: list[torch.Tensor | None] = field(default_factory=list)
    wide: list[torch.Tensor | None] = field(default_factory=list)
    """Per output: the gradient before the cast that consumed it (fp32), when there is one."""


@dataclass
class StepCapture:
    step: int
    calls: list[Call]
    losses: list[torch.Tensor]
    scale: float | torch.Tensor
    grad_accumulation: int
    has_found_inf: bool = False
    flag: HostCopy | None = None
    models: list[nn.Module] = field(default_factory=list)


class GradKeeper:
    """Tensor hook that keeps a reference to the gradient an output received (no copy)."""

    __slots__ = ("index", "slots")

    def __init__(self, slots: list[torch.Tensor | None], index: int) -> None:
        self.slots, self.index = slots, index

    def __call__(self, grad: torch.Tensor) -> None:
        self.slots[self.index] = grad


class WideKeeper(GradKeeper):
    """Autograd-node pre-hook: keeps the gradient arriving at a cast, before it is narrowed."""

    def __call__(self, grad_outputs: Any) -> None:  # type: ignore[override]
        self.slots[self.index] = grad_outputs[0]


def replay_program(call: Call, effective: float) -> tuple[OutputGradProgram, bool]:
    """The replay of one captured call, and whether the gradient its outputs received was finite.

    Non-finite seed entries are zeroed (or replaced by a mean's gradient), as the script doctor does:
    the replayed backward then shows whether the forward itself goes non-finite.  Host reads: replay only.
    """
    from ampkit.diagnose.step.programs import OutputGradProgram, usable_seed

    grads = [w if w is not None else g for g, w in zip(call.grads, call.wide)] or call.grads
    seed_finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
    program = OutputGradProgram(call.args, call.kwargs, [usable_seed(g, effective) for g in grads],
                                loss_scale=effective, autocast=call.autocast)
    return program, seed_finite


def failure_flag(found_inf: torch.Tensor | None, losses: list[torch.Tensor]) -> torch.Tensor | None:
    """``[found_inf > 0 (when given), any loss non-finite (when any)]`` on the device: no host read."""
    parts = []
    if found_inf is not None:
        parts.append(found_inf.reshape(1) > 0)
    if losses:
        # A loss may be non-scalar (mp.backward(out, gradient=...)): every element must be finite.
        finite = torch.stack([torch.isfinite(x).all() for x in losses])
        parts.append((~finite).any().reshape(1))
    return torch.cat([p.to(parts[0].device) for p in parts]) if parts else None


def scale_value(cap: StepCapture) -> float:
    # A host read of a 0-d tensor, on the replay path only.
    return float(cap.scale) if isinstance(cap.scale, (int, float)) else float(cap.scale.item())
