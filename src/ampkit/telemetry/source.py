"""``StepSource``: what ``Telemetry`` reads from the loop it records.

Two kinds of object drive a ``Telemetry``: the ampkit engine (``MixedPrecision``), which calls
it as an ``EngineHook``, and ``LoopObserver``, which watches a loop ampkit does not drive (a
framework's own ``torch.amp.GradScaler`` and optimizers).  Both expose the few facts below;
the telemetry and its alarms read nothing else from them, so one recording path and one set
of alarm rules serve both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ampkit.hooks import HookEvent

__all__ = ["StepSource"]


@runtime_checkable
class StepSource(Protocol):
    """The driver of the optimizer steps a ``Telemetry`` records."""

    @property
    def device(self) -> torch.device:
        """Where the step metrics live (the device of the loss scale and the gradients)."""

    @property
    def scaler(self) -> Any:
        """The loss scaler; the floor rule of ``ScaleCollapseAlarm`` reads its ``min_scale`` when it has one."""

    @property
    def models(self) -> Sequence[nn.Module]:
        """The models whose inputs are watched and whose parameters name the module absmax."""

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps (applied or skipped) completed before the one being recorded."""

    @property
    def clip_grad_norm(self) -> float | None:
        """The max norm the gradients are clipped to (for ``clip_coef``), or None."""

    def emit(self, event: HookEvent) -> bool:
        """Deliver a request (an alarm's ``"replay"``); True when a receiver acted on it."""
