"""Alarms: rules over the step records, evaluated on the host at flush time (no extra sync).

Each alarm is a frozen config (the rule's thresholds and the action) that builds a monitor
holding the running state.  Rules and default thresholds (docs/telemetry.md justifies them):

``ScaleCollapseAlarm`` (finding code ``SCALE_COLLAPSE``)
    fires when ``consecutive_backoffs`` (default 10) steps in a row were skipped *and* backed
    the loss scale off, when a backoff takes the scale below ``critical_scale`` (default 1.0),
    or when the scale has sat at the scaler's floor (``DynamicLossScaler(min_scale=...)``) for
    ``floor_steps`` (default 50) steps in a row.  An applied step resets the backoff count.
    The cause is classified from the steps of the streak:
    ``"nonfinite_input"`` when a watched model saw an inf/NaN floating input,
    ``"nonfinite_loss"`` when the loss itself was inf/NaN, else ``"gradient_overflow"``
    (the backward overflows fp16 whatever the scale).
``SkipRateAlarm``
    fires when more than ``max_rate`` (default 5%) of the last ``window`` (default 100) steps
    were skipped.  The leading run of skips while a dynamic scale calibrates is not counted,
    unless no step at all is applied in the first ``window`` steps.
``GradNormSpikeAlarm``
    fires when an applied step's gradient norm (unscaled, before clipping) exceeds ``factor``
    (default 10) times the median of the previous ``window`` (default 100) applied steps,
    once at least ``min_history`` (default 20) norms are known.
``LossNonFiniteAlarm``
    fires when a step's loss is inf/NaN (finding code ``NONFINITE_INPUT`` when the inputs were
    non-finite too).
``Fp8FlushAlarm`` (in ``fp8alarm``)
    fires when an fp8 GEMM operand's flush fraction (sampled steps) is above ``max_fraction``
    (default 1%) and at least ``factor`` (default 2) times its lowest of the previous ``window``
    (default 5) samples.

Every alarm fires once per episode and re-arms when its condition clears.  Actions:
``"warn"`` (an ``AlarmWarning``), ``"stop"`` (raise ``TrainingStopped`` naming the alarm and its
evidence, after the records were written to every sink), ``"doctor"`` (``engine.emit(HookEvent(kind="replay",
reason=...))``, which an attached ``ReplayDoctor`` serves; a warning that the doctor is off when no hook does).

>>> monitor = LossNonFiniteAlarm(action="warn").monitor()
>>> event = monitor.observe({"step": 3, "rank": 0, "loss": float("nan"), "loss_nonfinite": True,
...                          "input_nonfinite": False, "skipped": True})
>>> event.alarm, event.cause, event.code
('LOSS_NONFINITE', 'nonfinite_loss', None)
"""


from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from ampkit.findings import nonfinite_input, scale_collapse
from ampkit.telemetry.alarm_base import (
    Alarm,
    AlarmAction,
    AlarmEvent,
    AlarmWarning,
    Monitor,
    Record,
    TrainingStopped,
    check_threshold,
    is_int,
    steps_with,
)
from ampkit.telemetry.fp8alarm import Fp8FlushAlarm

if TYPE_CHECKING:
    from ampkit.telemetry.source import StepSource

__all__ = [
    "Alarm",
    "AlarmAction",
    "AlarmEvent",
    "AlarmWarning",
    "Fp8FlushAlarm",
    "GradNormSpikeAlarm",
    "LossNonFiniteAlarm",
    "Monitor",
    "ScaleCollapseAlarm",
    "SkipRateAlarm",
    "TrainingStopped",
    "default_alarms",
]


@dataclass(frozen=True, kw_only=True)
class ScaleCollapseAlarm(Alarm):
    """Loss scale collapse: backoffs in a row, a backoff below ``critical_scale``, or a scale stuck at its floor."""

    consecutive_backoffs: int = 10
    """Backoffs in a row that count as a collapse (from 2**16 that is a scale of 64)."""
    critical_scale: float = 1.0
    """A backoff below this scale is a collapse at once (a scale < 1 shrinks the gradients)."""
    floor_steps: int = 50
    """Steps in a row at the scaler's floor (``DynamicLossScaler(min_scale=...)``) that count as a collapse."""

    name = "SCALE_COLLAPSE"

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        check_threshold(cls, "consecutive_backoffs", self.consecutive_backoffs,
               is_int(self.consecutive_backoffs, 1), "an int >= 1")
        check_threshold(cls, "critical_scale", self.critical_scale, self.critical_scale >= 0, ">= 0")
        check_threshold(cls, "floor_steps", self.floor_steps, is_int(self.floor_steps, 1), "an int >= 1")

    def monitor(self) -> Monitor:
        return _ScaleCollapseMonitor(self)


