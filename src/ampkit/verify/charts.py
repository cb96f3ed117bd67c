"""The report's charts as inline SVG strings (``ampkit._util.svgcharts``: matplotlib, Agg backend, no files,
no network; text XML-escaped, ``$`` in names from user code escaped against mathtext).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any

from ampkit._util.svgcharts import figure, literal, svg_markup
from ampkit.verify.compare import smooth

__all__ = ["COLORS", "render_charts"]

COLORS = {"fp32": "#333333", "bf16": "#1f77b4", "fp16": "#e8710a"}

# line charts: open axes (no top and right spines) over a light grid
_STYLE = {"axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3}


def _figure(name: str, *, ncols: int = 1, width: float = 6.4,
            height: float = 3.1) -> AbstractContextManager[tuple[Any, Any]]:
    return figure(name, ncols=ncols, width=width, height=height, style=_STYLE)


def _color(precision: str) -> str:
    return COLORS.get(precision, "#7b3294")


def _steps(values: list[Any]) -> list[int]:
    return list(range(1, len(values) + 1))


def _nan(values: list[float | None]) -> list[float]:
    return [math.nan if v is None else v for v in values]


def loss_chart(report: dict[str, Any], window: int) -> str:
    warmup = report["protocol"]["warmup"]
    with _figure("loss") as (fig, (ax,)):
        for run in report["runs"]:
            if not run["loss"]:
                continue
            c = _color(run["precision"])
            ax.plot(_steps(run["loss"]), _nan(run["loss"]), color=c, alpha=0.25, linewidth=0.8)
            ax.plot(_steps(run["loss"]), smooth(run["loss"], window), color=c, linewidth=1.8,
                    label=f"{run['precision']} (smoothed, w={window})")
        if warmup:
            ax.axvline(warmup + 0.5, color="#999999", linestyle="--", linewidth=0.8, label="end of warm-up")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.set_title("Loss curves (raw, faint; smoothed, solid)")
        _legend(ax)
        return svg_markup(fig)


def loss_gap_chart(report: dict[str, Any], window: int) -> str:
    base = next((r for r in report["runs"] if r["precision"] == "fp32" and r["loss"]), None)
    tol = report["protocol"]["tolerances"]["loss"]
    with _figure("loss-gap") as (fig, (ax,)):
        if base is not None:
            s_base = smooth(base["loss"], window)
            finite = [b for b in s_base if not math.isnan(b)]
            extent = (max(finite) - min(finite)) if finite else 0.0
            for run in report["runs"]:
                if run is base or not run["loss"] or len(run["loss"]) != len(base["loss"]):
                    continue
                s_run = smooth(run["loss"], window)
                gap = [100.0 * (r - b) / extent if extent else math.nan for r, b in zip(s_run, s_base)]
                ax.plot(_steps(gap), gap, color=_color(run["precision"]), linewidth=1.5, label=run["precision"])
        ax.axhspan(-100 * tol, 100 * tol, color="#2ca02c", alpha=0.08, label=f"±{tol:.1%} (loss tolerance)")
        ax.axhline(0, color="#333333", linewidth=0.8)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("smoothed loss − fp32\n(% of fp32's loss range)")
        ax.set_title("Gap to the fp32 loss curve")
        _legend(ax)
        return svg_markup(fig)


def scale_chart(report: dict[str, Any]) -> str:
    with _figure("scale") as (fig, (ax,)):
        for run in report["runs"]:
            records = run["steps"]
            if not records:
                continue
            c = _color(run["precision"])
            x = [r["step"] for r in records]
            ax.step(x, [r["scale"] for r in records], where="post", color=c, linewidth=1.5, label=run["precision"])
            skipped = [(r["step"], r["scale"]) for r in records if r["skipped"]]
            if skipped:
                ax.scatter(*zip(*skipped), marker="x", color="#d62728", s=22, zorder=3,
                           label=f"{run['precision']}: skipped step ({len(skipped)})")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss scale")
        ax.set_title("Loss-scale trajectory (1 = no scaling)")
        _legend(ax)
        return svg_markup(fig)


def grad_norm_chart(report: dict[str, Any]) -> str:
    with _figure("grad-norm") as (fig, (ax,)):
        for run in report["runs"]:
            records = run["steps"]
            if records:
                ax.plot([r["step"] for r in records], _nan([r["grad_norm"] for r in records]),
                        color=_color(run["precision"]), linewidth=1.0, label=run["precision"])
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("unscaled gradient L2 norm")
        ax.set_title("Gradient norm (before clipping)")
        _legend(ax)
        return svg_markup(fig)


def eval_chart(report: dict[str, Any]) -> str:
    metrics = report["task"]["metrics"]
    n = len(metrics)
    with _figure("eval", ncols=n, width=6.4 if n == 1 else 12.8, height=3.1 if n == 1 else 3.4) as (fig, axes):
        for ax, (name, direction) in zip(axes, metrics.items()):
            for run in report["runs"]:
                points = [(h["step"], h["metrics"].get(name)) for h in run["eval_history"]]
                points = [(s, v) for s, v in points if v is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", markersize=3.5, color=_color(run["precision"]),
                            linewidth=1.4, label=run["precision"])
            ax.set_title(literal(f"{name} ({direction} is better)"))
            ax.set_xlabel("optimizer step")
            _legend(ax)
        return svg_markup(fig)


def _bars(ax: Any, labels: list[str], values: list[float], annotations: list[str], ylabel: str, title: str) -> None:
    bars = ax.bar(labels, values, color=[_color(p) for p in labels], width=0.55)
    for bar, note in zip(bars, annotations):
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="x", visible=False)


def performance_chart(report: dict[str, Any]) -> str:
    runs = [r for r in report["runs"] if (r["throughput"] or {}).get("samples_per_s")]
    by_precision = {c["precision"]: c for c in report["comparison"]}
    with _figure("performance", ncols=2) as (fig, (ax_speed, ax_mem)):
        labels = [r["precision"] for r in runs]
        speed = [r["throughput"]["samples_per_s"] for r in runs]
        notes = [_times(by_precision.get(p, {}).get("speedup"), p) for p in labels]
        _bars(ax_speed, labels, speed, notes, "samples / s (after warm-up)", "Throughput")
        mem_runs = [r for r in report["runs"] if r.get("memory")]
        mem_labels = [r["precision"] for r in mem_runs]
        mem = [r["memory"]["training_bytes"] / 2**20 for r in mem_runs]
        mem_notes = [_times(by_precision.get(p, {}).get("memory_ratio"), p) for p in mem_labels]
        kind = mem_runs[0]["memory"]["kind"] if mem_runs else "peak_rss"
        ylabel = "peak allocated MiB" if kind.startswith("cuda") else "peak RSS above start, MiB"
        _bars(ax_mem, mem_labels, mem, mem_notes, ylabel, "Training memory")
        return svg_markup(fig)


def _times(ratio: float | None, precision: str) -> str:
    if precision == "fp32":
        return "baseline"
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7.5, frameon=False)


def render_charts(report: dict[str, Any]) -> dict[str, str]:
    """Chart name -> ``<svg>`` markup for every chart of the HTML report."""
    window = report["comparison"][0]["loss_smoothing_window"] if report["comparison"] else 1
    return {
        "loss": loss_chart(report, window),
        "loss_gap": loss_gap_chart(report, window),
        "scale": scale_chart(report),
        "grad_norm": grad_norm_chart(report),
        "eval": eval_chart(report),
        "performance": performance_chart(report),
    }
