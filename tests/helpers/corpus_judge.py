"""How a case of the failure corpus judges the doctor's findings: one set of rules for the corpus
tests (tests/diagnose/test_doctor_cases.py) and for the recall benchmark
(benchmarks/corpus_recall.py), so that the number a benchmark reports is the test's verdict counted.

A case is an entry of manifest.json; ``findings`` is the ``findings`` list of the doctor's JSON
report (``ampkit doctor --json``).

>>> case = {"expect": ["FORWARD_OVERFLOW"], "allow": ["SCALE_COLLAPSE"],
...         "culprit": {"code": "FORWARD_OVERFLOW", "module": "attn"}}
>>> found = [{"code": "FORWARD_OVERFLOW", "severity": "error", "module": "attn"},
...          {"code": "NO_LOSS_SCALING", "severity": "error", "module": None}]
>>> missing_codes(case, found), unexpected_errors(case, found), culprit_named(case, found)
([], ['NO_LOSS_SCALING'], True)
>>> fixed_twin_faults(case, [{"code": "FORWARD_OVERFLOW", "severity": "info"}])
[]
"""

from __future__ import annotations

from typing import Any

Case = dict[str, Any]
Findings = list[dict[str, Any]]

__all__ = ["culprit_modules", "culprit_named", "fixed_twin_faults", "missing_codes", "unexpected_errors"]


def missing_codes(case: Case, findings: Findings) -> list[str]:
    """The case's required codes (``expect``) that no finding has, in the manifest's order."""
    codes = {f["code"] for f in findings}
    return [c for c in case["expect"] if c not in codes]


def unexpected_errors(case: Case, findings: Findings) -> list[str]:
    """Error-severity codes neither required nor allowed (``allow``) by the case, sorted."""
    errors = {f["code"] for f in findings if f["severity"] == "error"}
    return sorted(errors - set(case["expect"]) - set(case.get("allow", [])))


def culprit_modules(case: Case, findings: Findings) -> list[str | None] | None:
    """The modules the findings of the culprit's code name; None for a case without a culprit."""
    if not case.get("culprit"):
        return None
    return [f["module"] for f in findings if f["code"] == case["culprit"]["code"]]


def culprit_named(case: Case, findings: Findings) -> bool | None:
    """Whether a finding of the culprit's code names the culprit module; None without a culprit."""
    named = culprit_modules(case, findings)
    return None if named is None else case["culprit"]["module"] in named


def fixed_twin_faults(case: Case, findings: Findings) -> list[str]:
    """What the fixed variant must not get, sorted: any error, and any finding of a required code
    above info (an info row says there is nothing to change, e.g. one ordinary back-off of the scale)."""
    return sorted({f["code"] for f in findings
                   if f["severity"] == "error" or (f["severity"] != "info" and f["code"] in case["expect"])})
