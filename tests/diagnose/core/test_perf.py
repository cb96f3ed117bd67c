"""The speed verdicts (SLOW_LOW_PRECISION, SLOW_FP8_GEMM) under load: measured on the thread's CPU clock,
settled before a verdict contradicts the capability probe, and the load recorded."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import pytest
import torch

from ampkit.diagnose.core.perf import (
    SETTLE_ROUNDS,
    Measured,
    disturbed_finding,
    low_precision_speed,
    robust_samples,
)
from ampkit.findings import Finding
from ampkit.precision import cpu_has_fast_bf16
from ampkit.thresholds import THRESHOLDS
from tests.helpers.processes import busy_cores


def _verdict(finding: Finding | None) -> str:
    if finding is None:
        return "clear"
    if finding.evidence.get("borderline"):
        return f"{finding.code} borderline"
    return f"{finding.code} {finding.severity}"


def _expected_bf16_verdict() -> str | None:
    """What bf16 must be judged where the CPU's answer is known: clear with bf16 units the kernels may use,
    slow under the emulated AVX2 CPU (bf16 about 0.03x fp32); None elsewhere (a CPU whose bf16 speed no
    flag predicts)."""
    if cpu_has_fast_bf16():
        return "clear"
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default"):
        return "SLOW_LOW_PRECISION warning"
    return None


def test_perf_slow_low_precision_verdict_is_the_same_idle_and_with_every_core_busy() -> None:
    torch.manual_seed(0)
    idle = _verdict(low_precision_speed("bf16", "cpu"))
    with busy_cores():
        busy = [_verdict(low_precision_speed("bf16", "cpu")) for _ in range(2)]
    assert busy == [idle] * 2
    expected = _expected_bf16_verdict()
    assert expected is None or idle == expected


def _scripted(ratios: list[float]) -> tuple[list[int], Callable[[int], dict[str, list[float]]]]:
    """A ``take`` whose rounds have the given low/fp32 ratios (fp32 at 1.0), and the list of its calls."""
    made, calls = iter(ratios), []

    def take(k: int) -> dict[str, list[float]]:
        calls.append(k)
        return {"fp32": [1.0] * k, "low": [next(made) for _ in range(k)]}

    return calls, take


def _median_ratio(s: dict[str, list[float]]) -> float:
    return statistics.median(s["low"]) / statistics.median(s["fp32"])


def test_perf_slow_round_that_contradicts_the_probe_does_not_decide_alone() -> None:
    rule = THRESHOLDS["SLOW_LOW_PRECISION"]
    calls, take = _scripted([0.3, 0.4, 0.35, 2.1, 2.0, 2.2])  # disturbed rounds, then bf16 units
    measured = robust_samples(take, _median_ratio, rule, 3, expect_clear=True)
    assert calls == [1, 2, 1, 1, 1] and rule.judge(_median_ratio(measured.samples)) == "clear"


def test_perf_slow_verdict_against_the_probe_stands_on_the_rounds_that_settled() -> None:
    rule = THRESHOLDS["SLOW_LOW_PRECISION"]
    calls, take = _scripted([0.3, 0.9, 0.5, 0.5, 0.52])
    measured = robust_samples(take, _median_ratio, rule, 3, expect_clear=True)
    assert calls == [1, 2, 1, 1] and measured.settled and measured.samples["low"] == [0.5, 0.5, 0.52]
    assert measured.round_ratios == [0.3, 0.9, 0.5, 0.5, 0.52] and rule.judge(0.5) == "reported"


def test_perf_unsettled_slow_verdict_against_the_probe_stops_at_the_budget_unsettled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ampkit.diagnose.core.perf.SETTLE_BUDGET_S", 0.0)
    rule = THRESHOLDS["SLOW_LOW_PRECISION"]
    calls, take = _scripted([0.3, 0.7, 0.4])
    measured = robust_samples(take, _median_ratio, rule, 3, expect_clear=True)
    assert calls == [1, 2] and not measured.settled and measured.round_ratios == [0.3, 0.7, 0.4]


def test_perf_slow_round_without_the_probe_still_decides_alone() -> None:
    calls, take = _scripted([0.03])
    measured = robust_samples(take, _median_ratio, THRESHOLDS["SLOW_LOW_PRECISION"], 3)
    assert calls == [1] and measured.round_ratios == [0.03]


def test_perf_disturbed_finding_is_info_with_the_load_in_its_evidence() -> None:
    rule = THRESHOLDS["SLOW_LOW_PRECISION"]
    measured = Measured(samples={"fp32": [1.0] * 3, "low": [0.3, 0.7, 0.4]}, round_ratios=[0.3, 0.7, 0.4],
                        settled=False, thread_clock=True, wall_s=3.1, cpu_share=0.31, load_average=7.5)
    f = disturbed_finding("SLOW_LOW_PRECISION", rule, 0.4, measured, subject="bf16 measured 0.40× fp32",
                          capability="this CPU has bf16 units")
    assert (f.code, f.severity, f.evidence["disturbed"], f.evidence["ratio_vs_fp32"]) == (
        "SLOW_LOW_PRECISION", "info", True, 0.4)
    assert f.message.startswith("measurement disturbed") and "31% of a core" in f.message and "7.5" in f.message
    m = f.evidence["measurement"]
    assert (m["clock"], m["threads"], m["cpu_share"], m["load_average_1m"], m["settled"]) == (
        "thread_cpu", 1, 0.31, 7.5, False)
    assert m["spread"] == pytest.approx(1.0) and m["round_ratios"] == [0.3, 0.7, 0.4]
    assert "fp32" not in f.fix and "MixedPrecision" not in f.fix


def test_perf_slow_low_precision_records_its_clock_and_load() -> None:
    f = low_precision_speed("fp16", "cpu", slow_ratio=1e9)
    assert f is not None
    m = f.evidence["measurement"]
    assert m["clock"] == "thread_cpu" and m["threads"] == 1 and 0 < m["cpu_share"] <= 1.05
    assert len(m["round_ratios"]) >= m["rounds_judged"] == f.evidence["rounds"] >= 1
    assert os.name == "nt" or m["load_average_1m"] >= 0
    assert len(m["round_ratios"]) >= SETTLE_ROUNDS or not m["settled"]