_STREAK_KEYS = ("step", "scale", "next_scale", "skipped", "loss_nonfinite", "input_nonfinite")


class _ScaleCollapseMonitor(Monitor):
    config: ScaleCollapseAlarm

    def __init__(self, config: ScaleCollapseAlarm) -> None:
        super().__init__(config)
        self.streak: list[Record] = []
        self.floor_streak: list[Record] = []
        self.floor_fired = False
        self.scaler: Any = None

    @override
    def bind(self, source: StepSource) -> None:
        self.scaler = source.scaler  # its min_scale is read per record: load_state_dict may change it

    def observe(self, record: Record) -> AlarmEvent | None:
        return self._observe_backoff(record) or self._observe_floor(record)

    def _observe_backoff(self, record: Record) -> AlarmEvent | None:
        backoff = bool(record["skipped"]) and record["next_scale"] < record["scale"]
        if not record["skipped"]:
            self.streak.clear()
            self.fired = False
            return None
        if not backoff:
            return None  # a skip the scaler's hysteresis tolerated (or at its floor): no backoff, no reset
        self.streak.append({k: record.get(k) for k in _STREAK_KEYS})
        cfg = self.config
        below = record["next_scale"] < cfg.critical_scale
        if self.fired or not (len(self.streak) >= cfg.consecutive_backoffs or below):
            return None
        self.fired = True
        return self._collapse(record, below)

    def _observe_floor(self, record: Record) -> AlarmEvent | None:
        floor = getattr(self.scaler, "min_scale", None)
        if floor is None or record["scale"] > floor:
            self.floor_streak.clear()
            self.floor_fired = False
            return None
        if self.floor_fired:
            return None
        self.floor_streak.append({k: record.get(k) for k in _STREAK_KEYS})
        if len(self.floor_streak) < self.config.floor_steps:
            return None
        self.floor_fired = True
        return self._at_floor(record, floor)

    def _collapse(self, record: Record, below: bool) -> AlarmEvent:
        streak = self.streak
        first, last = streak[0], streak[-1]
        what = (f"{len(streak)} consecutive backoffs took the loss scale from {first['scale']:g} to "
                f"{last['next_scale']:g} (steps {first['step']}-{last['step']})")
        if below:
            what += f", below critical_scale={self.config.critical_scale:g}"
        cause, detail, evidence = _classify(streak)
        message, fix = scale_collapse(cause, what, detail)
        evidence = {"consecutive_backoffs": len(streak), "first_step": first["step"], "last_step": last["step"],
                    "scale_before": first["scale"], "scale_after": last["next_scale"], **evidence}
        return self._event(record, code="SCALE_COLLAPSE", message=message, fix=fix, cause=cause, evidence=evidence)

    def _at_floor(self, record: Record, floor: float) -> AlarmEvent:
        at, descent = self.floor_streak, self.streak
        first, last = at[0], at[-1]
        skipped = sum(bool(r["skipped"]) for r in at)
        what = (f"the loss scale has sat at its floor min_scale={floor:g} for {len(at)} steps in a row (steps "
                f"{first['step']}-{last['step']}, {skipped} of them skipped)")
        if descent:
            what += (f", after {len(descent)} consecutive backoffs from {descent[0]['scale']:g} "
                     f"(steps {descent[0]['step']}-{descent[-1]['step']})")
        if floor < 2.0**-128:
            what += "; at this floor 1/scale overflows fp32, so every step is skipped"
        # The steps that drove the scale down carry the cause; those at the floor may be clean.
        cause, detail, evidence = _classify(descent + at)
        message, fix = scale_collapse(cause, what, detail)
        evidence = {"floor": floor, "steps_at_floor": len(at), "first_step": first["step"],
                    "last_step": last["step"], "skipped_at_floor": skipped, "backoffs_before": len(descent),
                    **evidence}
        return self._event(record, code="SCALE_COLLAPSE", message=message, fix=fix, cause=cause, evidence=evidence)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "streak": [dict(r) for r in self.streak],
                "floor_streak": [dict(r) for r in self.floor_streak], "floor_fired": self.floor_fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.streak = [dict(r) for r in state.get("streak", [])]
        self.floor_streak = [dict(r) for r in state.get("floor_streak", [])]
        self.floor_fired = bool(state.get("floor_fired", False))


