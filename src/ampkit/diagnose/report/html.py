"""The doctor's report as one self-contained HTML page (no external resources).

It shows the findings, the verified keep-fp32 fix, the SQNR table, and per-module headroom
charts (inline SVG: log2 bits to overflow and to underflow of every module's outputs and
parameter gradients, one chart per format).  The page is the Jinja2 template
``ampkit/templates/doctor_report.html``; this module computes what it shows (texts, the charts'
geometry), and the template's autoescaping escapes every user-derived string
(``ampkit._util.templates``).  ``write_html`` writes through
``ampkit._util.io.atomic_write_bytes``: a crash never leaves half a page.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

from ampkit._util.io import atomic_write_bytes
from ampkit._util.jsonfloat import NONFINITE_AS_STRING, to_json
from ampkit._util.templates import render
from ampkit.diagnose.core.display import display_module, finding_where, sort_findings
from ampkit.diagnose.core.stats import FORMATS
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.findings import Finding

__all__ = ["render_html", "write_html"]

_X_MIN, _X_MAX = -8.0, 32.0  # displayed range of headroom bits; values beyond are clipped and labelled
_PANEL_TITLES = ("bits to overflow (largest value inside)", "bits to underflow (smallest output)")


def _bar_color(bits: float) -> str:
    if bits < 0:
        return "#c62828"
    if bits < 2:
        return "#f9a825"
    return "#4c78a8"


def _headroom_chart(rows: dict[str, dict[str, tuple[float, float]]], fmt: str) -> dict[str, Any]:
    """Diverging bars per module: bits to overflow (left panel), bits to underflow (right panel).

    Overflow is measured against the largest value computed inside the module (intermediates
    included), underflow against the smallest non-zero output (see ``DiagnosisResult``).  Returns
    the chart's geometry in pixels; the template ``doctor_headroom.svg`` draws it.
    """
    names = list(rows)
    label_w, panel_w, gap, row_h, top = 260, 330, 30, 16, 34
    height = top + row_h * len(names) + 10
    scale = panel_w / (_X_MAX - _X_MIN)

    def x_of(panel: int, bits: float) -> float:
        return label_w + panel * (panel_w + gap) + (min(max(bits, _X_MIN), _X_MAX) - _X_MIN) * scale

    panels = [{"x": label_w + panel * (panel_w + gap), "title": title, "zero": x_of(panel, 0.0),
               "ticks": [(x_of(panel, tick), tick) for tick in range(int(_X_MIN), int(_X_MAX) + 1, 8)]}
              for panel, title in enumerate(_PANEL_TITLES)]
    modules = []
    for i, name in enumerate(names):
        label = display_module(name) if name else "(whole model)"
        bars: list[dict[str, Any]] = []
        for panel, bits in enumerate(rows[name].get(fmt, (math.inf, math.inf))):
            x0 = x_of(panel, 0.0)
            if math.isinf(bits) or math.isnan(bits):
                bars.append({"x0": x0, "bits": None})
                continue
            x1 = x_of(panel, bits)
            bars.append({"x0": x0, "x1": x1, "left": min(x0, x1), "width": max(abs(x1 - x0), 1), "bits": bits,
                         "color": _bar_color(bits), "clipped": bits > _X_MAX})
        modules.append({"y": top + i * row_h, "label": label, "bars": bars})
    return {"fmt": fmt, "width": label_w + 2 * panel_w + gap + 10, "height": height, "row_h": row_h,
            "label_w": label_w, "panels": panels, "modules": modules}


def _evidence(f: Finding) -> str:
    return json.dumps(to_json(f.evidence, NONFINITE_AS_STRING), indent=2, allow_nan=False)


def _verification(result: DiagnosisResult) -> str:
    """The verified fix re-run, in one line ("" when the bisection did not verify one)."""
    v = (result.bisection or {}).get("verification") or {}
    if not v:
        return ""
    parts = [f"modules kept in fp32: {', '.join(map(str, v.get('modules') or []))}",
             f"step finite: {'yes' if v.get('finite') else 'no'}"]
    if isinstance(v.get("loss"), (int, float)):
        ref = f" (fp32: {result.loss_fp32:.6g})" if isinstance(result.loss_fp32, (int, float)) else ""
        parts.append(f"loss {v['loss']:.6g}{ref}")
    parts.append(f"output SQNR {_fmt_db(v.get('output_sqnr_db'))}")
    if "grad_sqnr_db" in v:
        parts.append(f"gradient SQNR {_fmt_db(v.get('grad_sqnr_db'))}")
    parts.append(f"{v.get('trials', '?')} trial(s)")
    return "; ".join(parts)


def _sqnr_rows(comparison: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(module, output SQNR, gradient SQNR) of the 25 lowest, lowest first."""
    out = comparison.get("output_sqnr_db") or {}
    grads = comparison.get("grad_sqnr_db") or {}
    rows = sorted(set(out) | set(grads), key=lambda n: _num(out.get(n, grads.get(n))))[:25]
    return [(display_module(n) if n else "(model output)", _fmt_db(out.get(n)), _fmt_db(grads.get(n))) for n in rows]


def _num(v: Any) -> float:
    return v if isinstance(v, (int, float)) and not math.isnan(v) else math.inf


def _fmt_db(v: Any) -> str:
    if not isinstance(v, (int, float)) or math.isnan(v):
        return "—"
    return "exact" if math.isinf(v) else f"{v:.1f} dB"


def _headroom_sections(result: DiagnosisResult) -> list[dict[str, Any]]:
    """One section per direction that has headroom rows, one chart per format in each."""
    sections = []
    for title, rows in (("the forward (activations)", result.module_headroom),
                        ("the backward (gradients, unscaled)", result.grad_headroom)):
        if rows:
            sections.append({"title": title, "charts": [
                {"fmt": fmt, "range": fr, "open": i < 2, "chart": _headroom_chart(rows, fmt)}
                for i, (fmt, fr) in enumerate(FORMATS.items())]})
    return sections


def render_html(result: DiagnosisResult | Sequence[Finding], environment: dict[str, Any] | None = None, *,
                partial: str | None = None, checkup: dict[str, Any] | None = None) -> str:
    """The report page as a string (see ``write_html``); ``partial``: how an unfinished run ended
    (``sigint``, ``sigterm``, ``sighup``, ``exception``, ``os_exit``), shown above the findings; ``checkup``: the
    doctor JSON's ``checkup`` record (``script.checkup``), shown above them too."""
    if not isinstance(result, DiagnosisResult):
        result = DiagnosisResult(findings=sort_findings(list(result)))
    env = environment or result.environment or {}
    findings = sort_findings(result.findings)
    return render(
        "doctor_report.html", result=result, env=env, partial=partial, checkup=checkup or {},
        findings=[{"finding": f, "where": finding_where(f), "evidence": _evidence(f)} for f in findings],
        counts={s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")},
        keep_fp32=repr(result.keep_fp32) if result.keep_fp32 else "", verification=_verification(result),
        sqnr_rows=_sqnr_rows(result.comparison), headroom=_headroom_sections(result),
        env_json=json.dumps(to_json(env, NONFINITE_AS_STRING), indent=2, allow_nan=False) if env else "")


def write_html(path: str | os.PathLike[str], result: DiagnosisResult | Sequence[Finding],
               environment: dict[str, Any] | None = None, *, partial: str | None = None,
               checkup: dict[str, Any] | None = None) -> None:
    """Write the self-contained HTML report atomically (``partial``, ``checkup``: see ``render_html``)."""
    atomic_write_bytes(path, render_html(result, environment, partial=partial, checkup=checkup).encode())
