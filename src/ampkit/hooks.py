"""The engine's extension protocol: ``EngineHook`` observers and the ``StepResult`` they receive.

This module sits below the engine: telemetry, the doctor's replay, the distributed context and
the framework integrations all attach to the engine as hooks, and the engine imports
none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from ampkit.findings import Code
from ampkit.precision import Precision

__all__ = ["EngineHook", "HookEvent", "HookEventKind", "HookedEngine", "ReplayReason", "StepResult"]

HookEventKind = Literal["replay"]
"""What a ``HookEvent`` asks: ``replay`` (replay the last captured step; ``ReplayDoctor`` serves it)."""

ReplayReason = Code | Literal["SKIP_RATE", "GRAD_NORM_SPIKE", "LOSS_NONFINITE", "ALARM", "manual", ""]
"""Why a replay is asked: the finding code the evidence points to, else the name of the telemetry alarm
that fired (those that name no code), ``manual`` (a user's own call), or empty (none given)."""


@dataclass(frozen=True)
class StepResult:
    """What one ``Engine.step`` call did.  Tensors stay on the device.

    Reading ``applied`` or ``skipped`` resolves ``found_inf`` on the host (a sync); pass
    ``found_inf`` / ``grad_norm`` to on-device metrics instead when you want none.
    """

    boundary: bool
    """True when this call reached the accumulation boundary and an optimizer step was attempted."""
    found_inf: torch.Tensor | None = None
    """float32 scalar, > 0 when non-finite gradients were found and the step was skipped."""
    grad_norm: torch.Tensor | None = None
    """The unscaled global gradient norm, before clipping."""
    scale: torch.Tensor | None = None
    """The loss scale this step's gradients were produced with (before the update)."""
    optimizer_step: int = 0
    """How many boundary steps (applied or skipped) the engine has taken, this one included."""

    @property
    def skipped(self) -> bool:
        """True when the update was skipped (a host sync); False between boundaries."""
        return self.boundary and self.found_inf is not None and bool(self.found_inf.item() > 0)

    @property
    def applied(self) -> bool:
        """True when the optimizer updated the parameters (a host sync)."""
        return self.boundary and not self.skipped


@dataclass(frozen=True, kw_only=True)
class HookEvent:
    """A message from one hook to the others, delivered by ``engine.emit(event)``.

    Example: a telemetry alarm asks the doctor to replay the last step with
    ``HookEvent(kind="replay", reason="SCALE_COLLAPSE", step=...)``.
    """

    kind: HookEventKind
    """What is asked or announced; hooks ignore kinds they do not handle."""
    reason: ReplayReason = ""
    """Why, for logs and findings (a finding code where there is one)."""
    step: int | None = None
    """The engine's ``optimizer_steps`` when the event was emitted."""
    data: dict[str, Any] = field(default_factory=dict)
    """Anything else the receiver needs (JSON-able)."""


class HookedEngine(Protocol):
    """What a hook reads from the engine that calls it: the engine (``ampkit.engine.Engine``) and
    ``integrations.LoopDoctor``, which feeds ``ReplayDoctor`` from a loop a framework drives, both
    provide it.  A hook that needs more holds what it needs from its own construction."""

    @property
    def device(self) -> torch.device:
        """Where autocast runs and the step's tensors (loss scale, ``found_inf``) live."""

    @property
    def precision(self) -> Precision:
        """The precision the models run in."""

    @property
    def models(self) -> Sequence[nn.Module]:
        """The models prepared so far, in order."""

    @property
    def grad_accumulation(self) -> int:
        """Micro-batches per optimizer step (the backpropagated loss is divided by it)."""

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps (applied or skipped) completed so far."""

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale on ``device`` (1.0 without a loss scaler)."""

    @property
    def hooks(self) -> tuple[EngineHook, ...]:
        """The hooks attached, in call order (a snapshot)."""


class EngineHook:
    """Observer of an engine's steps; every method is a no-op by default.

    Telemetry, the doctor's replay, the distributed context and the framework integrations
    subclass this and attach through ``MixedPrecision(..., hooks=[...])``.  Subclasses mark
    each overridden method with ``@override`` (``typing_extensions``), so a misspelled hook
    fails type checking instead of silently never running.  Hooks run in the hot path: they
    must not synchronise with the host unless that is their documented purpose.

    Order of calls: ``on_attach`` once when the hook joins an engine; ``on_prepare`` per model;
    per micro-batch ``on_backward``; at each accumulation boundary ``after_unscale`` →
    ``reduce_found_inf`` → (clip) → ``wait_found_inf`` → ``before_optimizer_step`` → (step or
    skip, scaler update) → ``after_step``; ``on_event`` whenever a hook emits one; ``close``
    once at the end.
    """

    def on_attach(self, engine: HookedEngine) -> None:
        """Called once when the hook is attached to ``engine`` (before any other call)."""

    def on_prepare(self, engine: HookedEngine, model: nn.Module) -> None:
        """Called once per model when ``prepare`` first records it (before its first forward)."""

    def on_backward(self, engine: HookedEngine, loss: torch.Tensor) -> None:
        """Called with the user's (unscaled, undivided) loss before backward.

        A loss passed as nested lists/tuples of tensors gives one call per tensor, depth first,
        as one ``backward`` per tensor would: ``loss`` is always a tensor.
        """

    def after_unscale(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Called at the boundary once gradients are unscaled and checked, before clipping."""

    def reduce_found_inf(self, engine: HookedEngine, found_inf: torch.Tensor) -> torch.Tensor:
        """Return ``found_inf`` made global (every rank takes the same skip decision).

        The default returns it unchanged.  A hook that overrides this makes the engine check
        only this rank's gradient shards (``DTensor.to_local``); the engine decides that when
        the hook is attached, and calls this method only on hooks that override it.  The reduction may still be in
        flight when this returns: ``wait_found_inf`` is called after clipping, right before
        the step-or-skip decision reads the flag.
        """
        return found_inf

    def wait_found_inf(self, engine: HookedEngine) -> None:
        """Complete an asynchronous ``reduce_found_inf`` (called after clipping)."""

    def before_optimizer_step(
        self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer], found_inf: torch.Tensor,
        grad_norm: torch.Tensor | None,
    ) -> None:
        """Called at the boundary after unscale and clip, before the step-or-skip."""

    def after_step(self, engine: HookedEngine, result: StepResult,
                   optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Called after the scaler update at each boundary (before zero_grad)."""

    def on_event(self, engine: HookedEngine, event: HookEvent) -> bool | None:
        """Called for every ``engine.emit(event)``; ignore kinds you do not handle.

        Return True when this hook acted on the event (``emit`` then returns True, so the sender
        can tell a request nobody serves, e.g. a replay asked for while the doctor is off).
        """
        return None

    def close(self) -> None:
        """Release what the hook holds (flush files, remove module hooks); called by ``engine.close()``."""
