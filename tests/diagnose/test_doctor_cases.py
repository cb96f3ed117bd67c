"""The failure corpus: the real ``ampkit doctor --json`` on every script of tests/cases and on its
fixed variant, checked against tests/cases/manifest.json (codes, culprit module, evidence).

The scripts run in-process through ``ampkit.cli.main.main`` (as ``coverage run`` would run them),
which keeps the corpus within its time budget: torch is imported once, and each script runs once
per session (``_doctor`` keeps its report for the other tests of the same script).

Results must not depend on the CPU: a requirement key names a machine property (a measured speed,
which the ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` caps change like the CPU would), and borderline rows
(``ampkit.thresholds``) are left out of the stored comparison.  These tests also run under an
emulated AVX2 CPU (the ``numerics`` marker).
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from ampkit.cli.main import main
from ampkit.diagnose.core.perf import low_precision_speed
from ampkit.findings import CODES
from ampkit.thresholds import is_borderline
from tests.helpers.corpus_judge import (
    culprit_modules,
    culprit_named,
    fixed_twin_faults,
    missing_codes,
    unexpected_errors,
)

CASES = Path(__file__).parents[1] / "cases"
OPTION_CODES = {"COMPILED_DIVERGENCE": "--compare-compiled: tests/cli/test_doctor.py"}
"""Codes only a doctor option reports; the plain corpus run cannot show them, their tests can."""
MANIFEST: dict[str, Any] = json.loads((CASES / "manifest.json").read_text())


@functools.cache
def _measured_speed(precision: str) -> str:
    """``slow``, ``fast`` or ``borderline`` (also for a measurement reported as disturbed): ``precision``'s
    matmuls against fp32 on this CPU, measured the way the doctor measures them but independently of the
    doctor's own measurement."""
    finding = low_precision_speed(precision, "cpu")
    if finding is not None and finding.evidence.get("disturbed"):  # slow against the probe, unsettled: untold
        return "borderline"
    return "fast" if finding is None else "borderline" if is_borderline(finding) else "slow"


def _requirement_met(requirement: str | None) -> bool | None:
    """Whether the machine property holds here; None when it cannot be told (a speed at the threshold)."""
    if requirement is None:
        return True
    if requirement == "no_cuda":
        return not torch.cuda.is_available()
    # SLOW_LOW_PRECISION is decided by a measurement, so its expectation is too: an ISA flag cannot
    # say whether a CPU's kernels run fp16 fast (a CPU whose fp16 units torch's probes do not know
    # runs fp16 at fp32's speed).  Both are clear by far on every CPU seen (fp16 emulated: 0.02x
    # fp32), and a speed inside the borderline band leaves the expectation undecided.
    if requirement in ("slow_fp16_cpu", "fast_bf16_cpu"):
        speed = _measured_speed("fp16" if requirement == "slow_fp16_cpu" else "bf16")
        return None if speed == "borderline" else speed == ("slow" if requirement == "slow_fp16_cpu" else "fast")
    raise ValueError(f"unknown requirement {requirement!r} in manifest.json")


_REPORTS: dict[Path, tuple[int, dict[str, Any]]] = {}
"""Each script's (exit status, report), run once per session and shared by the tests that read it."""


def _doctor(script: Path, tmp_path: Path) -> tuple[int, dict[str, Any]]:
    if script not in _REPORTS:
        report = tmp_path / "doctor.json"
        rc = main(["doctor", "--json", str(report), str(script)])
        _REPORTS[script] = rc, json.loads(report.read_text())
    return _REPORTS[script]


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads(resources.files("ampkit").joinpath("schemas/doctor.schema.json").read_text())


def test_doctor_cases_manifest_covers_every_code_with_real_files() -> None:
    cases = MANIFEST["cases"]
    assert len(cases) >= 22
    covered = {code for c in cases for code in c["expect"]}
    assert covered | set(OPTION_CODES) == set(CODES), f"codes without a case: {sorted(set(CODES) - covered)}"
    for c in cases:
        assert (CASES / c["script"]).is_file() and (CASES / c["fixed"]).is_file(), c["name"]
        assert set(c["expect"]) | set(c["allow"]) <= set(CODES)
        assert all(code.startswith("AMP") for code in c.get("lint", [])), c["name"]
        if c["culprit"] is not None:
            assert c["culprit"]["code"] in c["expect"]


@pytest.mark.parametrize("case", MANIFEST["cases"], ids=lambda c: c["name"])
def test_doctor_cases_script_reports_expected_codes_and_culprit(
    case: dict[str, Any], tmp_path: Path, schema: dict[str, Any]
) -> None:
    rc, doc = _doctor(CASES / case["script"], tmp_path)
    jsonschema.validate(doc, schema)
    findings = doc["findings"]
    codes = {f["code"] for f in findings}
    expect = set(case["expect"])
    met = _requirement_met(case.get("requires"))
    if met is None:
        pytest.skip(f"{case['requires']} cannot be told on this machine (its measured speed is borderline)")
    if not met:
        assert not expect & codes, f"{case['requires']} does not hold here, yet {expect & codes} was reported"
        return
    assert not missing_codes(case, findings), f"missing {missing_codes(case, findings)}; reported {sorted(codes)}"
    assert not unexpected_errors(case, findings), f"unexpected errors {unexpected_errors(case, findings)}"
    if case["culprit"] is not None:
        assert culprit_named(case, findings), (f"{case['culprit']['code']} names {culprit_modules(case, findings)}, "
                                               f"expected the producer {case['culprit']['module']!r}")
    if case.get("compiled"):
        assert doc["compiled"], "the script's torch.compile call was not reported"
    for code, wanted in case.get("evidence", {}).items():
        evidence = [f["evidence"] for f in findings if f["code"] == code]
        assert any(all(ev.get(k) == v for k, v in wanted.items()) for ev in evidence), (code, evidence)
    if "fp8_filter" in case:
        assert doc["fp8_filter"] == case["fp8_filter"], f"verified fp8_filter {doc['fp8_filter']}"
    assert rc == (1 if any(f["severity"] == "error" for f in findings) else 0)


