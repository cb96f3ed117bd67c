"""The HTML report page."""

from __future__ import annotations

from pathlib import Path

from ampkit.diagnose.report.html import render_html, write_html
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.findings import Finding

EVIL = '<script>alert("x")</script>'


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
