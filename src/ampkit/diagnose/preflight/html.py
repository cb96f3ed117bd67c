"""The preflight result as one self-contained HTML page (no external resources, no script).

The page shows the verdict table (formats as columns, as in the terminal), the two layers × formats heatmaps
(``heatmap.py``: headroom bits and forward SQNR), the inputs the verdicts were computed from and the
environment.  It is the Jinja2 template ``ampkit/templates/preflight_report.html``; this module computes what it
shows, and the template's autoescaping escapes every user-derived string (module names, locations, reasons).
``write_preflight_html`` writes through ``ampkit._util.io.atomic_write_bytes``: a crash never leaves half a page.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ampkit._util.io import atomic_write_bytes
from ampkit._util.jsonfloat import NONFINITE_AS_STRING, to_json
from ampkit._util.templates import render, trusted
from ampkit.diagnose.core.display import display_location
from ampkit.diagnose.preflight.heatmap import MAX_ROWS_WITH_CONTAINERS, heatmap_modules, render_heatmaps
from ampkit.diagnose.preflight.result import FormatReport, PreflightResult
from ampkit.diagnose.preflight.table import _VERDICT_WORDS, _policy_cell, _sqnr_cell

__all__ = ["render_preflight_html", "write_preflight_html"]


def render_preflight_html(result: PreflightResult) -> str:
    """The report page as a string (see ``write_preflight_html``)."""
    # matplotlib wrote these SVGs (heatmap.py through ampkit._util.svgcharts): with svg.fonttype "none" every text
    # element, the module names in the tick labels included, is XML-escaped by matplotlib, `$` is escaped against
    # mathtext, and the comments that would repeat the raw strings are stripped, so the markup holds no user
    # string unescaped (tests/diagnose/preflight/test_html.py renders a module named <script>...</script>).
    charts = {name: trusted(svg) for name, svg in render_heatmaps(result).items()}
    env = result.environment or {}
    return render(
        "preflight_report.html", columns=[_column(f) for f in result.formats], counts=_counts(result),
        skipped=result.skipped, charts=charts, rows_line=_rows_line(result), inputs=_inputs(result.inputs), env=env,
        env_json=json.dumps(to_json(env, NONFINITE_AS_STRING), indent=2, allow_nan=False) if env else "")


def write_preflight_html(result: PreflightResult, path: str | os.PathLike[str]) -> None:
    """Write the self-contained HTML page of ``result`` to ``path`` atomically."""
    atomic_write_bytes(path, render_preflight_html(result).encode("utf-8"))


def _column(report: FormatReport) -> dict[str, Any]:
    brk = report.first_break
    where = [] if brk is None else [p for p in (brk.module, brk.op, display_location(brk.location)) if p]
    return {"format": report.format, "emulated": report.emulated, "verdict": report.verdict,
            "verdict_text": _VERDICT_WORDS[report.verdict], "policy": _policy_cell(report),
            "sqnr": _sqnr_cell(report), "where": where, "reason": "-" if brk is None else brk.reason}


def _counts(result: PreflightResult) -> str:
    counts = {v: sum(1 for f in result.formats if f.verdict == v) for v in _VERDICT_WORDS}
    return ", ".join(f"{n} {_VERDICT_WORDS[v]}" for v, n in counts.items() if n) or "no format judged"


def _rows_line(result: PreflightResult) -> str:
    shown = len(heatmap_modules(result))
    total = len({layer.module for f in result.formats for layer in f.layers})
    rows = (f"{total} modules" if shown == total else
            f"the {shown} leaf modules of {total} (a model with more than {MAX_ROWS_WITH_CONTAINERS} modules)")
    return (f"Rows: {rows}, in the order their forwards finished; columns: the judged formats. Grey cells: not "
            "measured (headroom applies to fp16 and bf16 only: a scaled format's scale follows the data).")


def _inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"batches": inputs.get("batches", "-"), "weights_sha256": inputs.get("weights_sha256", "-"),
            "shapes": [json.dumps(shape) for shape in inputs.get("shapes", [])]}
