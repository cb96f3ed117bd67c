"""Training telemetry: on-device step metrics, sinks, and alarms that can call the doctor.

``Telemetry`` is an ``EngineHook``: ``MixedPrecision(..., telemetry=spec)`` builds it with
``make_telemetry`` and attaches it (so does ``hooks=[Telemetry(...)]``).  ``spec`` is a
``Telemetry``, a list of sinks (or callables), a single sink, a ``*.jsonl`` path, or ``True``
(alarms only).  Metrics stay on the device and reach the host once per ``flush_every`` steps;
see ``core`` for the data path, ``metrics`` for the reductions, ``alarms`` for the rules and
docs/telemetry.md for the record format and the thresholds.  ``observe(optimizer, scaler=...,
telemetry=spec)`` feeds the same records and alarms from a loop ampkit does not drive (a
framework's own ``torch.amp.GradScaler`` and optimizers; see ``observe``).

>>> import ampkit, torch
>>> mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=True)
>>> type(mp.telemetry).__name__, mp.telemetry.flush_every
('Telemetry', 50)
"""

from __future__ import annotations

from ampkit.telemetry.alarms import (
    Alarm,
    AlarmAction,
    AlarmEvent,
    AlarmWarning,
    Fp8FlushAlarm,
    GradNormSpikeAlarm,
    LossNonFiniteAlarm,
    ScaleCollapseAlarm,
    SkipRateAlarm,
    TrainingStopped,
    default_alarms,
)
from ampkit.telemetry.core import Telemetry
from ampkit.telemetry.observe import LoopObserver, observe
from ampkit.telemetry.schedule import SchedulerOnSkipAlarm
from ampkit.telemetry.sinks import (
    CallbackSink,
    JsonlSink,
    ProgressSink,
    Sink,
    SinkFailedWarning,
    TensorBoardSink,
)
from ampkit.telemetry.spec import make_telemetry

__all__ = [
    "Alarm",
    "AlarmAction",
    "AlarmEvent",
    "AlarmWarning",
    "CallbackSink",
    "Fp8FlushAlarm",
    "GradNormSpikeAlarm",
    "JsonlSink",
    "LoopObserver",
    "LossNonFiniteAlarm",
    "ProgressSink",
    "ScaleCollapseAlarm",
    "SchedulerOnSkipAlarm",
    "Sink",
    "SinkFailedWarning",
    "SkipRateAlarm",
    "Telemetry",
    "TensorBoardSink",
    "TrainingStopped",
    "default_alarms",
    "make_telemetry",
    "observe",
]
