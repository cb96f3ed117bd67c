"""``SchedulerOnSkipAlarm``: an LR scheduler that advanced on a step the GradScaler skipped.

In a loop ampkit drives, ``mp.scheduler_step(scheduler, result)`` holds the scheduler back on
skipped steps.  In a loop it only observes (``ampkit.telemetry.observe(..., scheduler=...)``)
the scheduler is the user's or the framework's, and stepping it after a skipped update runs
the schedule ahead of the parameters (pytorch#44511): warm-up shortened, decay started early.

The check costs no sync: at each step's end the observer notes, on the host, how far the
scheduler's ``last_epoch`` moved since the previous step (``SchedulerLog``); at flush time the
monitor pairs those notes with the records' ``skipped``.  Finding code
``SCHEDULER_STEPPED_ON_SKIP`` (message and fix from ``ampkit.findings``, as the doctor's).

>>> from types import SimpleNamespace
>>> scheduler = SimpleNamespace(last_epoch=0)  # any object with torch's ``last_epoch``
>>> log = SchedulerLog(scheduler)
>>> monitor = SchedulerOnSkipAlarm().monitor()
>>> monitor.follow(log)
>>> scheduler.last_epoch += 1; log.note(1)
>>> monitor.observe({"step": 1, "rank": 0, "skipped": True}).code
'SCHEDULER_STEPPED_ON_SKIP'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from ampkit.findings import scheduler_stepped_on_skip
from ampkit.telemetry.alarm_base import AlarmEvent, Monitor, Record, check_threshold
from ampkit.telemetry.alarms import Alarm

__all__ = ["SchedulerLog", "SchedulerOnSkipAlarm", "SchedulerOnSkipMonitor"]


class SchedulerLog:
    """How far a scheduler advanced during each optimizer step, noted on the host (``last_epoch``)."""

    def __init__(self, scheduler: Any) -> None:
        if not isinstance(getattr(scheduler, "last_epoch", None), int):
            raise TypeError(
                f"observe(scheduler={scheduler!r}): the scheduler needs an int `last_epoch` (every "
                "torch.optim.lr_scheduler scheduler has one); pass the LR scheduler the loop steps, or leave "
                "scheduler=None to skip the SCHEDULER_STEPPED_ON_SKIP check")
        self.scheduler = scheduler
        self.last: int = scheduler.last_epoch
        self.advanced: dict[int, int] = {}

    def note(self, step: int) -> None:
        """Record how many times the scheduler stepped since the previous note, as step ``step``'s."""
        epoch = int(self.scheduler.last_epoch)
        self.advanced[step] = epoch - self.last
        self.last = epoch

    def pop(self, step: int) -> int | None:
        """The advance noted for ``step`` (forgotten once read), or None when none was noted."""
        return self.advanced.pop(step, None)


@dataclass(frozen=True, kw_only=True)
class SchedulerOnSkipAlarm(Alarm):
    """The LR scheduler advanced on a skipped step of an observed loop (``SCHEDULER_STEPPED_ON_SKIP``).

    Fires once, at the first such step, when the scheduler has stepped on at least ``min_share``
    of the steps so far: an epoch-level scheduler that happens to step after a skipped last step
    of an epoch is not worth a warning (the doctor uses the same share).  Added by
    ``observe(..., scheduler=...)`` when the telemetry holds none; it fires only in observed loops.
    """

    min_share: float = 0.5
    """Share of the optimizer steps the scheduler must have stepped on (a per-step schedule)."""

    name = "SCHEDULER_STEPPED_ON_SKIP"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_threshold(type(self).__name__, "min_share", self.min_share, 0 <= self.min_share <= 1, "in [0, 1]")

    def monitor(self) -> Monitor:
        return SchedulerOnSkipMonitor(self)


class SchedulerOnSkipMonitor(Monitor):
    """Pairs each record with the scheduler's advance during its step (``follow`` a ``SchedulerLog``)."""

    config: SchedulerOnSkipAlarm

    def __init__(self, config: SchedulerOnSkipAlarm) -> None:
        super().__init__(config)
        self.log: SchedulerLog | None = None
        self.steps = 0
        self.stepped = 0
        self.hits: list[int] = []

    def follow(self, log: SchedulerLog) -> None:
        self.log = log

    @override
    def observe(self, record: Record) -> AlarmEvent | None:
        advanced = None if self.log is None else self.log.pop(int(record["step"]))
        if advanced is None:
            return None
        self.steps += 1
        self.stepped += advanced > 0
        if not (record["skipped"] and advanced > 0):
            return None
        self.hits.append(int(record["step"]))
        if self.fired or self.stepped < self.config.min_share * self.steps:
            return None
        self.fired = True
        message, fix = scheduler_stepped_on_skip(len(self.hits), self.hits[0])
        return self._event(record, code="SCHEDULER_STEPPED_ON_SKIP", message=message, fix=fix,
                           cause="scheduler_stepped_on_skip",
                           evidence={"skipped_scheduler_steps": len(self.hits), "steps": self.hits[:32],
                                     "scheduler_steps": self.stepped, "optimizer_steps": self.steps})

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": self.steps, "stepped": self.stepped, "hits": list(self.hits)}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps, self.stepped = int(state.get("steps", 0)), int(state.get("stepped", 0))
        self.hits = [int(s) for s in state.get("hits", [])]

