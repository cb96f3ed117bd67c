"""Where a flush's records and alarm events go: the sinks (a failing sink is disabled, never fatal) and the
alarms' actions (warn, stop, ask the doctor for a replay).

``Telemetry.flush`` builds the records; these functions hand them on.  Both run once per flush, off the
per-step path.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ampkit.hooks import HookEvent
from ampkit.telemetry.alarms import AlarmEvent, AlarmWarning, TrainingStopped
from ampkit.telemetry.sinks import Sink, SinkFailedWarning
from ampkit.telemetry.source import StepSource

__all__ = ["act", "deliver", "guarded"]


def deliver(sinks: list[Sink], records: list[dict[str, Any]], events: Sequence[AlarmEvent], rank: int) -> None:
    """Write ``records``, then each alarm event, to every sink (rank 0 only for ``rank_zero_only`` sinks)."""
    for sink in list(sinks):
        if sink.rank_zero_only and rank != 0:
            continue
        if guarded(sinks, sink, "write", sink.write, records):
            for e in events:
                if not guarded(sinks, sink, "alarm", sink.alarm, e.to_dict()):
                    break


def guarded(sinks: list[Sink], sink: Sink, what: str, fn: Callable[[Any], Any], arg: Any) -> bool:
    """``fn(arg)``; when it raises, ``sink`` is removed from ``sinks`` with a ``SinkFailedWarning``."""
    try:
        fn(arg)
        return True
    except Exception as e:  # a sink must never end training
        sinks.remove(sink)
        warnings.warn(
            f"telemetry sink {sink!r} failed in {what}() with {type(e).__name__}: {e}; it is disabled for the "
            "rest of the run and training continues (the other sinks still record)",
            SinkFailedWarning, stacklevel=3,
        )
        with contextlib.suppress(Exception):  # it already failed; the warning above says so
            sink.close()
        return False


def act(events: Sequence[AlarmEvent], source: StepSource | None) -> None:
    """Run the alarms' actions: warn, ask ``source`` for the doctor's replay, and last raise ``TrainingStopped``
    for the first ``"stop"``."""
    stop: AlarmEvent | None = None
    for e in events:
        text = f"{e.alarm} at step {e.step}: {e.message}. Fix: {e.fix}"
        if e.action == "stop":
            stop = stop or e
        elif e.action == "doctor":
            _ask_replay(e, text, source)
        else:
            warnings.warn(text, AlarmWarning, stacklevel=4)
    if stop is not None:
        raise TrainingStopped(stop)


def _ask_replay(e: AlarmEvent, text: str, source: StepSource | None) -> None:
    # The doctor (a hook on the same engine) serves "replay" events; emit says whether one did.
    try:
        handled = source is not None and source.emit(HookEvent(
            kind="replay", reason=e.reason, step=source.optimizer_steps, data={"alarm_step": e.step}))
    except Exception as ex:  # the doctor's failure must not end training either
        warnings.warn(f"{text}. The doctor's replay failed with {type(ex).__name__}: {ex}",
                      AlarmWarning, stacklevel=5)
        return
    if not handled:
        warnings.warn(f"{text}. (The alarm asked for the doctor, but it is off: build "
                      "MixedPrecision(..., doctor=True) to replay the step instrumented.)",
                      AlarmWarning, stacklevel=5)
