"""The alarm machinery shared by every rule: configs, monitors, events and the stop exception.

``ampkit.telemetry.alarms`` holds the rules themselves and re-exports these names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ampkit.findings import CODES, Code, Finding
from ampkit.hooks import ReplayReason

if TYPE_CHECKING:
    from ampkit.telemetry.source import StepSource

__all__ = [
    "Alarm",
    "AlarmAction",
    "AlarmEvent",
    "AlarmName",
    "AlarmWarning",
    "Monitor",
    "Record",
    "TrainingStopped",
    "check_threshold",
    "is_int",
    "steps_with",
]

AlarmAction = Literal["warn", "stop", "doctor"]
AlarmName = Literal["SCALE_COLLAPSE", "SKIP_RATE", "GRAD_NORM_SPIKE", "LOSS_NONFINITE", "FP8_FLUSH",
                    "SCHEDULER_STEPPED_ON_SKIP", "ALARM"]
"""Every alarm's ``name`` (``ALARM``: the base class's); the records' ``alarms`` carry it."""
_ACTIONS = ("warn", "stop", "doctor")
Record = dict[str, Any]


class AlarmWarning(UserWarning):
    """An alarm with action ``"warn"`` fired (escalate with ``warnings.simplefilter("error", AlarmWarning)``)."""


@dataclass(frozen=True, kw_only=True)
class AlarmEvent:
    """One firing of an alarm; ``to_dict()`` is what the records' ``"alarms"`` lists hold."""

    alarm: AlarmName
    """The alarm's name (its class's ``name``)."""
    code: Code | None
    """The doctor finding code this event is evidence for (``SCALE_COLLAPSE``, ``NONFINITE_INPUT``), or None."""
    step: int
    """The optimizer step the alarm fired on."""
    rank: int
    """The distributed rank whose records fired it."""
    action: AlarmAction
    """What the telemetry does about it."""
    message: str
    """What happened, with the numbers."""
    fix: str
    """What to change."""
    cause: str | None = None
    """Classified cause, e.g. ``nonfinite_input``, ``nonfinite_loss``, ``gradient_overflow``."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """JSON-able measurements behind the event."""

    @property
    def reason(self) -> ReplayReason:
        """What the doctor's replay is asked to explain: the finding code, else the alarm name."""
        return self.code or self.alarm

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_finding(self) -> Finding | None:
        """The doctor ``Finding`` this event stands for, or None when it has no finding code."""
        if self.code is None:
            return None
        return Finding(code=self.code, severity=CODES[self.code], message=self.message, fix=self.fix,
                       step=self.step, evidence=dict(self.evidence))


class TrainingStopped(RuntimeError):
    """Raised by ``mp.step()`` (at a flush) when an alarm with ``action="stop"`` fired."""

    def __init__(self, event: AlarmEvent) -> None:
        self.event = event
        evidence = json.dumps(event.evidence, default=str, allow_nan=True)
        super().__init__(
            f"training stopped by the {event.alarm} alarm at step {event.step} (rank {event.rank}): "
            f"{event.message}. Fix: {event.fix}. Evidence: {evidence}"
        )


class Monitor:
    """Running state of one alarm; ``observe`` is called with every record, in step order."""

    def __init__(self, config: Alarm) -> None:
        self.config = config
        self.fired = False

    def observe(self, record: Record) -> AlarmEvent | None:
        raise NotImplementedError

    def bind(self, source: StepSource) -> None:
        """Called when the telemetry binds to ``source`` (the engine or a ``LoopObserver``); a rule that needs
        the loop's settings reads them."""

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self.fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fired = bool(state.get("fired", False))

    def _event(self, record: Record, **kw: Any) -> AlarmEvent:
        return AlarmEvent(alarm=self.config.name, step=int(record["step"]), rank=int(record.get("rank", 0)),
                          action=self.config.action, **kw)


@dataclass(frozen=True, kw_only=True)
class Alarm:
    """Base of the alarm configs: the action taken when the rule fires."""

    action: AlarmAction = "warn"
    """``"warn"``, ``"stop"`` (raise ``TrainingStopped``) or ``"doctor"`` (replay the step)."""

    name: ClassVar[AlarmName] = "ALARM"

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(f"{type(self).__name__}(action={self.action!r}): use one of {list(_ACTIONS)}")

    def monitor(self) -> Monitor:
        raise NotImplementedError


def check_threshold(cls: str, name: str, value: float, ok: bool, want: str) -> None:
    if not ok:
        raise ValueError(f"{cls}({name}={value!r}): must be {want}")


def is_int(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def steps_with(records: list[Record], key: str) -> list[int]:
    return [int(r["step"]) for r in records if r.get(key)]
