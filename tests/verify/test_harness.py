"""The harness: one process per precision, progress events, and throughput measured against another clock."""

from __future__ import annotations

import statistics
import time

from ampkit.verify.harness import VerifyConfig, run_verify
from tests.verify.verify_helpers import LibraryJob, task_ref


def test_verify_progress_events_cover_every_step_of_every_run(regression_job_again: LibraryJob) -> None:
    events = regression_job_again.events
    for precision, part in (("fp32", 0), ("fp32", "noise"), ("bf16", 0)):
        mine = [e for p, e in events if p == precision and e.get("part", 0) == part]
        assert [e["step"] for e in mine if e["phase"] == "train"] == list(range(1, 41))
        assert {"phase": "done", "status": "ok", **({"part": part} if part else {})} in mine
    # the fp32 noise run (another data order, for the noise band) runs right after the baseline
    assert [(p, e.get("part", 0)) for p, e in events if e["phase"] == "setup"] == [("fp32", 0), ("fp32", "noise"),
                                                                                   ("bf16", 0)]


def test_report_throughput_agrees_with_an_independent_clock() -> None:
    """The worker's samples/s against the parent's own clock on the same run's progress lines.

    The parent timestamps every step as it arrives over the pipe, in another process with another
    clock; the mean step interval after warm-up (the intervals that hold an evaluation left out)
    gives an independent samples/s.  Both watch the same steps at the same time, so load on a
    shared machine moves both alike: this is an agreement check, not a speed assertion.  It
    catches warm-up or evaluation time counted as training, or a wrong step or sample count.
    """
    # 120 steps: a pipe reader that a loaded machine delays at the window's edges skews a short window
    # most.  No noise run: this is about the baseline's clock.
    steps, warmup, eval_every = 120, 10, 40
    config = VerifyConfig(task=task_ref("WideRegression"), precisions=("fp32",), steps=steps, warmup=warmup,
                          eval_every=eval_every, measure_env=False, noise_band=False)
    arrivals: dict[int, float] = {}

    def on_progress(precision: str, event: dict) -> None:
        if event["phase"] == "train" and "part" not in event:  # the baseline's steps, not the noise run's
            arrivals[event["step"]] = time.perf_counter()

    report = run_verify(config, on_progress=on_progress)
    run = report["runs"][0]
    assert run["status"] == "ok" and sorted(arrivals) == list(range(1, steps + 1))
    gaps = [arrivals[k + 1] - arrivals[k] for k in range(warmup, steps) if k % eval_every != 0]
    independent = report["task"]["samples_per_batch"] / statistics.mean(gaps)
    reported = run["throughput"]["samples_per_s"]
    assert run["throughput"]["timed_steps"] == steps - warmup
    assert abs(reported / independent - 1.0) <= 0.10, (reported, independent)
