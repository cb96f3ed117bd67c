"""The preflight corpus (tests/preflight_cases): every case's verdicts against the expectations of its public
report (expected.json), and against what training showed (trained.json, written by
benchmarks/preflight_confirm.py: 30 steps per format, with and without preflight's policy).

Each case runs preflight once, in a module-scoped fixture of its own (``preflight_<case>``), on its first
``preflight_batches`` batches with every format this checkout has.  A pair whose preflight verdict is known
to differ from its expectation is recorded in expected.json (``preflight_disagrees``, with the reason) and
expected to differ here (a strict xfail: when preflight comes round to the expectation the test says so);
the three tests against training carry the figures of the recorded run the same way.
The judging rules are tests/helpers/preflight_judge.py's, shared with the benchmark.  These tests also run
under an emulated AVX2 CPU (the ``numerics`` marker): the verdicts must not depend on the CPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ampkit.diagnose.preflight.api import preflight_model
from ampkit.diagnose.preflight.judge import quiet_fp8_warnings
from ampkit.diagnose.preflight.result import FormatReport, PreflightResult
from ampkit.precision import PRECISION_NAMES
from tests.helpers.preflight_judge import (
    EXPECTED,
    TRAINED,
    TRAINED_FORMATS,
    WHAT_IF_FORMATS,
    agrees,
    case_names,
    load_case,
    load_json,
    policy_matches,
    same_policy,
)

pytestmark = pytest.mark.numerics

CASES = case_names()
TRAINED_HERE = [f for f in TRAINED_FORMATS if f in PRECISION_NAMES]
WHAT_IF_HERE = list(WHAT_IF_FORMATS) if importlib.util.find_spec("ampkit.diagnose.core.blockcast") else []
FORMATS = [*TRAINED_HERE, *WHAT_IF_HERE]
EXPECTATIONS: dict[str, Any] = load_json(EXPECTED)["cases"]
AGREEMENT_FLOOR = 0.9


def _preflight_fixture(name: str) -> Callable[[], PreflightResult]:
    @pytest.fixture(scope="module", name=f"preflight_{name}")
    def run() -> PreflightResult:
        task = load_case(name)
        stream = task.batches(0, torch.device("cpu"))
        batches = [next(stream) for _ in range(getattr(task, "preflight_batches", 1))]
        with quiet_fp8_warnings():
            return preflight_model(task.build_model(0), batches, loss_fn=task.loss, formats=FORMATS)

    return run


for _name in CASES:
    globals()[f"preflight_{_name}"] = _preflight_fixture(_name)


def _report(request: pytest.FixtureRequest, case: str, fmt: str) -> FormatReport:
    result: PreflightResult = request.getfixturevalue(f"preflight_{case}")
    return result.report(fmt)  # type: ignore[arg-type]


def _policy(report: FormatReport) -> dict[str, Any]:
    return {"keep_fp32": report.policy.keep_fp32, "fp8_filter": report.policy.fp8_filter,
            "init_scale": report.policy.init_scale}


def _expected_pairs() -> list[Any]:
    pairs = []
    for case in CASES:
        for fmt in FORMATS:
            known = EXPECTATIONS[case]["formats"][fmt].get("preflight_disagrees")
            marks = [pytest.mark.xfail(strict=True, reason=f"recorded in expected.json: preflight says "
                                                           f"{known['verdict']}: {known['why']}")] if known else []
            pairs.append(pytest.param(case, fmt, id=f"{case}-{fmt}", marks=marks))
    return pairs


@pytest.mark.parametrize(("case", "fmt"), _expected_pairs())
def test_preflight_verdict_matches_expected(request: pytest.FixtureRequest, case: str, fmt: str) -> None:
    report = _report(request, case, fmt)
    want = EXPECTATIONS[case]["formats"][fmt]
    assert report.verdict == want["verdict"], (
        f"{case} {fmt}: preflight says {report.verdict} (policy {_policy(report)}, first break "
        f"{report.first_break}), the report implies {want['verdict']}")
    if want["verdict"] == "policy":
        assert policy_matches(_policy(report), {**want["policy"], "also_accepted": want.get("also_accepted", [])}), (
            f"{case} {fmt}: preflight's policy {_policy(report)}, expected {want['policy']}")


def _training_pairs(request: pytest.FixtureRequest) -> list[tuple[str, str, FormatReport, dict[str, Any]]]:
    """(case, format, preflight's report now, the trained.json entry) for every trained pair."""
    trained = load_json(TRAINED)["cases"]
    missing = [c for c in CASES if c not in trained]
    assert not missing, f"trained.json has no record of {missing}: run benchmarks/preflight_confirm.py"
    return [(case, fmt, _report(request, case, fmt), trained[case]["formats"][fmt])
            for case in CASES for fmt in TRAINED_HERE]


def _policy_run(report: FormatReport, entry: dict[str, Any]) -> dict[str, Any] | None:
    """The trained run with the policy preflight proposes now; None when trained.json tried another (stale)."""
    run = entry["policy"]
    return run if run is not None and same_policy(_policy(report), run["policy"]) else None


def _agreement(report: FormatReport, entry: dict[str, Any]) -> bool:
    run = _policy_run(report, entry)
    if report.verdict == "policy" and run is None:
        return False  # trained.json never tried this policy: rerun the benchmark
    wanted = entry.get("expected_policy")
    return agrees(report.verdict, plain_passed=entry["plain"]["passed"],
                  policy_passed=None if run is None else run["passed"],
                  expected_policy_passed=None if wanted is None else wanted["passed"])


def test_preflight_agrees_with_training_on_at_least_90_percent_of_pairs(request: pytest.FixtureRequest) -> None:
    pairs = _training_pairs(request)
    disagreeing = [f"{case} {fmt}: preflight {report.verdict}, training plain "
                   f"{'passed' if entry['plain']['passed'] else 'failed'}"
                   for case, fmt, report, entry in pairs if not _agreement(report, entry)]
    share = 1 - len(disagreeing) / len(pairs)
    assert share >= AGREEMENT_FLOOR, (
        f"preflight agrees with training on {share:.0%} of {len(pairs)} pairs; disagreeing: {disagreeing}")


def test_preflight_never_calls_safe_what_training_broke(request: pytest.FixtureRequest) -> None:
    broken = [f"{case} {fmt}" for case, fmt, report, entry in _training_pairs(request)
              if report.verdict == "safe" and not entry["plain"]["passed"]]
    assert not broken, f"preflight calls these safe, and training without a policy failed: {broken}"


def test_every_proposed_policy_removed_its_failure_in_training(request: pytest.FixtureRequest) -> None:
    failed = []
    for case, fmt, report, entry in _training_pairs(request):
        if report.verdict != "policy":
            continue
        run = _policy_run(report, entry)
        if run is None:
            failed.append(f"{case} {fmt}: {_policy(report)} was never trained (rerun benchmarks/preflight_confirm.py)")
        elif entry["plain"]["passed"] or not run["passed"]:
            failed.append(f"{case} {fmt}: without the policy training {'passed' if entry['plain']['passed'] else 'failed'},"
                          f" with {_policy(report)} it {'passed' if run['passed'] else 'failed'}")
    assert not failed, f"policies that did not remove a training failure: {failed}"
