"""The ampkit.doctor/1 JSON file."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch

from ampkit.diagnose.report.html import write_html
from ampkit.diagnose.report.json import write_json
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.findings import Finding


def _schema() -> dict:
    return json.loads(resources.files("ampkit").joinpath("schemas/doctor.schema.json").read_text())


def _strict_load(path: Path) -> dict:
    def refuse(token: str) -> None:
        raise AssertionError(f"non-strict JSON token {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_output_json_validates_against_the_schema(tmp_path: Path, overflow_result: DiagnosisResult) -> None:
    path = tmp_path / "doctor.json"
    write_json(path, overflow_result)
    doc = _strict_load(path)
    jsonschema.validate(doc, _schema())
    assert doc["schema"] == "ampkit.doctor/1"
    assert doc["findings"][0]["code"] == "FORWARD_OVERFLOW"
    assert doc["keep_fp32"] == ["blocks.1.norm"]
    assert set(doc["module_headroom"]["blocks.1.norm"]) == {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2"}
    assert doc["environment"]["torch"] == torch.__version__


def test_output_json_from_findings_is_strict_and_sorted(tmp_path: Path) -> None:
    findings = [
        Finding(code="PRECISION_LOSS", severity="warning", message="w", fix="f", evidence={"sqnr_db": float("-inf")}),
        Finding(code="FORWARD_NAN", severity="error", message="e", fix="f", op="aten::div", location="a.py:3"),
    ]
    doc = write_json(tmp_path / "f.json", findings, environment={"device": "cpu"})
    loaded = _strict_load(tmp_path / "f.json")
    assert loaded == doc
    jsonschema.validate(loaded, _schema())
    assert [f["severity"] for f in loaded["findings"]] == ["error", "warning"]
    assert loaded["findings"][1]["evidence"]["sqnr_db"] == "-inf"


def test_output_schema_rejects_unknown_codes() -> None:
    doc = {"schema": "ampkit.doctor/1", "environment": {}, "findings": [
        {"code": "MADE_UP", "severity": "error", "message": "m", "fix": "f", "module": None, "op": None,
         "location": None, "step": None, "evidence": {}}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, _schema())


def test_output_write_leaves_no_temporary_files(tmp_path: Path, overflow_result: DiagnosisResult) -> None:
    write_json(tmp_path / "a.json", overflow_result)
    write_html(tmp_path / "a.html", overflow_result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html", "a.json"]
