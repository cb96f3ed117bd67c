"""The fp32 noise band: pass, fail and inconclusive where each belongs, on tasks whose noise is known.

``Regression`` (batch 256) has a narrow fp32 band, ``LabelNoise`` (noisy labels, batch 8) a wide
one, and ``OffsetTarget`` a real bf16 failure (a signal of +-1 around 256, where bf16's spacing is
2).  Every job is a real ``ampkit verify`` run through the CLI: real workers, a real noise run.
"""

from __future__ import annotations

import math
from pathlib import Path

import jsonschema
import pytest

from ampkit.verify.noise import MIN_RESOLVED_STEPS, NOISE_K, NOISE_SEED_OFFSET, judge
from ampkit.verify.report import load_schema
from tests.verify.verify_helpers import Job, task_ref, verify

_JOBS: dict[str, Job] = {}


def _job(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Job:
    """One verify job per (task, arguments) and session: several tests read each report."""
    key = " ".join((name, *args))
    if key not in _JOBS:
        out = tmp_path_factory.mktemp(name.lower())
        _JOBS[key] = verify(out, task_ref(name), "--precisions", "fp32,bf16", "--seed", "7", *args)
    return _JOBS[key]


@pytest.fixture(scope="module")
def quiet(regression_job: Job) -> Job:
    """Regression, fp32,bf16, seed 7, through the CLI: the session's ``regression_job`` is that very job
    (it also measures the environment, which no test here reads), so it is not run a second time."""
    return regression_job


@pytest.fixture(scope="module")
def noisy(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _job(tmp_path_factory, "LabelNoise")


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Job:
    return _job(tmp_path_factory, "OffsetTarget")


def test_judge_passes_only_when_the_tolerance_is_resolved() -> None:
    assert judge(0.01, 0.03, band=0.005, k=3, resolved_steps=MIN_RESOLVED_STEPS).verdict == "pass"
    assert judge(0.01, 0.03, band=0.011, k=3, resolved_steps=100).verdict == "inconclusive"  # 3 x 1.1% > 3%
    assert judge(0.01, 0.03, band=0.005, k=3, resolved_steps=MIN_RESOLVED_STEPS - 1).verdict == "inconclusive"
    missing = judge(0.01, 0.03, band=None, k=3, resolved_steps=100, band_missing="the noise run failed")
    assert missing.verdict == "inconclusive" and "the noise run failed" in missing.reason


def test_judge_fails_only_beyond_both_the_tolerance_and_the_noise() -> None:
    assert judge(0.10, 0.03, band=0.02, k=3, resolved_steps=5).verdict == "fail"  # few steps do not hide 10%
    inside = judge(0.05, 0.03, band=0.02, k=3, resolved_steps=100)
    assert inside.verdict == "inconclusive" and "inside 3 x the fp32 noise band" in inside.reason
    # without a band (--no-noise-band) the tolerance alone decides
    assert judge(0.05, 0.03, band=None, k=3, resolved_steps=None).verdict == "fail"
    assert judge(0.02, 0.03, band=None, k=3, resolved_steps=None).verdict == "pass"


def test_a_low_precision_within_a_narrow_band_passes_and_exits_0(quiet: Job) -> None:
    assert quiet.code == 0 and quiet.report["verdict"] == "pass"
    band = quiet.report["noise"]["band"]
    assert band["missing"] is None and NOISE_K * band["loss_distance"] <= 0.03
    checks = {c["check"]: c for c in quiet.comparison("bf16")["checks"]}
    assert set(checks) == {"loss_distance", "metric:mse", "metric:r2"}
    assert all(c["verdict"] == "pass" and c["k"] == NOISE_K for c in checks.values())
    assert checks["loss_distance"]["band"] == band["loss_distance"]


def test_the_noise_run_shares_the_weights_but_not_the_data_order(quiet: Job) -> None:
    report = quiet.report
    noise, base = report["noise"]["run"], quiet.run("fp32")
    assert noise["init_sha256"] == base["init_sha256"] and noise["data_sha256"] != base["data_sha256"]
    assert report["protocol"]["noise_band"]["data_seed"] == 7 + NOISE_SEED_OFFSET
    # before any update the noise run holds the baseline's weights, so its shadow loss on the
    # baseline's first batch is the baseline's first loss; later the runs drift apart
    assert math.isclose(noise["shadow_loss"][0], base["loss"][0], rel_tol=1e-6)
    assert noise["shadow_loss"][-1] != base["loss"][-1] and len(noise["shadow_loss"]) == len(base["loss"])
    assert [r["precision"] for r in report["runs"]] == ["fp32", "bf16"]  # the noise run is not a compared run
    jsonschema.validate(report, load_schema(), cls=jsonschema.Draft202012Validator)


def test_a_wide_band_makes_a_matching_low_precision_inconclusive_and_exits_3(noisy: Job) -> None:
    assert noisy.code == 3 and noisy.report["verdict"] == "inconclusive"
    bf16 = noisy.comparison("bf16")
    assert bf16["verdict"] == bf16["numerics"] == "inconclusive"
    loss = next(c for c in bf16["checks"] if c["check"] == "loss_distance")
    assert loss["value"] <= 0.03 < NOISE_K * loss["band"]  # within tolerance, but the run cannot resolve it
    assert "cannot resolve the tolerance" in loss["reason"]
    assert bf16["summary"].startswith("numerics inconclusive")
    md = (noisy.out / "report.md").read_text()
    assert "— INCONCLUSIVE" in md and "fp32 noise band (a second fp32 run" in md
    html = (noisy.out / "report.html").read_text()
    assert 'class="badge inconclusive" id="verdict"' in html and "cannot resolve the tolerance" in html


def test_a_real_bf16_failure_beyond_the_band_fails_and_exits_1(broken: Job) -> None:
    assert broken.code == 1 and broken.report["verdict"] == "fail"
    checks = {c["check"]: c for c in broken.comparison("bf16")["checks"]}
    loss = checks["loss_distance"]
    assert loss["verdict"] == "fail" and loss["value"] > max(0.03, NOISE_K * loss["band"])
    assert checks["metric:mse"]["verdict"] == "fail"


def test_no_noise_band_keeps_the_single_run_protocol(tmp_path_factory: pytest.TempPathFactory, noisy: Job) -> None:
    single = _job(tmp_path_factory, "LabelNoise", "--no-noise-band")
    assert single.code == 0 and single.report["verdict"] == "pass"  # the same runs, judged by tolerance alone
    assert "noise" not in single.report and single.report["protocol"]["noise_band"]["enabled"] is False
    assert all(c["band"] is None for c in single.comparison("bf16")["checks"])
    assert single.run("bf16")["loss"] == noisy.run("bf16")["loss"]  # only the judgement differs
    assert "No fp32 noise band (--no-noise-band)" in (single.out / "report.md").read_text()


def test_ten_steps_of_tinygpt_are_inconclusive(tmp_path: Path) -> None:
    """Ten steps leave five after warm-up: whatever the distances, too few to pass (the tiny size keeps it fast)."""
    job = verify(tmp_path, "tinygpt", "--size", "tiny", "--steps", "10", "--precisions", "fp32,bf16")
    assert job.code == 3 and job.report["verdict"] == "inconclusive"
    assert job.report["protocol"]["size"] == "tiny" and job.report["task"]["info"]["size"] == "tiny"
    bf16 = job.comparison("bf16")
    assert bf16["verdict"] == "inconclusive"
    assert all("only 5 steps after warm-up" in c["reason"] for c in bf16["checks"] if c["verdict"] != "fail")
    assert "size tiny (GPT d_model=64" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--size", "huge"], "--size 'huge': task 'tinygpt' has no such size; its sizes: full, small, tiny"),
    (["--noise-k", "0"], "--noise-k 0.0: must be a number > 0"),
])
def test_bad_noise_band_and_size_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                               message: str) -> None:
    job = verify(tmp_path / "out", "tinygpt", *args)
    assert job.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out" / "report.json").exists()
