"""Time for ``ampkit verify``: step times measured from the workers' progress, estimates, ``--time-budget``.

Pure Python (no torch): the CLI parses ``--time-budget`` with it before anything heavy is imported.

A run's cost is modelled as ``setup + steps × step + evaluations × eval`` per precision, each
term measured from the progress lines a worker prints as they arrive in the parent:

- ``step``: the median gap between consecutive ``train`` events, leaving out the gaps that
  hold an evaluation and the first step (lazy kernel set-up).  The median ignores the odd slow
  step that a loaded machine causes;
- ``eval``: the seconds the worker reports for each evaluation (its ``eval`` events);
- ``setup``: from the launch of the worker process to its first step, less one step (the
  interpreter, torch's import, the model and the hashes).

With ``--time-budget`` the harness first probes every precision for ``PROBE_STEPS`` steps
(one evaluation included) and then picks the largest step count, equal for every precision,
whose estimate fits what the probe left of the budget (``fit_steps``).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUDGET_SAFETY", "MIN_STEPS", "PROBE_STEPS", "Cost", "DurationError", "Fit", "ProgressLog",
           "RunEstimate", "Timeline", "evaluations", "fit_steps", "format_duration", "parse_duration"]

PROBE_STEPS = 3
"""Steps of each precision's probe: the 2 gaps after the first step (kernel set-up) give the step time; few, since a
precision without a fast path can take half a minute a step on a 2-core CPU."""
MIN_STEPS = 10
"""The fewest steps a budgeted run shrinks to (or the planned count, if smaller); half at most is warm-up."""
BUDGET_SAFETY = 0.9
"""Only 90 % of what is left after the probe is planned: a shared machine's speed drifts during a run."""

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


