"""``ampkit doctor SCRIPT`` on unmodified framework scripts: stock Hugging Face Trainer and Lightning
(bf16 on CPU) and Accelerate-style fp16 loops (forward wrapped in autocast, ``GradScaler("cpu")``).

Each script of tests/cases/frameworks/ must be diagnosed like its plain-loop family in
tests/cases/manifest.json: the same code at the same culprit module, and no error on its fixed
twin.  The scripts run in-process through ``ampkit.cli.main.main`` (transformers and lightning are
imported once), and each script runs once per session (``_doctor`` keeps the documents).
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from ampkit.cli.main import main

CASES = Path(__file__).parents[1] / "cases"
FRAMEWORKS = CASES / "frameworks"
MANIFEST: dict[str, Any] = json.loads((FRAMEWORKS / "manifest.json").read_text())
PLAIN = {c["name"]: c for c in json.loads((CASES / "manifest.json").read_text())["cases"]}
_REQUIRES = {"trainer": "transformers", "lightning": "lightning", "accelerate": "accelerate"}


def _require(name: str) -> None:
    pytest.importorskip(_REQUIRES[name.split("_", 1)[0]])


@functools.cache
def _doctor(script: str) -> tuple[int, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "doctor.json"
        rc = main(["doctor", "--json", str(report), str(FRAMEWORKS / script)])
        return rc, json.loads(report.read_text())


def test_doctor_frameworks_manifest_names_real_files_and_plain_families() -> None:
    for case in MANIFEST["cases"]:
        assert (FRAMEWORKS / case["script"]).is_file() and (FRAMEWORKS / case["fixed"]).is_file(), case["name"]
        assert case["plain"] in PLAIN, case["name"]
        assert set(case["expect"]) <= set(PLAIN[case["plain"]]["expect"]), case["name"]
    kinds = {c["name"].split("_", 1)[0] for c in MANIFEST["cases"]}
    assert kinds == set(_REQUIRES)


@pytest.mark.parametrize("case", MANIFEST["cases"], ids=lambda c: c["name"])
def test_doctor_frameworks_script_reports_the_plain_loop_code_and_culprit(case: dict[str, Any]) -> None:
    _require(case["name"])
    rc, doc = _doctor(case["script"])
    findings = doc["findings"]
    codes = {f["code"] for f in findings}
    assert set(case["expect"]) <= codes, f"missing {sorted(set(case['expect']) - codes)}; reported {sorted(codes)}"
    errors = {f["code"] for f in findings if f["severity"] == "error"}
    assert errors <= set(case["expect"]) | set(case["allow"]), f"unexpected errors {sorted(errors)}"
    culprit = PLAIN[case["plain"]]["culprit"]
    if culprit is not None:
        named = [f["module"] for f in findings if f["code"] == culprit["code"]]
        assert culprit["module"] in named, f"{culprit['code']} names {named}, the plain loop {culprit['module']!r}"
    assert rc == (1 if errors else 0)


@pytest.mark.parametrize("case", MANIFEST["cases"], ids=lambda c: c["name"])
def test_doctor_frameworks_fixed_variant_has_no_error(case: dict[str, Any]) -> None:
    _require(case["name"])
    rc, doc = _doctor(case["fixed"])
    errors = [(f["code"], f["message"]) for f in doc["findings"] if f["severity"] == "error"]
    assert not errors
    assert not {f["code"] for f in doc["findings"] if f["severity"] != "info"} & set(case["expect"])
    assert rc == 0


def test_doctor_frameworks_trainer_bf16_json_holds_precision_and_fp32_comparison() -> None:
    _require("trainer")
    _, doc = _doctor("trainer_precision_loss_timestep_fixed.py")
    assert doc["precision"] == "bf16"
    sqnr = doc["comparison"]["output_sqnr_db"]
    assert sqnr and "time.freq" in sqnr  # the user's module names, no wrapper prefix
    assert [r["why"] for r in doc["environment"]["replays"]] == ["checkup"]


def test_doctor_frameworks_fp16_autocast_inside_forward_replays_in_fp16() -> None:
    _require("accelerate")
    _, doc = _doctor("accelerate_clip_before_unscale_fixed.py")
    assert doc["precision"] == "fp16"
    assert doc["comparison"]["output_sqnr_db"]


def test_doctor_frameworks_ampkit_precision_skipped_steps_are_the_engines() -> None:
    _require("lightning")
    _, doc = _doctor("lightning_ampkit_ffn_overflow_fp16.py")
    collapse = [f for f in doc["findings"] if f["code"] == "SCALE_COLLAPSE"]
    assert len(collapse) == 1 and "ampkit.MixedPrecision" in collapse[0]["message"]
    assert collapse[0]["evidence"]["skipped_steps"] == collapse[0]["evidence"]["steps"] == 20  # max_steps