def _classify(steps: list[Record]) -> tuple[str, str, dict[str, Any]]:
    """The cause of a collapse from its steps: (cause, detail for the message, evidence)."""
    bad_inputs, bad_loss = steps_with(steps, "input_nonfinite"), steps_with(steps, "loss_nonfinite")
    watched = any(r.get("input_nonfinite") is not None for r in steps)
    if bad_inputs:
        cause, detail = "nonfinite_input", f" (inputs held inf/NaN on steps {bad_inputs})"
    elif bad_loss:
        inputs = "the inputs were finite" if watched else "the inputs were not watched (call mp.prepare(model))"
        cause, detail = "nonfinite_loss", f" (the loss was inf/NaN on steps {bad_loss} while {inputs})"
    else:
        cause, detail = "gradient_overflow", " (the loss and the inputs were finite)"
    return cause, detail, {"nonfinite_input_steps": bad_inputs, "nonfinite_loss_steps": bad_loss,
                           "inputs_watched": watched}


@dataclass(frozen=True, kw_only=True)
class SkipRateAlarm(Alarm):
    """More than ``max_rate`` of the last ``window`` steps skipped."""

    window: int = 100
    """Steps the rate is measured over."""
    max_rate: float = 0.05
    """Highest tolerated fraction of skipped steps (a healthy dynamic scale skips ~1/growth_interval)."""

    name = "SKIP_RATE"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_threshold(type(self).__name__, "window", self.window, is_int(self.window, 1), "an int >= 1")
        check_threshold(type(self).__name__, "max_rate", self.max_rate, 0 <= self.max_rate < 1, "in [0, 1)")

    def monitor(self) -> Monitor:
        return _SkipRateMonitor(self)


class _SkipRateMonitor(Monitor):
    config: SkipRateAlarm

    def __init__(self, config: SkipRateAlarm) -> None:
        super().__init__(config)
        self.calibrating = True
        self.window: deque[tuple[int, bool, bool]] = deque(maxlen=config.window)

    def observe(self, record: Record) -> AlarmEvent | None:
        entry = (int(record["step"]), bool(record["skipped"]),
                 bool(record.get("loss_nonfinite") or record.get("input_nonfinite")))
        if self.calibrating and not record["skipped"]:
            self.calibrating = False  # the leading skips were the dynamic scale calibrating
            self.window.clear()
        self.window.append(entry)
        cfg = self.config
        if len(self.window) < cfg.window:
            return None
        skipped = [s for s, sk, _ in self.window if sk]
        rate = len(skipped) / len(self.window)
        if rate <= cfg.max_rate:
            self.fired = False
            return None
        if self.fired:
            return None
        self.fired = True
        nonfinite = [s for s, sk, bad in self.window if sk and bad]
        first = self.window[0][0]
        if self.calibrating:
            message = f"no step was applied in the first {len(self.window)} steps (steps {first}-{entry[0]})"
        else:
            message = (f"{len(skipped)} of the last {len(self.window)} steps were skipped "
                       f"({rate:.1%} > max_rate={cfg.max_rate:.1%}, steps {first}-{entry[0]})")
        if nonfinite:
            cause = "nonfinite_data"
            message += f"; the loss or inputs were inf/NaN on {len(nonfinite)} of them"
            fix = "find the non-finite samples or op with MixedPrecision(..., doctor=True)"
        else:
            cause = "gradient_overflow"
            fix = ("gradients overflow fp16 often: raise DynamicLossScaler(growth_interval=...) so the scale "
                   "grows less eagerly, keep the overflowing module in fp32, or train in bf16")
        evidence = {"skipped": len(skipped), "window": len(self.window), "rate": rate,
                    "skipped_steps": skipped[-20:], "nonfinite_steps": nonfinite[-20:]}
        return self._event(record, code=None, message=message, fix=fix, cause=cause, evidence=evidence)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "calibrating": self.calibrating, "window": [list(e) for e in self.window]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.calibrating = bool(state.get("calibrating", True))
        self.window.clear()
        self.window.extend((int(s), bool(k), bool(b)) for s, k, b in state.get("window", []))


