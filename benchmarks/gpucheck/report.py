"""``gpu-check.json`` (schema ``ampkit.gpu-check/1``) and ``gpu-check.md``, written atomically.

The JSON is rewritten after every section with ``"complete": false``, so a run that is killed keeps
the sections it finished; the last write says ``"complete": true``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ampkit._util.io import atomic_write_text
from ampkit._util.jsonfloat import NONFINITE_AS_STRING, dumps
from gpucheck.table import THRESHOLDS

__all__ = ["SCHEMA", "base_report", "overall_status", "render_markdown", "write_report"]

SCHEMA = "ampkit.gpu-check/1"
FAILED = ("fail", "error", "timed out")


def base_report(*, device: str, tiny: bool, environment: dict[str, Any], budget_s: float) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "tiny": tiny,
        "budget_s": budget_s,
        "complete": False,
        "status": None,
        "wall_s": None,
        "environment": environment,
        "thresholds": [{"key": t.key, "rule": t.rule, "limit": t.limit, "text": t.text} for t in THRESHOLDS],
        "sections": [],
    }


def overall_status(sections: list[dict[str, Any]]) -> str:
    """``fail`` when any section failed, errored or timed out, else ``pass``."""
    return "fail" if any(s["status"] in FAILED for s in sections) else "pass"


def _measured(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_measured(v)}" for k, v in value.items() if not isinstance(v, dict))
    return "" if value is None else str(value)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict[str, Any]) -> str:
    env = report.get("environment") or {}
    gpus = ", ".join(g.get("name", "?") for g in env.get("gpus", [])) or report["device"]
    lines = [
        "# ampkit GPU check",
        "",
        f"- device: {report['device']} ({gpus}){' — tiny sizes' if report.get('tiny') else ''}",
        f"- driver {env.get('nvidia_driver')}, CUDA {env.get('cuda')}, torch {env.get('torch')}, "
        f"Python {env.get('python')}, ampkit {env.get('ampkit')}",
        f"- created {report['created']}; wall {report.get('wall_s')} s of a {report['budget_s']:.0f} s budget; "
        f"status **{report.get('status')}**{'' if report.get('complete') else ' (incomplete)'}",
    ]
    if report.get("skipped"):
        lines += ["", f"Skipped: {report['skipped']}."]
        return "\n".join(lines) + "\n"
    lines += ["", "| section | check | result | measured | threshold | detail |", "|---|---|---|---|---|---|"]
    for s in report["sections"]:
        if not s["checks"]:
            lines.append(f"| {s['name']} | | {s['status']} | | | {_cell(s.get('error') or '')} |")
        for c in s["checks"]:
            lines.append(f"| {s['name']} | {_cell(c['name'])} | {c['status']} | {_cell(_measured(c['measured']))} | "
                         f"{_cell(c['threshold'])} | {_cell(c['detail'])} |")
        if s["checks"] and s["status"] in ("timed out", "error"):
            lines.append(f"| {s['name']} | | {s['status']} | | | {_cell(s.get('error') or '')} |")
    lines += ["", "| section | status | wall s | cap s |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['wall_s']} | {s['cap_s']:g} |" for s in report["sections"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``gpu-check.json`` and ``gpu-check.md`` into ``out`` (each atomically); returns their paths."""
    json_path, md_path = out / "gpu-check.json", out / "gpu-check.md"
    atomic_write_text(json_path, dumps(report, NONFINITE_AS_STRING, indent=2) + "\n")
    atomic_write_text(md_path, render_markdown(report))
    return json_path, md_path
