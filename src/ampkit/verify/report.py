"""The verify report: ``report.json`` (``ampkit.verify/1``), ``report.md`` and one self-contained ``report.html``.

All three are rendered in memory first and then written one by one with
``atomic_write_bytes`` (temp file, fsync, rename), so an interrupted job leaves the previous
report or the new one, never half a file.  The HTML has no script and no external resource; a
Content-Security-Policy forbids both, so opening it makes no network request.  The HTML page is
the Jinja2 template ``ampkit/templates/verify_report.html``, whose autoescaping escapes every
string that comes from user code (task and metric names, errors, paths, environment strings);
the Markdown escapes them itself (``_md``: HTML-escaped, table pipes too).
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from ampkit._util.io import atomic_write_set
from ampkit._util.jsonfloat import NONFINITE_AS_NULL, dumps
from ampkit._util.templates import render, trusted

__all__ = ["callouts", "load_schema", "render_html", "render_json", "render_markdown", "summary_table", "write_report"]

MEMORY_DEFINITION = (
    "CUDA: torch.cuda.max_memory_allocated during the run. CPU: peak resident set size (getrusage) of the run's "
    "process minus the peak it had reached before the model was built (imports); the ratio compares these "
    "training bytes, and is left out when a run's training bytes are 0 (a model too small to raise the peak)."
)


FINAL_LOSS_WINDOW = 10
"""The final-loss column is the mean of each run's last this many finite training losses."""
FINAL_LOSS_LABEL = f"final loss (mean of last {FINAL_LOSS_WINDOW})"
FINAL_LOSS_DEFINITION = (
    f"Final loss: the mean of the last {FINAL_LOSS_WINDOW} finite training losses of the run (a non-finite loss is "
    "left out), which one noisy batch moves less than the last loss; the loss curve shows every step."
)


