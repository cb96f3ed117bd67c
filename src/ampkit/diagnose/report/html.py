"""The doctor's report as one self-contained HTML page (no external resources).

It shows the findings, the verified keep-fp32 fix, the SQNR table, and per-module headroom
charts (hand-written inline SVG: log2 bits to overflow and to underflow of every module's
outputs and parameter gradients, one chart per format).  Every user-derived string is
escaped with ``html.escape``.  ``write_html`` writes through
``ampkit._util.io.atomic_write_bytes``: a crash never leaves half a page.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from ampkit._util.io import atomic_write_bytes
from ampkit._util.jsonfloat import NONFINITE_AS_STRING, to_json
from ampkit.diagnose.core.display import display_module, finding_where, sort_findings
from ampkit.diagnose.core.stats import FORMATS
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.findings import Finding

__all__ = ["render_html", "write_html"]

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#666} .finding{border:1px solid #ddd;border-left-width:6px;border-radius:4px;padding:8px 12px;margin:10px 0}
.error{border-left-color:#c62828} .warning{border-left-color:#f9a825} .info{border-left-color:#1565c0}
.badge{display:inline-block;font-weight:600;font-size:12px;padding:1px 6px;border-radius:3px;color:#fff}
.badge.error{background:#c62828} .badge.warning{background:#f9a825;color:#222} .badge.info{background:#1565c0}
.code{font-weight:600;margin-left:6px} .where{color:#555;font-family:ui-monospace,monospace;font-size:12px}
.fix{margin-top:4px} .fix b{color:#2e7d32} pre{background:#f6f8fa;padding:8px;overflow:auto;font-size:12px}
table{border-collapse:collapse;font-size:13px} td,th{padding:2px 10px;border-bottom:1px solid #eee;text-align:left}
.ok{background:#e8f5e9;border:1px solid #a5d6a7;padding:8px 12px;border-radius:4px}
svg text{font:11px ui-monospace,monospace} details{margin:6px 0} summary{cursor:pointer;font-weight:600}
"""

_X_MIN, _X_MAX = -8.0, 32.0  # displayed range of headroom bits; values beyond are clipped and labelled


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _bar_color(bits: float) -> str:
    if bits < 0:
        return "#c62828"
    if bits < 2:
        return "#f9a825"
    return "#4c78a8"


