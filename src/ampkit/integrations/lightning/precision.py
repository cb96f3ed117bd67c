"""``AmpkitPrecision``: a Lightning precision plugin that runs the ampkit engine inside Lightning's loop.

Lightning calls the plugin at fixed points; each maps to one engine call:

=====================================  =================================================================
Lightning                              ampkit engine
=====================================  =================================================================
``connect(model, optimizers, scheds)``  build the engine on the model's device, ``prepare(model)``
                                       (keep-fp32 rules, parameter checks), hold step schedulers back
``forward_context()``                  ``engine.autocast()``
``pre_backward(loss)``                 ``engine.scale_loss(loss)`` (hooks, non-finite flag, scale)
``optimizer_step(opt, closure)``       closure (forward + backward), then ``engine.step(opt)``: unscale
                                       -> Lightning's ``on_before_optimizer_step`` and clipping hooks
                                       -> clip -> step or skip -> scale update
``state_dict`` / ``load_state_dict``   ``engine.state_dict()`` (scale, growth tracker, step count)
=====================================  =================================================================

Lightning steps a step-interval LR scheduler after every optimizer step through the
LightningModule's ``lr_scheduler_step`` hook; its loop has no notion of a skipped step.  The one
place a precision plugin sees the schedulers is ``connect``, whose documented role is to return
them, possibly wrapped: the plugin wraps each ``interval="step"`` scheduler so that ``step()``
does nothing after a step the engine skipped (one host read of ``found_inf`` per scheduler step,
as ``Engine.scheduler_step``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from ampkit.hooks import EngineHook, HookedEngine, StepResult
from ampkit.mixed_precision import MixedPrecision
from ampkit.policy import KeepFp32Rule
from ampkit.scaler import LossScaler
from ampkit.telemetry import AlarmEvent, TrainingStopped

__all__ = ["AmpkitPrecision"]

# Lightning's names (and ampkit's own) -> (ampkit precision, the name Lightning reports as trainer.precision).
_PRECISIONS: dict[str, tuple[str, str]] = {
    "16-mixed": ("fp16", "16-mixed"), "16": ("fp16", "16-mixed"), "fp16": ("fp16", "16-mixed"),
    "bf16-mixed": ("bf16", "bf16-mixed"), "bf16": ("bf16", "bf16-mixed"),
    "32-true": ("fp32", "32-true"), "32": ("fp32", "32-true"), "fp32": ("fp32", "32-true"),
}
# Strategies that shard or wrap the model and bring their own precision handling (matched by
# class name, so that detecting DeepSpeed does not import it).
_OWN_PRECISION_STRATEGIES = ("DeepSpeed", "FSDP", "ModelParallel", "XLA")


class AmpkitPrecision(Precision):  # type: ignore[misc]
    """Lightning precision plugin driven by ``ampkit.MixedPrecision``: ``Trainer(plugins=[AmpkitPrecision("16-mixed")])``.

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"`` or ``"32-true"`` (or ampkit's ``"fp16"``,
            ``"bf16"``, ``"fp32"``).  Unlike Lightning's own plugin, ``"16-mixed"`` on CPU
            autocasts to fp16 with loss scaling, as asked.
        keep_fp32: module name patterns or types that run in fp32 (names as in
            ``lightning_module.named_modules()``); a pattern that matches nothing raises.
        scaler: a ``LossScaler`` or ``"dynamic"`` / ``"static"`` / ``"none"`` (default: dynamic
            for fp16, none otherwise).
        hooks: ``ampkit.EngineHook`` objects attached to the engine (``Telemetry``, your own).
        telemetry: the ``telemetry=`` shorthand of ``MixedPrecision`` (a ``Telemetry``, sinks,
            a ``*.jsonl`` path, True).  An alarm with action ``"stop"`` sets ``trainer.should_stop``.
        skip_nonfinite: skip steps whose gradients hold inf/NaN also without loss scaling.

    ``trainer.gradient_clip_val`` (norm) is applied by the engine, on the unscaled gradients,
    right after Lightning's ``on_before_optimizer_step`` hooks; value clipping and a
    ``configure_gradient_clipping`` of your own run at that same point.
    """

    def __init__(self, precision: str = "bf16-mixed", *, keep_fp32: Sequence[KeepFp32Rule] = (),
                 scaler: LossScaler | str | None = None, hooks: Sequence[EngineHook] = (),
                 telemetry: Any = None, skip_nonfinite: bool = True) -> None:
        key = str(precision)
        if key not in _PRECISIONS:
            raise ValueError(f"AmpkitPrecision(precision={precision!r}): use '16-mixed' (fp16 with loss scaling), "
                             "'bf16-mixed' or '32-true'")
        self.ampkit_precision, self.precision = _PRECISIONS[key]
        self._options: dict[str, Any] = {"keep_fp32": tuple(keep_fp32), "scaler": scaler, "hooks": tuple(hooks),
                                         "telemetry": telemetry, "skip_nonfinite": skip_nonfinite}
        self.engine: MixedPrecision | None = None
        """The engine, built by ``connect`` on the model's device (None before ``Trainer.fit`` sets up)."""
        self.last_result: StepResult | None = None
        """What the last optimizer step did (None before the first, or after a step without backward)."""
        self.stop_event: AlarmEvent | None = None
        """The alarm (action ``"stop"``) that ended training, if one did."""
        self._pending_state: dict[str, Any] | None = None
        self._step_context: tuple[pl.LightningModule, Any] | None = None

    # -- setup -------------------------------------------------------------------------------------------
    @override
    def connect(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        trainer = getattr(model, "_trainer", None)
        if trainer is not None:
            _check_strategy(trainer.strategy)
        if self.engine is None:
            self.engine = self._build_engine(model, trainer)
        self.engine.prepare(model)
        if self._pending_state is not None:
            self.engine.load_state_dict(self._pending_state)
            self._pending_state = None
        schedulers = [self._hold_back(config) for config in lr_schedulers]
        return model, optimizers, schedulers

    def _build_engine(self, model: nn.Module, trainer: Any) -> MixedPrecision:
        device = trainer.strategy.root_device if trainer is not None else _model_device(model)
        options = dict(self._options)
        options["clip_grad_norm"] = _engine_clip(model, trainer)
        engine = MixedPrecision(self.ampkit_precision, device=device, **options)
        # First: Lightning's own hooks see the unscaled gradients before any ampkit hook.
        engine.add_hook(_LightningOrder(self), first=True)
        return engine

    def _hold_back(self, config: Any) -> Any:
        if getattr(config, "interval", None) != "step" or isinstance(config.scheduler, _SkipAwareScheduler):
            return config
        return dataclasses.replace(config, scheduler=_SkipAwareScheduler(config.scheduler, self._held_back))

    def _held_back(self) -> bool:
        # One host read of found_inf per scheduler step, as Engine.scheduler_step.
        return self.last_result is not None and self.last_result.skipped

    def _require_engine(self) -> MixedPrecision:
        if self.engine is None:
            raise RuntimeError("AmpkitPrecision is used before Lightning connected it: pass it to "
                               "lightning.pytorch.Trainer(plugins=[AmpkitPrecision(...)]) and call trainer.fit")
        return self.engine

    # -- forward and backward ---------------------------------------------------------------------------------
    @override
    def forward_context(self) -> Any:
        return self._require_engine().autocast()

    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:
        return super().pre_backward(self._require_engine().scale_loss(tensor), module)

    # -- the step ------------------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        engine = self._require_engine()
        if kwargs:
            raise TypeError(f"AmpkitPrecision: optimizer.step({', '.join(kwargs)}=...) is not supported; the engine "
                            "calls optimizer.step() itself after unscaling and clipping")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("AmpkitPrecision: LBFGS re-evaluates its closure inside step(), which loss scaling "
                            "cannot follow; train it with precision='32-true' and no AmpkitPrecision")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning ran no backward, so there is nothing to step.
            self.last_result = None
            return None
        self._step_context = (model, optimizer)
        try:
            self.last_result = engine.step(optimizer)
        except TrainingStopped as stop:  # raising out of Lightning's step would lose the checkpointable state
            self.stop_event, self.last_result = stop.event, None
            model.trainer.should_stop = True
        finally:
            self._step_context = None
        return closure_result

    def _after_unscale(self) -> None:
        """Lightning's ``on_before_optimizer_step`` hooks and clipping, on the unscaled gradients."""
        if self._step_context is not None:
            model, optimizer = self._step_context
            self._after_closure(model, optimizer)

    @override
    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        engine = self._require_engine()
        if (clip_val > 0 and gradient_clip_algorithm == GradClipAlgorithmType.NORM
                and engine.clip_grad_norm == float(clip_val)):
            return  # the engine clips right after this hook, in its order, and records the norm before clipping
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # -- state and teardown ----------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return dict(self._pending_state or {})
        return self.engine.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.engine is None:
            self._pending_state = dict(state_dict)  # applied by connect once the engine exists
            return
        self.engine.load_state_dict(state_dict)

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()  # flushes telemetry, removes module hooks

    def __repr__(self) -> str:
        return f"AmpkitPrecision({self.precision!r}, engine={self.engine!r})"


class _LightningOrder(EngineHook):
    """Runs Lightning's pre-step hooks and clipping between the engine's unscale and its own clip."""

    def __init__(self, plugin: AmpkitPrecision) -> None:
        self.plugin = plugin

    @override
    def after_unscale(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.plugin._after_unscale()


class _SkipAwareScheduler:
    """A step-interval LR scheduler whose ``step()`` does nothing after a skipped optimizer step.

    Everything else (``state_dict``, ``optimizer``, ``get_last_lr``, ...) is the wrapped
    scheduler's; ``scheduler`` is the wrapped object itself.
    """

    def __init__(self, scheduler: Any, held_back: Callable[[], bool]) -> None:
        object.__setattr__(self, "scheduler", scheduler)
        object.__setattr__(self, "_held_back", held_back)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self._held_back():
            return None
        return self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"{self.scheduler!r} (not stepped on skipped steps)"


def _engine_clip(model: nn.Module, trainer: Any) -> float | None:
    """``trainer.gradient_clip_val`` when it is a norm clip the engine can apply itself."""
    if trainer is None or not trainer.gradient_clip_val or is_overridden("configure_gradient_clipping", model):
        return None
    if trainer.gradient_clip_algorithm not in (None, GradClipAlgorithmType.NORM):
        return None  # value clipping: Lightning's own clip, called by the engine's order hook
    return float(trainer.gradient_clip_val)


def _check_strategy(strategy: Any) -> None:
    name = type(strategy).__name__
    if any(part in name for part in _OWN_PRECISION_STRATEGIES):
        raise RuntimeError(
            f"AmpkitPrecision does not run under {name}: that strategy shards or wraps the model and brings its own "
            "precision plugin, which it needs. Keep the strategy's precision (Trainer(precision='bf16-mixed')) and "
            "observe the run with ampkit.integrations.lightning.AmpkitCallback; AmpkitPrecision supports the "
            "single-device and DDP strategies")


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
