"""Time budget arithmetic: durations, measured step times, the equal step count that fits."""

from __future__ import annotations

import pytest

from ampkit.verify.budget import (
    MIN_STEPS,
    Cost,
    DurationError,
    RunEstimate,
    Timeline,
    fit_steps,
    parse_duration,
)


@pytest.mark.parametrize(("text", "seconds"), [("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("1h", 3600.0),
                                               ("1.5h", 5400.0), (" 2M ", 120.0)])
def test_parse_duration_reads_seconds_and_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "5d", "-5", "0", "0s", "1m30s", "inf"])
def test_parse_duration_rejects_bad_values_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(DurationError, match=r"(90s, 5m, 1h|more than 0 seconds)"):
        parse_duration(text)


def test_fit_steps_shrinks_equally_to_the_largest_count_that_fits() -> None:
    costs = {"fp32": Cost(2.0, 0.1, 1.0), "bf16": Cost(2.0, 1.9, 1.0)}
    fit = fit_steps(costs, steps=200, warmup=10, eval_every=50, available_s=100.0)
    # 4 s of setup + n × 2 s of steps + one evaluation at the end of each run (2 s) = 100 s at n = 47
    assert (fit.steps, fit.warmup, fit.eval_every, fit.fits) == (47, 10, 47, True)
    assert fit.estimate_s <= 100.0 < sum(c.run_s(48, 48) for c in costs.values())


def test_fit_steps_keeps_the_plan_when_it_fits_and_the_minimum_when_nothing_does() -> None:
    costs = {"fp32": Cost(1.0, 0.01, 0.1)}
    assert fit_steps(costs, steps=120, warmup=10, eval_every=40, available_s=60.0).steps == 120
    tiny = fit_steps(costs, steps=120, warmup=15, eval_every=40, available_s=0.5)
    assert (tiny.steps, tiny.warmup, tiny.fits) == (MIN_STEPS, MIN_STEPS // 2, False)


def test_timeline_step_time_leaves_out_the_first_step_and_evaluations() -> None:
    line = Timeline()
    events = [({"phase": "launch"}, 0.0), ({"phase": "train", "step": 1}, 5.0), ({"phase": "train", "step": 2}, 6.0),
              ({"phase": "eval", "step": 2, "seconds": 3.0}, 9.0), ({"phase": "train", "step": 3}, 10.0),
              ({"phase": "train", "step": 4}, 11.0)]
    for event, now in events:
        line.feed(event, now)
    assert line.cost() == Cost(setup_s=4.0, step_s=1.0, eval_s=3.0)


def test_run_estimate_counts_runs_not_started_with_the_slowest_measured_cost() -> None:
    estimate = RunEstimate(["fp32/0", "bf16/0"], steps=10, eval_every=10)
    for event, now in [({"phase": "launch"}, 0.0), ({"phase": "train", "step": 1}, 2.0),
                       ({"phase": "train", "step": 2}, 3.0)]:
        estimate.feed("fp32/0", event, now)
    # fp32: 8 steps of 1 s left; bf16 not started: setup 1 s + 10 steps of 1 s (no evaluation measured yet)
    assert estimate.left_s() == pytest.approx(8.0 + 11.0)


def test_run_estimate_is_unknown_until_a_step_time_is_measured_even_after_a_run_failed_early() -> None:
    estimate = RunEstimate(["fp32/0", "bf16/0"], steps=10, eval_every=10)
    estimate.feed("fp32/0", {"phase": "launch"}, 0.0)
    estimate.feed("bf16/0", {"phase": "launch"}, 1.0)  # fp32 died before its first step: nothing measured
    assert estimate.cost("bf16/0") is None and estimate.left_s() is None
