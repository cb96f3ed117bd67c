"""Verdict logic against fp32: each reason to fail, and what must not fail."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ampkit.verify.compare import Tolerances, compare_runs, loss_distance, smooth

METRICS = {"acc": "higher", "bpb": "lower"}


def _run(precision: str, loss: list[float | None], *, acc: float = 0.9, bpb: float = 2.0, skipped: int = 0,
         status: str = "ok", sps: float = 100.0, mem: int = 1000, init: str = "a" * 64) -> dict[str, Any]:
    return {
        "precision": precision, "status": status, "error": None if status == "ok" else "boom",
        "loss": loss, "eval": {"acc": acc, "bpb": bpb}, "skipped_steps": skipped,
        "nonfinite_steps": sum(x is None for x in loss), "throughput": {"samples_per_s": sps},
        "memory": {"training_bytes": mem}, "init_sha256": init, "data_sha256": "b" * 64,
    }


BASE = [3.0 - 0.01 * i for i in range(100)]


def _extent(curve: list[float | None], window: int) -> float:
    smoothed = smooth(curve, window)
    return max(smoothed) - min(smoothed)


def _compare(*runs: dict[str, Any], tol: Tolerances | None = None) -> dict[str, dict[str, Any]]:
    entries = compare_runs(list(runs), metrics=METRICS, steps=100, warmup=10, tol=tol or Tolerances())
    return {e["precision"]: e for e in entries}


def test_compare_identical_run_passes_with_ratios() -> None:
    out = _compare(_run("fp32", BASE), _run("bf16", list(BASE), sps=250.0, mem=600))
    assert out["fp32"]["verdict"] == "pass" and out["fp32"]["baseline"]
    bf16 = out["bf16"]
    assert bf16["verdict"] == "pass" and bf16["loss_distance"] == 0.0
    assert bf16["speedup"] == 2.5 and bf16["memory_ratio"] == 0.6
    assert bf16["metrics"]["acc"]["delta"] == 0.0 and bf16["init_match"] and bf16["data_match"]


def test_compare_metric_worse_beyond_tolerance_fails_in_its_direction() -> None:
    out = _compare(_run("fp32", BASE), _run("bf16", BASE, acc=0.85), _run("fp16", BASE, bpb=2.1))
    assert out["bf16"]["verdict"] == "fail" and "acc 0.85 vs fp32 0.9" in out["bf16"]["reasons"][0]
    assert out["fp16"]["verdict"] == "fail" and "bpb 2.1 vs fp32 2: worsening 5.00% > tolerance 2.00%" in out["fp16"]["reasons"][0]


def test_compare_better_metric_never_fails() -> None:
    out = _compare(_run("fp32", BASE), _run("bf16", BASE, acc=0.99, bpb=1.0))
    assert out["bf16"]["verdict"] == "pass"
    assert out["bf16"]["metrics"]["bpb"]["relative_worse"] == pytest.approx(-0.5)


def test_compare_per_metric_override_replaces_the_default() -> None:
    runs = (_run("fp32", BASE), _run("bf16", BASE, acc=0.85))
    tol = Tolerances(metric_overrides={"acc": 0.1})
    assert _compare(*runs, tol=tol)["bf16"]["verdict"] == "pass"


def test_compare_loss_distance_over_tolerance_fails() -> None:
    # BASE falls by about 1 over the run; a curve 0.05 above it is off by 5 % of that range
    drifted = [x + 0.05 for x in BASE]
    out = _compare(_run("fp32", BASE), _run("bf16", drifted))
    assert out["bf16"]["loss_distance"] == pytest.approx(0.05 / _extent(BASE, 5))
    assert any(r.startswith("loss-curve distance 5.") and r.endswith("> tolerance 3.00%") for r in out["bf16"]["reasons"])
    assert _compare(_run("fp32", BASE), _run("bf16", drifted), tol=Tolerances(loss=0.06))["bf16"]["verdict"] == "pass"


def test_compare_loss_distance_is_not_inflated_by_a_loss_near_zero() -> None:
    # a classifier trained to ~0 loss: bf16 ends at 0.002 instead of 0.001, twice fp32's loss but a
    # negligible gap against the 2.3 the loss travelled
    base = [2.3 * 0.9**i + 0.001 for i in range(100)]
    run = [b + 0.001 for b in base]
    out = _compare(_run("fp32", base), _run("bf16", run))
    assert out["bf16"]["loss_distance"] == pytest.approx(0.001 / _extent(base, 5))
    assert out["bf16"]["verdict"] == "pass"


def test_compare_skipped_and_nonfinite_fractions_fail() -> None:
    with_nan = list(BASE)
    with_nan[50] = None
    out = _compare(_run("fp32", BASE), _run("fp16", BASE, skipped=6), _run("bf16", with_nan))
    assert any("6 of 100 steps skipped (6.0% > 5.0% allowed)" in r for r in out["fp16"]["reasons"])
    assert any("1 of 100 losses non-finite" in r for r in out["bf16"]["reasons"])


def test_compare_crashed_run_and_crashed_baseline() -> None:
    out = _compare(_run("fp32", BASE), _run("bf16", [], status="failed"))
    assert out["bf16"]["verdict"] == "fail" and out["bf16"]["reasons"][0] == "run failed: boom"
    out = _compare(_run("fp32", [], status="failed"), _run("bf16", BASE))
    assert out["fp32"]["verdict"] == "fail"
    assert out["bf16"]["reasons"] == ["the fp32 baseline did not complete, so nothing can be compared"]


def test_compare_different_initial_weights_fail() -> None:
    out = _compare(_run("fp32", BASE), _run("bf16", BASE, init="c" * 64))
    assert not out["bf16"]["init_match"]
    assert any("initial weights differ" in r for r in out["bf16"]["reasons"])


def test_compare_min_speedup_is_checked_only_when_asked() -> None:
    runs = (_run("fp32", BASE), _run("bf16", BASE, sps=90.0))
    out = _compare(*runs)
    assert out["bf16"]["verdict"] == "pass" and "slower than fp32" in out["bf16"]["notes"][0]
    assert _compare(*runs, tol=Tolerances(min_speedup=1.2))["bf16"]["verdict"] == "fail"


def test_loss_distance_ignores_warmup_and_smooths_noise() -> None:
    base = [2.0 - i / 40 for i in range(40)]  # range 0.975
    noisy = [b + (0.1 if i % 2 else -0.1) for i, b in enumerate(base)]
    assert loss_distance(noisy, base, warmup=0, window=1) == pytest.approx(0.1 / 0.975)
    # a 2-step window averages each +0.1 with a -0.1 neighbour; only the last step keeps its noise
    assert loss_distance(noisy, base, warmup=4, window=2) == pytest.approx(0.1 / 36 / _extent(base, 2))
    spiky = [b + (5.0 if i < 5 else 0.0) for i, b in enumerate(base)]
    assert loss_distance(spiky, base, warmup=5, window=1) == 0.0


def test_loss_distance_is_infinite_when_a_window_has_no_finite_loss() -> None:
    broken: list[float | None] = [1.0] * 10 + [None] * 10
    assert math.isinf(loss_distance(broken, [1.0] * 20, warmup=0, window=3))
    assert smooth([None, 2.0], 1)[0] != smooth([None, 2.0], 1)[0]  # NaN where the window is empty


ENV_NO_FAST_BF16 = {"cpu": {"model": "AVX2-only CPU", "fast_bf16": False, "fast_fp16": False,
                            "flags": {"avx512_bf16": False, "amx_bf16": False, "avx2": True}},
                    "matmul_tflops": {"cpu": {"fp32": 0.4, "bf16": 0.02}}}


def test_compare_slower_low_precision_passes_numerics_with_the_hardware_facts() -> None:
    runs = [dict(_run("fp32", BASE), device="cpu"), dict(_run("bf16", BASE, sps=5.0), device="cpu")]
    bf16 = compare_runs(runs, metrics=METRICS, steps=100, warmup=10, tol=Tolerances(),
                        environment=ENV_NO_FAST_BF16)[1]
    assert bf16["verdict"] == "pass" and bf16["numerics"] == "pass"
    assert bf16["summary"] == "numerics within tolerance; no speed-up on this hardware (0.05x)"
    assert bf16["hardware"]["fast_path"] is False and bf16["hardware"]["facts"]["matmul_tflops"]["ratio"] == 0.05
    assert "no fast bf16 path (ampkit env: fast bf16 no, avx512_bf16 no, amx_bf16 no, avx2 yes)" in bf16["notes"][0]


def test_compare_min_speedup_failure_is_a_speed_failure_not_a_numerics_one() -> None:
    runs = [_run("fp32", BASE), _run("bf16", BASE, sps=5.0)]
    bf16 = compare_runs(runs, metrics=METRICS, steps=100, warmup=10, tol=Tolerances(min_speedup=1.0))[1]
    assert bf16["verdict"] == "fail" and bf16["numerics"] == "pass"
    assert bf16["reasons"] == ["speed-up 0.05x below the required 1.00x"]
    assert bf16["summary"].startswith("numerics within tolerance; no speed-up on this hardware")
