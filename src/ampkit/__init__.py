"""ampkit: mixed-precision training for PyTorch that is correct by construction.

Train with ``MixedPrecision``; diagnose with ``ampkit doctor``; verify against FP32 with
``ampkit verify``; find AMP mistakes in source with ``ampkit lint``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ampkit._util.lazy import lazy_attributes
from ampkit._util.version import __version__

if TYPE_CHECKING:
    from ampkit.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from ampkit.hooks import EngineHook, HookEvent, StepResult
    from ampkit.mixed_precision import MixedPrecision
    from ampkit.policy import keep_fp32
    from ampkit.precision import Precision, PrecisionError
    from ampkit.scaler import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler
    from ampkit.tasks import Task, TaskBase
    from ampkit.telemetry import (
        Alarm,
        AlarmWarning,
        CallbackSink,
        Fp8FlushAlarm,
        GradNormSpikeAlarm,
        JsonlSink,
        LossNonFiniteAlarm,
        ProgressSink,
        ScaleCollapseAlarm,
        SkipRateAlarm,
        Telemetry,
        TensorBoardSink,
        TrainingStopped,
    )

# Public name -> defining module, imported on first use: `import ampkit` stays cheap, so
# `ampkit lint` (pure AST, no torch) starts in milliseconds, e.g. as a pre-commit hook.
_LAZY: dict[str, str] = {
    "Alarm": "ampkit.telemetry",
    "AlarmWarning": "ampkit.telemetry",
    "CallbackSink": "ampkit.telemetry",
    "CheckpointError": "ampkit.checkpoint",
    "DynamicLossScaler": "ampkit.scaler",
    "EngineHook": "ampkit.hooks",
    "Fp8FlushAlarm": "ampkit.telemetry",
    "GradNormSpikeAlarm": "ampkit.telemetry",
    "HookEvent": "ampkit.hooks",
    "JsonlSink": "ampkit.telemetry",
    "LossNonFiniteAlarm": "ampkit.telemetry",
    "LossScaler": "ampkit.scaler",
    "MixedPrecision": "ampkit.mixed_precision",
    "NoLossScaler": "ampkit.scaler",
    "Precision": "ampkit.precision",
    "PrecisionError": "ampkit.precision",
    "ProgressSink": "ampkit.telemetry",
    "ScaleCollapseAlarm": "ampkit.telemetry",
    "SkipRateAlarm": "ampkit.telemetry",
    "StaticLossScaler": "ampkit.scaler",
    "StepResult": "ampkit.hooks",
    "Task": "ampkit.tasks",
    "TaskBase": "ampkit.tasks",
    "Telemetry": "ampkit.telemetry",
    "TensorBoardSink": "ampkit.telemetry",
    "TrainingStopped": "ampkit.telemetry",
    "keep_fp32": "ampkit.policy",
    "load_checkpoint": "ampkit.checkpoint",
    "save_checkpoint": "ampkit.checkpoint",
}


__getattr__, _ = lazy_attributes(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(__all__)  # the public face only, not the module's own helpers

__all__ = [
    "Alarm",
    "AlarmWarning",
    "CallbackSink",
    "CheckpointError",
    "DynamicLossScaler",
    "EngineHook",
    "Fp8FlushAlarm",
    "GradNormSpikeAlarm",
    "HookEvent",
    "JsonlSink",
    "LossNonFiniteAlarm",
    "LossScaler",
    "MixedPrecision",
    "NoLossScaler",
    "Precision",
    "PrecisionError",
    "ProgressSink",
    "ScaleCollapseAlarm",
    "SkipRateAlarm",
    "StaticLossScaler",
    "StepResult",
    "Task",
    "TaskBase",
    "Telemetry",
    "TensorBoardSink",
    "TrainingStopped",
    "__version__",
    "keep_fp32",
    "load_checkpoint",
    "save_checkpoint",
]
