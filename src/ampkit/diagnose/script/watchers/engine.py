"""The engine watcher: every ampkit ``Engine`` the script builds (``ampkit.MixedPrecision``, directly or
through ``AmpkitPrecision`` under Lightning) gets a ``DoctorEngineHook``.

``Engine.__init__`` is wrapped on the class, the way the scaler watcher wraps ``GradScaler``, and the
engine knows the doctor only as a hook.  The hook feeds the state the GradScaler watcher feeds
(``ScalerInfo``: the loss scale after each update, found_inf per step, gradients scaled between
``on_backward`` and ``after_unscale``), so SCALE_COLLAPSE, SCHEDULER_STEPPED_ON_SKIP and
CLIP_BEFORE_UNSCALE judge engine runs with the same rules.  It reads device values only through
``RunState.pending`` or where the engine already synced (a non-fused step reads found_inf).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import override

from ampkit.diagnose.script import failures
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.services.scalers import ScalerInfo
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.engine import Engine
from ampkit.hooks import EngineHook, HookedEngine, StepResult

__all__ = ["DoctorEngineHook", "EngineWatch"]


class DoctorEngineHook(EngineHook):
    """What ``ampkit doctor SCRIPT`` attaches to each engine of the script (only when it scales losses)."""

    def __init__(self, state: RunState, info: ScalerInfo) -> None:
        self._state = state
        self.info = info

    @override
    def on_backward(self, engine: HookedEngine, loss: torch.Tensor) -> None:
        if not self._state.models.paused:
            self.info.used += 1
            self.info.backward_scaled = True  # the gradients now hold loss × scale, until after_unscale

    @override
    def after_unscale(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.info.backward_scaled = False
        self.info.unscaled_since_update = True

    @override
    def before_optimizer_step(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer],
                              found_inf: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        # The engine's optimizer.step() calls are guarded: not direct steps, and they end no
        # iteration (a skipped non-fused step makes none at all); after_step ends it instead.
        self._state.scalers.in_step += 1

    @override
    def after_step(self, engine: HookedEngine, result: StepResult, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        state = self._state
        state.scalers.in_step -= 1
        self.info.unscaled_since_update = False
        if state.models.paused or result.found_inf is None or not optimizers:
            return
        scale = result.scale if result.scale is not None else engine.scale
        primary = False
        for opt in optimizers:
            is_primary = state.optimizers.is_primary(opt)
            primary |= is_primary
            # One found_inf for all optimizers: the engine skips them together.
            failures.found_read(state, opt, result.found_inf, scale, is_primary)
        it = state.step
        # The scale after the update, read at the next flush (a clone: the engine updates it in place).
        state.pending.read(engine.scale.detach().clone(), lambda v: self.info.scales.append((it, v)))
        if primary:
            failures.end_iteration(state)


class EngineWatch(Watcher):
    """Attaches a ``DoctorEngineHook`` to every loss-scaling ampkit engine the script builds."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        self.hooks: list[DoctorEngineHook] = []

    @override
    def install(self, patches: PatchSet) -> None:
        patches.wrap(Engine, "__init__", self._wrap_init)
        patches.wrap(Engine, "add_hook", self._wrap_add_hook)

    def _wrap_init(self, orig: Callable[..., None]) -> Callable[..., None]:
        def __init__(engine: Engine, *args: Any, **kwargs: Any) -> None:
            self.state.frames.call(orig, engine, *args, **kwargs)
            if self.state.models.paused or not engine.scaler.enabled:
                return  # bf16/fp32 engines scale nothing: no skip caused by a scale, nothing to unscale
            # float(engine.scale): one host read per engine built, not per step.
            info = self.state.scalers.add_scaler(engine, ScalerInfo(
                location=self.state.frames.caller(), device=str(engine.device), requested=True, enabled=True,
                init_scale=float(engine.scale), built_as=f"ampkit.{type(engine).__name__}", engine=True,
            ))
            hook = DoctorEngineHook(self.state, info)
            self.hooks.append(hook)
            engine.add_hook(hook, first=True)
        return __init__

    def _wrap_add_hook(self, orig: Callable[..., None]) -> Callable[..., None]:
        def add_hook(engine: Engine, hook: EngineHook, *, first: bool = False) -> None:
            orig(engine, hook, first=first)
            # Keep the doctor's hook first: it must learn of the unscale before another hook runs user
            # code on the unscaled gradients (AmpkitPrecision calls Lightning's clipping hooks there).
            ours = next((h for h in engine.hooks if isinstance(h, DoctorEngineHook)), None)
            if ours is not None and engine.hooks[0] is not ours:
                engine.remove_hook(ours)
                orig(engine, ours, first=True)
        return add_hook
