"""How the preflight corpus (tests/preflight_cases) is judged: one set of rules for its tests
(tests/diagnose/preflight/test_corpus.py) and for the training benchmark that confirms it
(benchmarks/preflight_confirm.py), so that the agreement a benchmark prints is the one the tests count.

A case is a file of tests/preflight_cases (``task = CaseTask()``); its expectations are the entry of
``expected.json`` of the same name; what training showed is the entry of ``trained.json``.  The cases of
tests/preflight_slow_cases (real pretrained weights, each with its own benchmark and slow test) are judged by
the same rules, against the ``trained.json`` of their folder.

A training run *passed* when no loss was non-finite, no optimizer step was skipped, nothing raised and its
loss curve lies within ``Tolerances().loss`` of fp32's (``verify.compare.loss_distance``).  A preflight
verdict agrees with training when:

* ``safe``: the run without a policy passed;
* ``policy``: the run without it failed and the run with it passed;
* ``unsafe``: the run without a policy failed and, where a policy was tried (preflight's, or the one the case's
  report expects), that run failed too: a policy that fixed training makes ``unsafe`` wrong.

>>> agrees("safe", plain_passed=True, policy_passed=None)
True
>>> agrees("policy", plain_passed=False, policy_passed=True), agrees("policy", plain_passed=True, policy_passed=True)
(True, False)
>>> agrees("unsafe", plain_passed=False, policy_passed=None)
True
>>> agrees("unsafe", plain_passed=False, policy_passed=None, expected_policy_passed=True)
False
>>> policy_matches({"keep_fp32": ["b.ff"]}, {"keep_fp32": ["b.ff.wo"], "also_accepted": [{"keep_fp32": ["b.ff"]}]})
True
>>> policy_matches({"init_scale": 2.0**40}, {"init_scale_at_least": 2.0**40})
True
>>> same_policy({"fp8_filter": ["a", "b"], "init_scale": None}, {"fp8_filter": ["b", "a"], "keep_fp32": []})
True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ampkit.tasks.base import Task, load_task

__all__ = ["CASES", "EXPECTED", "SLOW_CASES", "SLOW_TRAINED", "STEPS", "TRAINED", "TRAINED_FORMATS", "WHAT_IF_FORMATS",
           "agrees", "case_names", "load_case", "load_json", "policy_matches", "run_passed", "same_policy"]

CASES = Path(__file__).resolve().parents[1] / "preflight_cases"
EXPECTED = CASES / "expected.json"
TRAINED = CASES / "trained.json"
SLOW_CASES = CASES.parent / "preflight_slow_cases"
"""Cases with real pretrained weights, too slow for the corpus test: a slow test and a benchmark each."""
SLOW_TRAINED = SLOW_CASES / "trained.json"
STEPS = 30
"""Optimizer steps of every confirming training run."""
TRAINED_FORMATS = ("fp16", "bf16", "fp8", "fp8-rowwise", "fp8-rowwise-gw-hp")
"""The formats the engine trains (``MixedPrecision(fmt)``); the benchmark trains each of them."""
WHAT_IF_FORMATS = ("mxfp8", "nvfp4")
"""Emulated, never trained: their confirmation is the flush share and SQNR preflight measured."""


def case_names() -> list[str]:
    """The corpus's cases, sorted (every ``*.py`` of tests/preflight_cases but the shared ``_*.py``)."""
    return sorted(p.stem for p in CASES.glob("*.py") if not p.name.startswith("_"))


def load_case(name: str, folder: Path = CASES) -> Task:
    """The task of case ``name`` of ``folder`` (the corpus, or ``SLOW_CASES``)."""
    return load_task(f"{folder / name}.py:task")


def load_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def run_passed(run: dict[str, Any], tolerance: float) -> bool:
    """Whether a training run's record (``trained.json``) passed: see the module docstring."""
    return (run["error"] is None and run["nonfinite_steps"] == 0 and run["skipped_steps"] == 0
            and run["loss_distance"] is not None and run["loss_distance"] <= tolerance)


def agrees(verdict: str, *, plain_passed: bool, policy_passed: bool | None,
           expected_policy_passed: bool | None = None) -> bool:
    """Whether a preflight ``verdict`` agrees with training (see the module docstring)."""
    if verdict == "safe":
        return plain_passed
    if verdict == "policy":
        return not plain_passed and bool(policy_passed)
    return not plain_passed and not policy_passed and not expected_policy_passed


def policy_matches(policy: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Whether ``policy`` (``keep_fp32``, ``fp8_filter``, ``init_scale``) is the expected one: the same layers
    in any order (or those of an ``also_accepted`` alternative), and an ``init_scale`` of at least
    ``init_scale_at_least`` where the expectation names one."""
    alternatives = [expected, *expected.get("also_accepted", [])]
    return any(_same_policy(policy, alt) for alt in alternatives)


def same_policy(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two proposed policies are one: the same layers in any order, the same ``init_scale``."""
    return (all(sorted(a.get(k) or []) == sorted(b.get(k) or []) for k in ("keep_fp32", "fp8_filter"))
            and a.get("init_scale") == b.get("init_scale"))


def _same_policy(policy: dict[str, Any], expected: dict[str, Any]) -> bool:
    for key in ("keep_fp32", "fp8_filter"):
        if sorted(policy.get(key) or []) != sorted(expected.get(key) or []):
            return False
    floor = expected.get("init_scale_at_least")
    scale = policy.get("init_scale")
    if floor is None:
        return scale is None
    return scale is not None and scale >= floor
