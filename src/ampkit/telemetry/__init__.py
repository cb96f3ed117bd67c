"""Training telemetry: on-device step metrics, sinks, and alarms that can call the doctor.

``Telemetry`` is an ``EngineHook``: ``MixedPrecision(..., telemetry=spec)`` builds it with
``make_telemetry`` and attaches it (so does ``hooks=[Telemetry(...)]``).  ``spec`` is a
``Telemetry``, a list of sinks (or callables), a single sink, a ``*.jsonl`` path, or ``True``
(alarms only).  Metrics stay on the device and reach the host once per ``flush_every`` steps;
see ``core`` for the data path, ``metrics`` for the reductions, ``alarms`` for the rules and
docs/telemetry.md for the record format and the thresholds.

>>> import ampkit, torch
>>> mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=True)
>>> type(mp.telemetry).__name__, mp.telemetry.flush_every
('Telemetry', 50)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ampkit.telemetry.alarms import (
    Alarm,
    AlarmAction,
    AlarmEvent,
    AlarmWarning,
    GradNormSpikeAlarm,
    LossNonFiniteAlarm,
    ScaleCollapseAlarm,
    SkipRateAlarm,
    TrainingStopped,
    default_alarms,
)
from ampkit.telemetry.core import Telemetry
from ampkit.telemetry.sinks import (
    CallbackSink,
    JsonlSink,
    ProgressSink,
    Sink,
    SinkFailedWarning,
    TensorBoardSink,
)

if TYPE_CHECKING:
    from ampkit.engine import Engine

__all__ = [
    "Alarm",
    "AlarmAction",
    "AlarmEvent",
    "AlarmWarning",
    "CallbackSink",
    "GradNormSpikeAlarm",
    "JsonlSink",
    "LossNonFiniteAlarm",
    "ProgressSink",
    "ScaleCollapseAlarm",
    "Sink",
    "SinkFailedWarning",
    "SkipRateAlarm",
    "Telemetry",
    "TensorBoardSink",
    "TrainingStopped",
    "default_alarms",
    "make_telemetry",
]


def make_telemetry(spec: Any, engine: Engine | None = None) -> Telemetry:
    """Build (or take) the ``Telemetry`` for ``MixedPrecision(telemetry=spec)``; attach it to ``engine`` if given."""
    if isinstance(spec, Telemetry):
        telemetry = spec
    elif spec is True:
        telemetry = Telemetry()
    elif isinstance(spec, (str, os.PathLike)):
        if not os.fspath(spec).endswith(".jsonl"):
            raise ValueError(
                f"MixedPrecision(telemetry={os.fspath(spec)!r}): a path must end in .jsonl (one record per line); "
                "for TensorBoard pass telemetry=[ampkit.TensorBoardSink(log_dir)]"
            )
        telemetry = Telemetry(sinks=[JsonlSink(spec)])
    elif isinstance(spec, Sink):
        telemetry = Telemetry(sinks=[spec])
    elif isinstance(spec, (list, tuple)):
        telemetry = Telemetry(sinks=spec)
    else:
        raise TypeError(
            f"MixedPrecision(telemetry={spec!r}): use a Telemetry(...), a list of sinks "
            "([JsonlSink(path), TensorBoardSink(dir), ProgressSink(), CallbackSink(fn)]), a '*.jsonl' path, or True"
        )
    if engine is not None and telemetry not in engine.hooks:
        engine.add_hook(telemetry)
    return telemetry