class DurationError(ValueError):
    """A duration that cannot be read; the message shows the accepted forms."""


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number of seconds, or a number with ``s``, ``m`` or ``h`` (``90s``, ``5m``, ``1.5h``).

    >>> parse_duration("90"), parse_duration("5m"), parse_duration("1.5h"), parse_duration("45s")
    (90.0, 300.0, 5400.0, 45.0)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*", str(text).lower())
    if match is None:
        raise DurationError(f"{text!r} is not a duration: write seconds (300), or a number with s, m or h "
                            "(90s, 5m, 1h)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not 0 < seconds < math.inf:
        raise DurationError(f"{text!r}: a time budget must be more than 0 seconds (for example 5m)")
    return seconds


def format_duration(seconds: float | None) -> str:
    """``4s``, ``2m05s``, ``1h03m``; ``?`` when unknown.

    >>> format_duration(4.2), format_duration(125), format_duration(3790)
    ('4s', '2m05s', '1h03m')
    """
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def evaluations(steps: int, eval_every: int) -> int:
    """Evaluations in a run: every ``eval_every`` steps and always at the end."""
    return steps // eval_every + (1 if steps % eval_every else 0)


@dataclass(frozen=True)
class Cost:
    """One precision's measured costs, in seconds."""

    setup_s: float
    step_s: float
    eval_s: float

    def run_s(self, steps: int, eval_every: int) -> float:
        return self.setup_s + steps * self.step_s + evaluations(steps, eval_every) * self.eval_s

    def to_dict(self) -> dict[str, float]:
        return {"setup_s": self.setup_s, "step_s": self.step_s, "eval_s": self.eval_s}


@dataclass
class Timeline:
    """The progress events of one worker with their arrival times; ``cost()`` once a step gap is known."""

    launched: float | None = None
    steps_done: int = 0
    first_step_at: float | None = None
    last_at: float | None = None
    after_eval: bool = False
    gaps: list[float] = field(default_factory=list)
    evals: list[float] = field(default_factory=list)

    def feed(self, event: dict[str, Any], now: float) -> None:
        phase = event.get("phase")
        if phase == "launch" or (self.launched is None and phase == "setup"):
            self.launched = now
        elif phase == "train":
            if self.last_at is not None and not self.after_eval and self.steps_done >= 1:
                self.gaps.append(now - self.last_at)
            if self.first_step_at is None:
                self.first_step_at = now
            self.steps_done, self.last_at, self.after_eval = int(event["step"]), now, False
        elif phase == "eval":
            self.evals.append(float(event.get("seconds") or 0.0))
            self.after_eval = True

    def cost(self, fallback_eval: float = 0.0) -> Cost | None:
        if not self.gaps:
            return None
        step = statistics.median(self.gaps)
        setup = 0.0
        if self.launched is not None and self.first_step_at is not None:
            setup = max(0.0, self.first_step_at - self.launched - step)
        return Cost(setup, step, max(self.evals) if self.evals else fallback_eval)


@dataclass(frozen=True)
class Fit:
    """``fit_steps``'s answer: the equal plan for every precision and its estimate."""

    steps: int
    warmup: int
    eval_every: int
    estimate_s: float
    fits: bool


def _plan_for(steps: int, warmup: int, eval_every: int) -> tuple[int, int]:
    return min(warmup, steps // 2), min(eval_every, steps)


def fit_steps(costs: dict[str, Cost], *, steps: int, warmup: int, eval_every: int, available_s: float) -> Fit:
    """The largest step count ``<= steps``, the same for every precision, whose runs fit ``available_s``.

    Never below ``MIN_STEPS`` (or ``steps`` if that is smaller): then ``fits`` is False.  Warm-up
    shrinks to at most half the steps, and evaluation happens at least at the end.

    >>> c = {"fp32": Cost(1.0, 0.1, 0.5), "bf16": Cost(1.0, 0.9, 2.0)}
    >>> fit_steps(c, steps=200, warmup=10, eval_every=40, available_s=60.0)
    Fit(steps=53, warmup=10, eval_every=40, estimate_s=60.0, fits=True)
    >>> fit_steps(c, steps=200, warmup=10, eval_every=40, available_s=6.0)  # too small: the minimum
    Fit(steps=10, warmup=5, eval_every=10, estimate_s=14.5, fits=False)
    """
    def total(n: int) -> float:
        _, every = _plan_for(n, warmup, eval_every)
        return sum(c.run_s(n, every) for c in costs.values())

    floor = min(steps, MIN_STEPS)
    lo, hi = floor, steps
    if total(hi) <= available_s:
        lo = hi
    elif total(lo) > available_s:
        hi = lo
    while lo < hi:  # total() grows with n: the largest n that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= available_s else (lo, mid - 1)
    w, every = _plan_for(lo, warmup, eval_every)
    return Fit(lo, w, every, round(total(lo), 3), total(lo) <= available_s)


class RunEstimate:
    """Time left in a verify job, from the costs known up front (a probe) or measured as runs go.

    A run not started yet is estimated with its probed cost, else with the slowest cost measured
    so far (an unknown low precision is at least as slow as fp32 often enough on a CPU).
    """

    def __init__(self, runs: list[str], steps: int, eval_every: int, costs: dict[str, Cost] | None = None) -> None:
        self.runs, self.steps, self.eval_every = runs, steps, eval_every
        self.known: dict[str, Cost] = dict(costs or {})
        self.lines: dict[str, Timeline] = {}
        self.finished: set[str] = set()
        self.current: str | None = None

    def feed(self, run: str, event: dict[str, Any], now: float) -> None:
        self.current = run
        self.lines.setdefault(run, Timeline()).feed(event, now)
        if event.get("phase") == "done":
            self.finished.add(run)

    def _measured(self, run: str) -> Cost | None:
        line = self.lines.get(run)
        return line.cost(self.known[run].eval_s if run in self.known else 0.0) if line else None

    def cost(self, run: str) -> Cost | None:
        measured = self._measured(run)
        if measured is not None:
            return measured
        if run in self.known:
            return self.known[run]
        others = [c for c in (self._measured(r) for r in self.runs) if c is not None] + list(self.known.values())
        return max(others, key=lambda c: c.step_s, default=None)

    def left_s(self) -> float | None:
        total = 0.0
        for run in self.runs:
            if run in self.finished:
                continue
            cost = self.cost(run)
            if cost is None:
                return None
            line = self.lines.get(run)
            done = line.steps_done if line else 0
            evals_left = evaluations(self.steps, self.eval_every) - evaluations(done, self.eval_every) if done else \
                evaluations(self.steps, self.eval_every)
            total += (0.0 if line else cost.setup_s) + (self.steps - done) * cost.step_s + evals_left * cost.eval_s
        return total


class ProgressLog:
    """Plain progress lines for logs and pipes: every ``every_s`` seconds or ``every_fraction`` of the steps."""

    def __init__(self, total_steps: int, start: float, *, every_s: float = 10.0, every_fraction: float = 0.1) -> None:
        self.total_steps, self.start = total_steps, start
        self.every_s, self.every_fraction = every_s, every_fraction
        self._last_time, self._last_fraction = start, 0.0

    def due(self, done_steps: int, now: float) -> bool:
        fraction = done_steps / self.total_steps if self.total_steps else 1.0
        if now - self._last_time >= self.every_s or fraction - self._last_fraction >= self.every_fraction - 1e-9:
            self._last_time, self._last_fraction = now, fraction
            return True
        return False

    def line(self, label: str, step: int, steps: int, done_steps: int, now: float, left_s: float | None,
             step_s: float | None) -> str:
        pct = 100 * done_steps / self.total_steps if self.total_steps else 100.0
        rate = f", {step_s:.3g} s/step" if step_s else ""
        return (f"verify: {label} step {step}/{steps}{rate} · {pct:.0f}% of the run · elapsed "
                f"{format_duration(now - self.start)} · about {format_duration(left_s)} left")
