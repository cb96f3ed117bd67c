"""The terminal listing."""

from __future__ import annotations

import io

from ampkit.diagnose.report.terminal import render_terminal
from ampkit.findings import Finding


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


def test_output_terminal_summary_ends_with_the_note_instead_of_a_bare_no_findings() -> None:
    buf = io.StringIO()
    render_terminal([], file=buf, note="the run trained entirely in fp32")
    assert buf.getvalue().strip() == "ampkit doctor: no findings; the run trained entirely in fp32"
    buf = io.StringIO()
    render_terminal([Finding(code="MIXED_PRECISION_OFF", severity="warning", message="m", fix="f")], file=buf,
                    color=True, note="fp32")
    assert buf.getvalue().strip().endswith("1 finding (1 warning); fp32")
