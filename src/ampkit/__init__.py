"""ampkit: mixed-precision training for PyTorch that is correct by construction.

Train with ``MixedPrecision``; diagnose with ``ampkit doctor``; verify against FP32 with
``ampkit verify``; find AMP mistakes in source with ``ampkit lint``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ampkit._util.version import __version__

if TYPE_CHECKING:
    from ampkit.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from ampkit.engine import MixedPrecision
    from ampkit.hooks import EngineHook, StepResult
    from ampkit.policy import keep_fp32
    from ampkit.precision import Precision, PrecisionError
    from ampkit.scaler import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler
    from ampkit.tasks import Task, TaskBase
    from ampkit.telemetry import (
        Alarm,
        AlarmWarning,
        CallbackSink,
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
    "GradNormSpikeAlarm": "ampkit.telemetry",
    "JsonlSink": "ampkit.telemetry",
    "LossNonFiniteAlarm": "ampkit.telemetry",
    "LossScaler": "ampkit.scaler",
    "MixedPrecision": "ampkit.engine",
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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ampkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "Alarm",
    "AlarmWarning",
    "CallbackSink",
    "CheckpointError",
    "DynamicLossScaler",
    "EngineHook",
    "GradNormSpikeAlarm",
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
