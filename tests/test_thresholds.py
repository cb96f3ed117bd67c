"""Thresholded verdicts: the borderline band of every rule, on synthetic values (no CPU decides them)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import get_args

import pytest
import torch

from ampkit.diagnose.core.perf import EXTRA_ROUNDS, robust_samples, speed_outcome
from ampkit.diagnose.script.rules import _collapsed
from ampkit.diagnose.script.services.scalers import ScalerInfo
from ampkit.diagnose.step.compare import GradComparison, precision_findings, underflow_finding
from ampkit.findings import CODES, Finding
from ampkit.thresholds import THRESHOLDS, RuleName, Threshold, as_borderline, is_borderline

DOCS = Path(__file__).resolve().parents[1] / "docs" / "findings.md"


@pytest.mark.parametrize(("value", "outcome"), [
    (10.0, "reported"), (18.49, "reported"), (18.5, "borderline"), (20.0, "borderline"), (21.5, "borderline"),
    (21.51, "clear"), (60.0, "clear"), (math.nan, "clear"),
])
def test_threshold_below_rule_judges_each_side_of_the_band(value: float, outcome: str) -> None:
    assert THRESHOLDS["PRECISION_LOSS"].judge(value) == outcome


@pytest.mark.parametrize(("value", "outcome"), [
    (0.0, "clear"), (0.0049, "clear"), (0.005, "borderline"), (0.015, "borderline"), (0.0151, "reported"),
    (0.9, "reported"),
])
def test_threshold_above_rule_judges_each_side_of_the_band(value: float, outcome: str) -> None:
    assert THRESHOLDS["GRADIENT_UNDERFLOW"].judge(value) == outcome


def test_threshold_relative_band_scales_with_the_threshold() -> None:
    rule = THRESHOLDS["SLOW_LOW_PRECISION"]
    assert rule.band == pytest.approx(0.9 * 0.12)
    assert [rule.judge(v) for v in (0.78, 0.80, 1.0, 1.02)] == ["reported", "borderline", "borderline", "clear"]
    tiny = rule.at(1e-9)
    assert tiny.band == pytest.approx(1.2e-10) and tiny.judge(0.05) == "clear"


def test_threshold_at_keeps_the_margin_and_moves_the_band() -> None:
    rule = THRESHOLDS["PRECISION_LOSS"].at(30.0)
    assert (rule.threshold, rule.margin) == (30.0, 1.5)
    assert rule.judge(29.0) == "borderline" and rule.judge(20.0) == "reported"


def test_threshold_evidence_names_value_threshold_margin_and_outcome() -> None:
    assert THRESHOLDS["SCALE_COLLAPSE"].evidence(0.55) == {
        "metric": "late_skip_share", "value": 0.55, "threshold": 0.5, "margin": 0.1, "reports_when": "above",
        "outcome": "borderline"}


def test_threshold_as_borderline_is_info_with_the_original_fix_kept_as_the_remedy() -> None:
    rule = Threshold(code="PRECISION_LOSS", metric="sqnr_db", threshold=20.0, reports_when="below", margin=1.5,
                     unit="dB")
    f = Finding(code="PRECISION_LOSS", severity="warning", message="m", fix="keep head in fp32", module="head",
                evidence={"sqnr_db": 19.0})
    b = as_borderline(f, rule, 19.0)
    assert (b.code, b.module, b.severity) == ("PRECISION_LOSS", "head", "info")
    assert "19 dB, within ±1.5 dB of the 20 dB threshold" in b.message and b.fix.endswith("keep head in fp32")
    assert b.evidence["sqnr_db"] == 19.0 and b.evidence["judgement"]["outcome"] == "borderline"
    assert is_borderline(b) and is_borderline(b.to_dict()) and not is_borderline(f)


def test_threshold_is_borderline_needs_info_severity() -> None:
    assert not is_borderline({"severity": "warning", "evidence": {"borderline": True}})
    assert not is_borderline({"severity": "info", "evidence": {}})


def _sqnr_findings(out_sqnr: dict[str, float]) -> list[Finding]:
    return precision_findings(order=list(out_sqnr), out_sqnr=out_sqnr, grads=None, threshold_db=20.0,
                              underflow_threshold=0.01, precision="bf16", loss_scale=1.0, step=3)


def test_threshold_precision_loss_within_the_band_is_one_borderline_info_row() -> None:
    (f,) = _sqnr_findings({"embed": 45.0, "head": 19.2, "": 33.0})
    assert (f.code, f.module, f.severity) == ("PRECISION_LOSS", "head", "info")
    assert f.evidence["borderline"] and f.evidence["judgement"]["value"] == 19.2


def test_threshold_precision_loss_beyond_the_band_wins_over_a_borderline_module() -> None:
    (f,) = _sqnr_findings({"head": 19.5, "norm": 4.0, "": 3.0})
    assert (f.module, f.severity) == ("norm", "warning")
    assert f.evidence["judgement"] == {"metric": "sqnr_db", "value": 4.0, "threshold": 20.0, "margin": 1.5,
                                       "reports_when": "below", "outcome": "reported"}


def test_threshold_precision_loss_clear_of_the_band_reports_nothing() -> None:
    assert _sqnr_findings({"head": 21.6, "": 40.0}) == []


def _underflow(shares: dict[str, tuple[int, int]]) -> Finding | None:
    return underflow_finding(GradComparison(underflow=shares), threshold=0.01, precision="fp16", loss_scale=1.0,
                             step=None)


def test_threshold_gradient_underflow_share_in_the_band_is_borderline() -> None:
    f = _underflow({"stem": (12, 1000), "head": (1, 1000)})
    assert f is not None and (f.module, f.severity) == ("stem", "info") and f.evidence["borderline"]


def test_threshold_gradient_underflow_share_beyond_the_band_is_a_warning_with_its_judgement() -> None:
    f = _underflow({"stem": (12, 1000), "blocks.3": (400, 1000)})
    assert f is not None and (f.module, f.severity) == ("blocks.3", "warning")
    assert f.evidence["judgement"]["value"] == 0.4 and f.evidence["judgement"]["outcome"] == "reported"
    assert _underflow({"stem": (4, 1000)}) is None


def _scaler() -> ScalerInfo:
    return ScalerInfo(location="train.py:9", device="cpu", requested=True, enabled=True, init_scale=65536.0,
                      scales=[(i, 2.0**10) for i in range(40)])


@pytest.mark.parametrize(("steps", "late_skips", "outcome"), [
    (40, 7, "clear"),  # fewer than 8 late skips: never a collapse
    (60, 9, "clear"), (40, 8, "borderline"), (40, 12, "borderline"), (40, 13, "reported"), (40, 20, "reported"),
])
def test_threshold_scale_collapse_late_skip_share_is_judged_with_the_band(steps: int, late_skips: int,
                                                                          outcome: str) -> None:
    # The first `late_skips` steps of the run's second half were skipped (steps are counted from 1).
    half = steps // 2
    skips = dict.fromkeys(range(half + 1, half + 1 + late_skips), "gradient_overflow")
    judged, _, share = _collapsed(_scaler(), skips, steps)
    assert judged == outcome
    if outcome != "clear":
        assert share == late_skips / (steps - half)


def test_threshold_scale_collapse_below_one_is_reported_whatever_the_share() -> None:
    info = _scaler()
    info.scales.append((40, 0.5))
    assert _collapsed(info, {3: "gradient_overflow"}, 41)[0] == "reported"


def test_threshold_speed_outcome_uses_the_median_of_every_round() -> None:
    rule = THRESHOLDS["SLOW_LOW_PRECISION"]
    samples = {torch.float32: [1.0, 1.0, 9.0], torch.bfloat16: [0.5, 0.95, 0.95]}
    assert speed_outcome(samples, torch.bfloat16, rule) == (0.95, "borderline")
    samples[torch.bfloat16] += [0.1, 0.1, 0.1, 0.1]
    assert speed_outcome(samples, torch.bfloat16, rule)[1] == "reported"


@pytest.mark.parametrize(("ratios", "asked"), [
    ([0.04], [1]),  # emulated low precision: far below the band, one round decides
    ([2.1], [1]),  # bf16 units: far above it
    ([0.6, 0.6, 0.6], [1, 2]),  # below the band, not by half again: the usual three rounds
    ([0.95, 0.95, 0.95, *[0.95] * EXTRA_ROUNDS], [1, 2, EXTRA_ROUNDS]),  # borderline after three: more rounds
])
def test_speed_rounds_one_only_when_decided_three_else_more_inside_the_band(ratios: list[float],
                                                                            asked: list[int]) -> None:
    rule, made, calls = THRESHOLDS["SLOW_LOW_PRECISION"], iter(ratios), []

    def take(k: int) -> dict[str, list[float]]:  # k rounds of (fp32, low) throughput with the given ratios
        calls.append(k)
        low = [next(made) for _ in range(k)]
        return {"fp32": [1.0] * k, "low": low}

    measured = robust_samples(take, lambda s: statistics.median(s["low"]) / statistics.median(s["fp32"]), rule, 3)
    assert calls == asked and len(measured.samples["low"]) == sum(asked)


def test_threshold_table_in_the_docs_matches_the_rules() -> None:
    text = DOCS.read_text()
    for code, rule in THRESHOLDS.items():
        band = f"±{rule.margin:g}" + (" × threshold" if rule.relative else "")
        row = f"| `{code}` | `{rule.metric}` | {rule.reports_when} {rule.threshold:g} | {band} |"
        assert row in text, f"docs/findings.md lacks the row {row!r}"


def test_threshold_rule_names_are_the_table_keys_and_each_rule_decides_a_finding_code() -> None:
    assert list(get_args(RuleName)) == list(THRESHOLDS)
    assert {rule.code for rule in THRESHOLDS.values()} <= set(CODES)
    # A rule name that is no finding code names a second rule of one code, never a code of its own.
    assert {name: rule.code for name, rule in THRESHOLDS.items() if name not in CODES} == {
        "PRECISION_LOSS_FP8": "PRECISION_LOSS"}
