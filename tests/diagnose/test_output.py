"""Output: terminal order, ampkit.doctor/1 JSON against its schema, HTML escaping, atomic writes."""

from __future__ import annotations

import io
import json
from importlib import resources
from pathlib import Path

import doctor_models as dm
import jsonschema
import pytest
import torch

from ampkit.diagnose.report.html import render_html, write_html
from ampkit.diagnose.report.json import write_json
from ampkit.diagnose.report.terminal import render_terminal
from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.findings import Finding

EVIL = '<script>alert("x")</script>'


def _schema() -> dict:
    return json.loads(resources.files("ampkit").joinpath("schemas/doctor.schema.json").read_text())


def _strict_load(path: Path) -> dict:
    def refuse(token: str) -> None:
        raise AssertionError(f"non-strict JSON token {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture(scope="module")
def overflow_result() -> DiagnosisResult:
    torch.manual_seed(0)
    return diagnose_step(dm.NormNet(hot=(1,)), dm.fp16_run(torch.randn(4, 16) * 3), precision="fp16")


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


def test_output_html_escapes_every_user_string(tmp_path: Path) -> None:
    f = Finding(code="FORWARD_OVERFLOW", severity="error", message=f"msg {EVIL}", fix=f"fix {EVIL}",
                module=f"blocks.{EVIL}", op="aten::mm", location=f"{EVIL}.py:3", evidence={EVIL: EVIL})
    result = DiagnosisResult(findings=[f], module_headroom={EVIL: {"fp16": (1.0, 2.0)}}, precision="fp16",
                             keep_fp32=[EVIL])
    write_html(tmp_path / "r.html", result, environment={"torch": EVIL, "device": "cpu"})
    page = (tmp_path / "r.html").read_text()
    assert "<script" not in page
    assert "&lt;script&gt;" in page
    assert 'alert("x")' not in page  # no raw quotes either: attributes cannot be broken out of


def test_output_html_is_self_contained_with_headroom_charts(overflow_result: DiagnosisResult) -> None:
    page = render_html(overflow_result)
    for forbidden in ("<script", "<link", "src=", "@import", "url("):
        assert forbidden not in page
    assert page.count("<svg") == 8  # outputs and gradients x four formats
    assert "blocks.1.norm" in page
    assert "Verified fix" in page


def test_output_write_leaves_no_temporary_files(tmp_path: Path, overflow_result: DiagnosisResult) -> None:
    write_json(tmp_path / "a.json", overflow_result)
    write_html(tmp_path / "a.html", overflow_result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html", "a.json"]


def test_output_terminal_prints_worst_first() -> None:
    findings = [
        Finding(code="SLOW_LOW_PRECISION", severity="warning", message="slow", fix="use bf16"),
        Finding(code="BACKWARD_OVERFLOW", severity="info", message="scaling", fix="nothing"),
        Finding(code="FORWARD_OVERFLOW", severity="error", message="boom", fix="keep", module="a.b",
                op="aten::mm", location="x.py:1", step=3),
    ]
    buf = io.StringIO()
    render_terminal(findings, file=buf)
    text = buf.getvalue()
    assert text.index("FORWARD_OVERFLOW") < text.index("SLOW_LOW_PRECISION") < text.index("BACKWARD_OVERFLOW")
    assert "a.b · aten::mm · x.py:1 · step 3" in text
    assert text.strip().endswith("3 findings (1 error, 1 warning, 1 info)")


def test_output_terminal_with_rich_keeps_brackets() -> None:
    buf = io.StringIO()
    f = Finding(code="PRECISION_LOSS", severity="warning", message="keep_fp32=['x'] [bold]", fix="f")
    render_terminal([f], file=buf, color=True)
    assert "keep_fp32=['x'] [bold]" in buf.getvalue()