def _headroom_svg(rows: dict[str, dict[str, tuple[float, float]]], fmt: str) -> str:
    """Diverging bars per module: bits to overflow (left panel), bits to underflow (right panel).

    Overflow is measured against the largest value computed inside the module (intermediates
    included), underflow against the smallest non-zero output (see ``DiagnosisResult``).
    """
    names = list(rows)
    label_w, panel_w, gap, row_h, top = 260, 330, 30, 16, 34
    width = label_w + 2 * panel_w + gap + 10
    height = top + row_h * len(names) + 10
    scale = panel_w / (_X_MAX - _X_MIN)

    def x_of(panel: int, bits: float) -> float:
        return label_w + panel * (panel_w + gap) + (min(max(bits, _X_MIN), _X_MAX) - _X_MIN) * scale

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="headroom in {_esc(fmt)}">']
    for panel, title in enumerate(("bits to overflow (largest value inside)", "bits to underflow (smallest output)")):
        x0 = x_of(panel, 0.0)
        parts.append(f'<text x="{label_w + panel * (panel_w + gap)}" y="12">{title}</text>')
        for tick in range(int(_X_MIN), int(_X_MAX) + 1, 8):
            xt = x_of(panel, tick)
            parts.append(f'<line x1="{xt:.1f}" y1="18" x2="{xt:.1f}" y2="{height - 8}" stroke="#eee"/>'
                         f'<text x="{xt - 6:.1f}" y="28" fill="#888">{tick}</text>')
        parts.append(f'<line x1="{x0:.1f}" y1="18" x2="{x0:.1f}" y2="{height - 8}" stroke="#999"/>')
    for i, name in enumerate(names):
        y = top + i * row_h
        label = display_module(name) if name else "(whole model)"
        parts.append(f'<text x="{label_w - 6}" y="{y + 11}" text-anchor="end">{_esc(label[-40:])}</text>')
        for panel, bits in enumerate(rows[name].get(fmt, (math.inf, math.inf))):
            x0 = x_of(panel, 0.0)
            if math.isinf(bits) or math.isnan(bits):
                parts.append(f'<text x="{x0 + 4:.1f}" y="{y + 11}" fill="#999">—</text>')
                continue
            x1 = x_of(panel, bits)
            left, w = (x0, x1 - x0) if x1 >= x0 else (x1, x0 - x1)
            parts.append(f'<rect x="{left:.1f}" y="{y + 2}" width="{max(w, 1):.1f}" height="{row_h - 4}" '
                         f'fill="{_bar_color(bits)}"><title>{_esc(label)}: {bits:.2f} bits</title></rect>')
            if bits > _X_MAX:  # clipped: label inside the bar's end
                parts.append(f'<text x="{x1 - 3:.1f}" y="{y + 11}" fill="#fff" text-anchor="end">{bits:.0f}&#8594;</text>')
            else:
                parts.append(f'<text x="{max(x1, x0) + 3:.1f}" y="{y + 11}" fill="#333">{bits:.1f}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _finding_html(f: Finding) -> str:
    evidence = _esc(json.dumps(to_json(f.evidence, NONFINITE_AS_STRING), indent=2, allow_nan=False))
    where = _esc(finding_where(f))
    return (f'<div class="finding {_esc(f.severity)}"><span class="badge {_esc(f.severity)}">{_esc(f.severity.upper())}'
            f'</span><span class="code">{_esc(f.code)}</span> <span class="where">{where}</span>'
            f"<div>{_esc(f.message)}</div><div class=\"fix\"><b>fix:</b> {_esc(f.fix)}</div>"
            f"<details><summary>evidence</summary><pre>{evidence}</pre></details></div>")


def _verification_html(result: DiagnosisResult) -> str:
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
    return "<br>Re-running the step with it, on a fresh copy: " + _esc("; ".join(parts)) + "."


def _sqnr_table(comparison: dict[str, Any]) -> str:
    out = comparison.get("output_sqnr_db") or {}
    grads = comparison.get("grad_sqnr_db") or {}
    if not out and not grads:
        return ""
    rows = sorted(set(out) | set(grads), key=lambda n: _num(out.get(n, grads.get(n))))[:25]
    body = "".join(f"<tr><td>{_esc(display_module(n) if n else '(model output)')}</td><td>{_fmt_db(out.get(n))}</td>"
                   f"<td>{_fmt_db(grads.get(n))}</td></tr>" for n in rows)
    return ("<h2>FP32 comparison (lowest SQNR first)</h2><table><tr><th>module</th><th>output SQNR</th>"
            f"<th>gradient SQNR</th></tr>{body}</table>")


def _num(v: Any) -> float:
    return v if isinstance(v, (int, float)) and not math.isnan(v) else math.inf


def _fmt_db(v: Any) -> str:
    if not isinstance(v, (int, float)) or math.isnan(v):
        return "—"
    return "exact" if math.isinf(v) else f"{v:.1f} dB"


def _checkup_html(checkup: dict[str, Any] | None) -> str:
    """The fp32 checkup's line: a warning when it was attempted but not compared with fp32."""
    if not checkup:
        return ""
    step = f"step {_esc(checkup.get('step'))}"
    if checkup.get("ran"):
        return (f'<div class="meta">fp32 checkup: {step} replayed in {_esc(checkup.get("precision"))} '
                "and compared with an fp32 copy.</div>")
    if checkup.get("status") in ("failed", "no_fp32"):
        return (f'<div class="finding warning"><b>fp32 checkup did not run:</b> the replay of {step} could not be '
                f"compared with fp32 ({_esc(checkup.get('reason'))}); this run was not checked against fp32.</div>")
    return f'<div class="meta">fp32 checkup not run: {_esc(checkup.get("reason"))}.</div>'


def render_html(result: DiagnosisResult | Sequence[Finding], environment: dict[str, Any] | None = None, *,
                partial: str | None = None, checkup: dict[str, Any] | None = None) -> str:
    """The report page as a string (see ``write_html``); ``partial``: how an unfinished run ended
    (``sigint``, ``sigterm``, ``sighup``, ``exception``, ``os_exit``), shown above the findings; ``checkup``: the
    doctor JSON's ``checkup`` record (``script.checkup``), shown above them too."""
    if not isinstance(result, DiagnosisResult):
        result = DiagnosisResult(findings=sort_findings(list(result)))
    env = environment or result.environment or {}
    findings = sort_findings(result.findings)
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    head = [f"<h1>ampkit doctor</h1><div class=\"meta\">precision {_esc(result.precision or '?')}"
            + (f" · step {_esc(result.step)}" if result.step is not None else "")
            + f" · {counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info"
            + (f" · torch {_esc(env.get('torch'))} on {_esc(env.get('device'))}" if env else "") + "</div>"]
    if partial is not None:
        head.append(f'<div class="finding warning"><b>Partial report:</b> the script ended by {_esc(partial)} '
                    'before its normal end; these are the findings made until then.</div>')
    head.append(_checkup_html(checkup))
    if result.keep_fp32:
        head.append(f'<h2>Verified fix</h2><div class="ok"><code>MixedPrecision(..., keep_fp32='
                    f"{_esc(repr(result.keep_fp32))})</code>{_verification_html(result)}</div>")
    body = ["<h2>Findings</h2>", *(_finding_html(f) for f in findings)] if findings else ["<h2>Findings</h2><p>none</p>"]
    charts: list[str] = []
    for title, rows in (("the forward (activations)", result.module_headroom),
                        ("the backward (gradients, unscaled)", result.grad_headroom)):
        if not rows:
            continue
        charts.append(f"<h2>Headroom of {title}</h2>")
        for i, (fmt, fr) in enumerate(FORMATS.items()):
            opened = " open" if i < 2 else ""
            charts.append(f"<details{opened}><summary>{_esc(fmt)} (max {fr.max:g}, smallest normal "
                          f"{fr.min_normal:g}; log2 bits, below 0 = out of range)</summary>"
                          f"{_headroom_svg(rows, fmt)}</details>")
    env_html = f"<h2>Environment</h2><pre>{_esc(json.dumps(to_json(env, NONFINITE_AS_STRING), indent=2, allow_nan=False))}</pre>" if env else ""
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>ampkit doctor report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(head)}{''.join(body)}"
            f"{_sqnr_table(result.comparison)}{''.join(charts)}{env_html}</body></html>\n")


def write_html(path: str | os.PathLike[str], result: DiagnosisResult | Sequence[Finding],
               environment: dict[str, Any] | None = None, *, partial: str | None = None,
               checkup: dict[str, Any] | None = None) -> None:
    """Write the self-contained HTML report atomically (``partial``, ``checkup``: see ``render_html``)."""
    atomic_write_bytes(path, render_html(result, environment, partial=partial, checkup=checkup).encode())
