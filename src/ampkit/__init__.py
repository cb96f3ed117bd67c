"""ampkit: mixed-precision training for PyTorch that is correct by construction.

Train with ``MixedPrecision``; diagnose with ``ampkit doctor``; verify against FP32 with
``ampkit verify``; find AMP mistakes in source with ``ampkit lint``.
"""

from ampkit.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ampkit.engine import EngineHook, MixedPrecision, StepResult
from ampkit.policy import keep_fp32
from ampkit.precision import Precision, PrecisionError
from ampkit.scaler import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler
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
from ampkit.verify.task import Task, TaskBase

__version__ = "0.1.0"

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