@pytest.mark.parametrize("case", MANIFEST["cases"], ids=lambda c: c["name"])
def test_doctor_cases_fixed_variant_has_no_error_and_none_of_the_codes(case: dict[str, Any], tmp_path: Path) -> None:
    if not _requirement_met(case.get("fixed_requires")):
        pytest.skip(f"the fixed variant assumes {case['fixed_requires']}, which this machine lacks or cannot tell")
    rc, doc = _doctor(CASES / case["fixed"], tmp_path)
    findings = doc["findings"]
    faults = fixed_twin_faults(case, findings)
    assert not faults, [(f["code"], f["message"]) for f in findings if f["code"] in faults]
    assert rc == 0
    assert doc["environment"]["exit_status"] == 0


def _lint_codes(script: Path, capsys: pytest.CaptureFixture[str]) -> set[str]:
    capsys.readouterr()
    main(["lint", "--format", "json", str(script)])
    return {v["code"] for v in json.loads(capsys.readouterr().out)["violations"]}


@pytest.mark.parametrize("case", [c for c in MANIFEST["cases"] if c.get("lint")], ids=lambda c: c["name"])
def test_doctor_cases_linter_reports_lint_codes_on_script_only(
    case: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    wanted = set(case["lint"])
    on_script = _lint_codes(CASES / case["script"], capsys)
    assert wanted <= on_script, f"lint missed {sorted(wanted - on_script)}; reported {sorted(on_script)}"
    on_fixed = _lint_codes(CASES / case["fixed"], capsys)
    assert not wanted & on_fixed, f"the fixed variant still gets {sorted(wanted & on_fixed)}"


# -- stored expectations: the doctor's results on every case, recorded once and compared on each run --
EXPECTED_PATH = CASES / "expected.json"
TIMED_CODES = frozenset({"SLOW_LOW_PRECISION", "SLOW_FP8_GEMM"})
"""Findings decided by a timing measurement: a loaded machine can tip them either way, so they are
left out of the stored comparison (tests/diagnose/test_task.py checks the measurement itself).
Borderline rows are left out too: their value sits at the threshold, where the CPU decides."""


def _expectation_key(requirement: str | None) -> str | None:
    """``any`` for a case whose result does not depend on the machine, else ``REQ=yes|no``; None when
    the requirement cannot be told here."""
    if requirement is None:
        return "any"
    met = _requirement_met(requirement)
    return None if met is None else f"{requirement}={'yes' if met else 'no'}"


def _summary(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """What must stay the same: each finding's code, severity, module, op and line (file basename)."""
    rows = []
    for f in doc["findings"]:
        if f["code"] in TIMED_CODES or is_borderline(f):
            continue
        location = f["location"]
        if location is not None:
            path, _, line = location.rpartition(":")
            location = f"{Path(path).name}:{line}"
        rows.append({"code": f["code"], "severity": f["severity"], "module": f["module"], "op": f["op"],
                     "location": location})
    unique = {json.dumps(r, sort_keys=True) for r in rows}
    return [json.loads(r) for r in sorted(unique)]


def _variants(case: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    return [("script", case["script"], case.get("requires")), ("fixed", case["fixed"], case.get("fixed_requires"))]


@pytest.mark.parametrize("case", MANIFEST["cases"], ids=lambda c: c["name"])
def test_doctor_cases_results_match_stored_expectations(case: dict[str, Any], tmp_path: Path) -> None:
    stored = json.loads(EXPECTED_PATH.read_text())["cases"][case["name"]]
    for variant, script, requirement in _variants(case):
        key = _expectation_key(requirement)
        if key is None or key not in stored[variant]:
            continue  # recorded on a machine where the requirement had the other value
        _, doc = _doctor(CASES / script, tmp_path)
        assert _summary(doc) == stored[variant][key], f"{case['name']} ({variant}, {key})"


def _record(tmp: Path) -> None:
    """Run every case here and merge the results into expected.json (keys of other machines are kept)."""
    stored = json.loads(EXPECTED_PATH.read_text()) if EXPECTED_PATH.exists() else {"cases": {}}
    stored["schema"] = "ampkit.cases-expected/1"
    for case in MANIFEST["cases"]:
        entry = stored["cases"].setdefault(case["name"], {"script": {}, "fixed": {}})
        for variant, script, requirement in _variants(case):
            key = _expectation_key(requirement)
            if key is not None:
                _, doc = _doctor(CASES / script, tmp)
                entry[variant][key] = _summary(doc)
    EXPECTED_PATH.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":  # python tests/diagnose/test_doctor_cases.py  -> re-record tests/cases/expected.json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _record(Path(tmp))