@dataclass(frozen=True, kw_only=True)
class GradNormSpikeAlarm(Alarm):
    """An applied step's gradient norm above ``factor`` x the running median."""

    window: int = 100
    """Applied steps in the running median."""
    factor: float = 10.0
    """How many times the median counts as a spike."""
    min_history: int = 20
    """Norms needed before the rule can fire."""

    name = "GRAD_NORM_SPIKE"

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        check_threshold(cls, "window", self.window, is_int(self.window, 1), "an int >= 1")
        check_threshold(cls, "factor", self.factor, self.factor > 1, "> 1")
        check_threshold(cls, "min_history", self.min_history, is_int(self.min_history, 1) and self.min_history <= self.window,
               "an int in [1, window]")

    def monitor(self) -> Monitor:
        return _GradNormSpikeMonitor(self)


class _GradNormSpikeMonitor(Monitor):
    config: GradNormSpikeAlarm

    def __init__(self, config: GradNormSpikeAlarm) -> None:
        super().__init__(config)
        self.history: deque[float] = deque(maxlen=config.window)

    def observe(self, record: Record) -> AlarmEvent | None:
        norm = record["grad_norm"]
        if record["skipped"] or not math.isfinite(norm):
            return None
        cfg = self.config
        event = None
        if len(self.history) >= cfg.min_history:
            median = statistics.median(self.history)
            if median > 0 and norm > cfg.factor * median:
                if not self.fired:
                    self.fired = True
                    ratio = norm / median
                    event = self._event(
                        record, code=None, cause="gradient_spike",
                        message=(f"gradient norm {norm:.4g} is {ratio:.1f}x the running median {median:.4g} "
                                 f"of the last {len(self.history)} applied steps (factor={cfg.factor:g})"),
                        fix=("lower the learning rate or warm it up longer, clip gradients "
                             "(MixedPrecision(clip_grad_norm=1.0)), and check the batch of this step"),
                        evidence={"grad_norm": norm, "median": median, "ratio": ratio,
                                  "history": len(self.history), "clip_coef": record.get("clip_coef")},
                    )
            else:
                self.fired = False
        self.history.append(norm)
        return event

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.history.clear()
        self.history.extend(float(v) for v in state.get("history", []))


@dataclass(frozen=True, kw_only=True)
class LossNonFiniteAlarm(Alarm):
    """The loss of a step was inf/NaN."""

    name = "LOSS_NONFINITE"

    def monitor(self) -> Monitor:
        return _LossNonFiniteMonitor(self)


class _LossNonFiniteMonitor(Monitor):
    def observe(self, record: Record) -> AlarmEvent | None:
        if not record["loss_nonfinite"]:
            self.fired = False
            return None
        if self.fired:
            return None
        self.fired = True
        loss, step = record["loss"], record["step"]
        if record.get("input_nonfinite"):
            message, fix = nonfinite_input(f"the loss was {loss} at step {step} and the model's floating inputs "
                                           "held inf/NaN")
            return self._event(record, code="NONFINITE_INPUT", cause="nonfinite_input", message=message, fix=fix,
                               evidence={"loss": loss, "skipped": record["skipped"]})
        inputs = ("the inputs were finite" if record.get("input_nonfinite") is not None
                  else "the inputs were not watched (call mp.prepare(model))")
        return self._event(
            record, code=None, cause="nonfinite_loss",
            message=f"the loss was {loss} at step {step} while {inputs}",
            fix=("name the overflowing op with MixedPrecision(..., doctor=True) or `ampkit doctor`; compute the "
                 "loss in fp32"),
            evidence={"loss": loss, "skipped": record["skipped"]},
        )


def default_alarms() -> list[Alarm]:
    """The five alarms with their default thresholds, all with action ``"warn"`` (``Fp8FlushAlarm`` reads
    only the fields of fp8 runs)."""
    return [ScaleCollapseAlarm(), SkipRateAlarm(), GradNormSpikeAlarm(), LossNonFiniteAlarm(), Fp8FlushAlarm()]