def load_schema() -> dict[str, Any]:
    """The JSON Schema of ``report.json`` (``ampkit/schemas/verify.schema.json``)."""
    text = resources.files("ampkit").joinpath("schemas/verify.schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def render_json(report: dict[str, Any]) -> bytes:
    """``report.json``'s bytes: non-finite floats become ``null``, the ``ampkit.verify/1`` policy."""
    return (dumps(report, NONFINITE_AS_NULL, indent=1) + "\n").encode()


# -- small formatters -----------------------------------------------------------------------------
def _num(value: Any, fmt: str = ".4g") -> str:
    return "—" if value is None else format(value, fmt)


def _pct(value: Any) -> str:
    return "—" if value is None else f"{value:.2%}"


def _ratio(value: Any) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _mib(value: Any) -> str:
    return "—" if value is None else f"{value / 2**20:.0f} MiB"


def _final_loss(run: dict[str, Any]) -> float | None:
    finite = [x for x in run.get("loss") or [] if x is not None]
    tail = finite[-FINAL_LOSS_WINDOW:]
    return sum(tail) / len(tail) if tail else None


def _metric_cells(report: dict[str, Any], run: dict[str, Any]) -> list[str]:
    return [_num((run.get("eval") or {}).get(name)) for name in report["task"]["metrics"]]


def _comparison(report: dict[str, Any], precision: str) -> dict[str, Any]:
    return next((c for c in report["comparison"] if c["precision"] == precision), {})


def _metric_deltas(entry: dict[str, Any]) -> str:
    parts = []
    for name, m in (entry.get("metrics") or {}).items():
        if m.get("delta") is not None:
            worse = m["relative_worse"]
            judged = "same" if worse == 0 else f"{abs(worse):.2%} {'worse' if worse > 0 else 'better'}"
            parts.append(f"{name} {m['delta']:+.4g} ({judged})")
    return "; ".join(parts) or "—"


def callouts(report: dict[str, Any]) -> list[str]:
    """What a reader must see first: each precision's verdict line, no fast path, a shrunk time budget."""
    out = [f"{c['precision']}: {c['summary']}" for c in report["comparison"] if c.get("summary") and not c["baseline"]]
    out += [c["hardware"]["note"] for c in report["comparison"] if c.get("hardware")]
    band = band_line(report)
    if band:
        out.append(band)
    budget = report["protocol"].get("time_budget")
    if budget:
        out.append(budget["note"][:1].upper() + budget["note"][1:])
    return out


def band_line(report: dict[str, Any]) -> str | None:
    """The fp32 noise band the verdicts were judged with, in one line (None for older reports)."""
    proto = report["protocol"].get("noise_band")
    if not proto:
        return None
    if not proto["enabled"]:
        return "No fp32 noise band (--no-noise-band): each distance is judged against its tolerance alone."
    band = (report.get("noise") or {}).get("band") or {}
    k = proto["k"]
    if band.get("missing"):
        return f"fp32 noise band not measured ({band['missing']}): distances within tolerance are inconclusive."
    parts = [f"loss distance {_pct(band.get('loss_distance'))}"]
    parts += [f"{name} {_pct(value)}" for name, value in (band.get("metrics") or {}).items()]
    return (f"fp32 noise band (a second fp32 run, data seed {proto['data_seed']}): {', '.join(parts)}; "
            f"k = {k:g}, so a pass needs k x band within the tolerance and {proto['min_resolved_steps']} steps "
            "after warm-up.")


def _band_definition(proto: dict[str, Any]) -> list[str]:
    band = proto.get("noise_band") or {}
    if not band.get("enabled"):
        return []
    return [f"Noise band: {band['definition']}; k = {band['k']:g}, and a pass needs at least "
            f"{band['min_resolved_steps']} steps after warm-up."]


def size_text(report: dict[str, Any]) -> str | None:
    """The task size the runs used, where the task has a size ladder."""
    size = report["protocol"].get("size")
    if not size:
        return None
    info = report["task"].get("info") or {}
    return f"size {size}" + (f" ({info['model']})" if info.get("model") else "")


# -- Markdown ---------------------------------------------------------------------------------------
def _md(text: Any) -> str:
    """Markdown cell text: HTML-escaped (many viewers render inline HTML) and table-safe."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return lines


SCALING_HEADER = ["precision", "ranks", "samples/s", "samples/s on 1 rank", "speed-up", "scaling efficiency"]
SCALING_DEFINITION = ("strong scaling: the task's batch is the global batch, split over the ranks; efficiency = "
                      "throughput on N ranks / (N × throughput on 1 rank), 1.0 = linear; both runs under torchrun "
                      "with one thread per rank")


def _scaling_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per run of an ``--nproc`` job (empty without ``--nproc``)."""
    if not report["protocol"].get("nproc"):
        return []
    spb = report["task"]["samples_per_batch"]
    rows = []
    for r in report["runs"]:
        sc = r.get("scaling") or {}
        base = sc.get("baseline_steps_per_s")
        rows.append([r["precision"], str(r.get("world_size", "—")),
                     _num((r["throughput"] or {}).get("samples_per_s"), ".1f"),
                     _num(base * spb if base else None, ".1f"), _ratio(sc.get("speedup")),
                     _pct(sc.get("efficiency")) if sc else "not measured"])
    return rows


def _ranks_line(report: dict[str, Any]) -> str | None:
    nproc = report["protocol"].get("nproc")
    if not nproc:
        return None
    backends = sorted({(r.get("launch") or {}).get("backend") or "?" for r in report["runs"]})
    return (f"Each precision ran on {nproc} rank(s) under torchrun with DDP ({', '.join(backends)}); "
            f"{SCALING_DEFINITION}.")


def render_markdown(report: dict[str, Any]) -> str:
    task, proto = report["task"], report["protocol"]
    metric_names = list(task["metrics"])
    out = [f"# ampkit verify: {_md(task['name'])} — {report['verdict'].upper()}", ""]
    size = size_text(report)
    out += [f"Task `{_md(task['ref'])}`" + (f", {_md(size)}," if size else "") + f" on {_md(proto['device'])}, "
            f"{proto['steps']} steps "
            f"({proto['warmup']} warm-up), seed {proto['seed']}, evaluation every {proto['eval_every']} steps. "
            f"Created {_md(report['created'])} with ampkit {_md(report['ampkit_version'])}.", ""]
    out += [f"> **{_md(line)}**" if i == 0 else f">\n> {_md(line)}" for i, line in enumerate(callouts(report))]
    out += [""] if callouts(report) else []
    out += ["## Verdict", ""]
    out += _md_table(
        ["precision", "verdict", "loss distance", "metric change", "skipped", "speed-up", "memory", "reasons"],
        ([c["precision"], c["verdict"].upper(), _pct(c.get("loss_distance")), _metric_deltas(c),
          _pct(c.get("skipped_fraction")), _ratio(c.get("speedup")), _ratio(c.get("memory_ratio")),
          "; ".join(c["reasons"] + c.get("notes", []))] for c in report["comparison"]))
    out += ["", "## Runs", ""]
    out += _md_table(
        ["precision", "status", FINAL_LOSS_LABEL, *metric_names, "skipped", "non-finite", "samples/s", "tokens/s",
         "peak memory", "training memory", "wall s"],
        ([r["precision"], r["status"], _num(_final_loss(r)), *_metric_cells(report, r), str(r["skipped_steps"]),
          str(r["nonfinite_steps"]), _num((r["throughput"] or {}).get("samples_per_s"), ".1f"),
          _num((r["throughput"] or {}).get("tokens_per_s"), ".0f"), _mib(r.get("peak_memory_bytes")),
          _mib((r.get("memory") or {}).get("training_bytes")), _num(r.get("wall_s"), ".1f")]
         for r in report["runs"]))
    scaling = _scaling_rows(report)
    if scaling:
        out += ["", "## Scaling", "", _md(_ranks_line(report)), "", *_md_table(SCALING_HEADER, scaling)]
    for r in report["runs"]:
        if r.get("error"):
            out += ["", f"### {_md(r['precision'])}: {_md(r['status'])}", "", "```",
                    str(r["error"]).replace("```", "ʼʼʼ"), "```"]
    tol = proto["tolerances"]
    out += ["", "## Protocol and definitions", "",
            f"- Loss-curve distance: {_md(proto['loss_distance'])}; tolerance {tol['loss']:.2%}.",
            f"- Metric change: relative worsening against fp32 (being better never fails); tolerance "
            f"{tol['metric']:.2%}" + (f", overrides {_md(tol['metric_overrides'])}" if tol["metric_overrides"] else "") + ".",
            f"- Skipped steps allowed: {tol['skipped']:.2%}; non-finite losses allowed: {tol['nonfinite']:.2%}"
            + (f"; minimum speed-up {tol['min_speedup']:.2f}x" if tol.get("min_speedup") else "") + ".",
            *(f"- {_md(line)}" for line in _band_definition(proto)),
            f"- {FINAL_LOSS_DEFINITION}",
            f"- Memory: {MEMORY_DEFINITION}",
            "- Every run starts from the same initial weights (SHA-256 of the state_dict, checked) and sees the "
            "same batches in the same order (SHA-256 of the first batches, checked); throughput excludes warm-up "
            "and evaluation."]
    out += [f"- {_md(n)}" for n in proto.get("notes", [])]
    out += ["", "## Environment", "", *_md_table(["key", "value"], ([k, v] for k, v in _flatten(report["environment"])))]
    return "\n".join(out) + "\n"


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(obj, dict):
        items: list[tuple[str, str]] = []
        for k, v in obj.items():
            items += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return items
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        items = []
        for i, v in enumerate(obj):
            items += _flatten(v, f"{prefix}[{i}]")
        return items
    if isinstance(obj, list):
        return [(prefix, ", ".join(map(str, obj)) or "—")]
    return [(prefix, "—" if obj is None else str(obj))]


# -- HTML -------------------------------------------------------------------------------------------
def _verdict_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per precision: its verdict, the numbers as (text, numeric) cells, and the reasons."""
    return [
        {"verdict": c["verdict"], "precision": c["precision"],
         "cells": [(_pct(c.get("loss_distance")), True), (_metric_deltas(c), False),
                   (_pct(c.get("skipped_fraction")), True), (_ratio(c.get("speedup")), True),
                   (_ratio(c.get("memory_ratio")), True)],
         "reasons": c["reasons"] + c.get("notes", [])}
        for c in report["comparison"]
    ]


def _run_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run: its (text, numeric) cells and the first 16 hex digits of its initial weights' SHA-256."""
    return [
        {"cells": [(r["precision"], False), (r["status"], False), (_num(_final_loss(r)), True),
                   *[(v, True) for v in _metric_cells(report, r)], (r["skipped_steps"], True),
                   (r["nonfinite_steps"], True), (_num((r["throughput"] or {}).get("samples_per_s"), ".1f"), True),
                   (_num((r["throughput"] or {}).get("tokens_per_s"), ".0f"), True),
                   (_mib(r.get("peak_memory_bytes")), True), (_mib((r.get("memory") or {}).get("training_bytes")), True),
                   (_num(r.get("wall_s"), ".1f"), True)],
         "init_sha256": (r.get("init_sha256") or "—")[:16]}
        for r in report["runs"]
    ]


def _definitions(proto: dict[str, Any]) -> list[str]:
    tol = proto["tolerances"]
    return [
        f"Loss-curve distance: {proto['loss_distance']}. Tolerance {tol['loss']:.2%}.",
        f"Metric change: relative worsening against fp32 (better never fails). Tolerance {tol['metric']:.2%}"
        + (f", per metric {tol['metric_overrides']}" if tol["metric_overrides"] else "") + ".",
        f"Skipped steps allowed: {tol['skipped']:.2%}. Non-finite losses allowed: {tol['nonfinite']:.2%}."
        + (f" Minimum speed-up: {tol['min_speedup']:.2f}x." if tol.get("min_speedup") else ""),
        *_band_definition(proto),
        FINAL_LOSS_DEFINITION,
        f"Memory: {MEMORY_DEFINITION}",
        "Same initial weights (SHA-256 of the state_dict) and same batches (SHA-256 of the first batches) are "
        "checked for every run; throughput excludes the warm-up steps and the evaluations.",
        *proto.get("notes", []),
    ]


def _key_value_rows(obj: Any) -> list[list[tuple[str, bool]]]:
    return [[(k, False), (v, False)] for k, v in _flatten(obj)]


def render_html(report: dict[str, Any], charts: dict[str, str]) -> str:
    """One self-contained page (the template ``ampkit/templates/verify_report.html``); ``charts`` are
    trusted SVG from ``ampkit.verify.charts``."""
    task = report["task"]
    # matplotlib wrote these SVGs (ampkit.verify.charts): with svg.fonttype "none" every text element,
    # user-named metrics included, is XML-escaped by matplotlib, and _svg strips the comments that
    # would repeat the raw strings, so the markup holds no user string unescaped.
    svgs = {name: trusted(svg) for name, svg in charts.items()}
    return render(
        "verify_report.html", report=report, task=task, proto=report["protocol"],
        title=f"ampkit verify: {task['name']}", size=size_text(report), callouts=callouts(report),
        verdict_rows=_verdict_rows(report), charts=svgs, wide_eval=len(task["metrics"]) > 1,
        run_header=["precision", "status", FINAL_LOSS_LABEL, *task["metrics"], "skipped", "non-finite", "samples/s",
                    "tokens/s", "peak memory", "training memory", "wall s", "init sha256"],
        run_rows=_run_rows(report), scaling_header=SCALING_HEADER, ranks_line=_ranks_line(report),
        scaling_rows=[[(c, i > 0) for i, c in enumerate(row)] for row in _scaling_rows(report)],
        failed=[{"precision": r["precision"], "status": r["status"],
                 "text": str(r["error"]) + (f"\n\n{r['log_tail']}" if r.get("log_tail") else "")}
                for r in report["runs"] if r.get("error")],
        definitions=_definitions(report["protocol"]), info_rows=_key_value_rows(task.get("info") or {}),
        env_rows=_key_value_rows(report["environment"]))


# -- files and terminal ---------------------------------------------------------------------------------
def write_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Render everything, then write report.json, report.md and report.html atomically; returns their paths."""
    from ampkit.verify.charts import render_charts

    out = Path(out_dir)
    rendered = {
        "json": render_json(report),
        "md": render_markdown(report).encode(),
        "html": render_html(report, render_charts(report)).encode(),
    }
    paths = {kind: out / f"report.{kind}" for kind in rendered}
    # One set: a Ctrl-C (or SIGTERM, SIGHUP) during the writes never pairs a new report.json
    # with an old report.html; the mode is the usual one of a shared file (0666 minus the umask).
    atomic_write_set({paths[kind]: data for kind, data in rendered.items()})
    return paths


def summary_table(report: dict[str, Any]) -> Any:
    """A ``rich`` table of the verdict, for the terminal (user strings are ``Text``, never markup)."""
    from rich.table import Table
    from rich.text import Text

    title = Text(f"ampkit verify: {report['task']['name']} on {report['protocol']['device']}")
    table = Table(title=title, title_justify="left")
    metric_names = list(report["task"]["metrics"])
    for col in ["precision", "verdict", FINAL_LOSS_LABEL, *metric_names, "loss dist", "skipped", "samples/s",
                "speed-up", "memory", "reasons"]:
        table.add_column(Text(col), overflow="fold",
                         justify="left" if col in ("precision", "verdict", "reasons") else "right")
    for run in report["runs"]:
        c = _comparison(report, run["precision"])
        verdict = c.get("verdict", "?")
        cells = [
            run["precision"], _num(_final_loss(run)), *_metric_cells(report, run), _pct(c.get("loss_distance")),
            str(run["skipped_steps"]), _num((run["throughput"] or {}).get("samples_per_s"), ".1f"),
            _ratio(c.get("speedup")), _ratio(c.get("memory_ratio")), "; ".join(c.get("reasons", []) + c.get("notes", [])),
        ]
        row = [Text(x) for x in cells]
        row.insert(1, Text(verdict.upper(), style={"pass": "green", "inconclusive": "bold yellow"}.get(verdict, "bold red")))
        table.add_row(*row)
    return table
