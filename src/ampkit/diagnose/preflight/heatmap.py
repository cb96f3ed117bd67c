"""The preflight page's heatmaps, layers × formats, as inline SVG (``ampkit._util.svgcharts``).

Two charts: fp16/bf16 headroom in bits (``LayerReport.headroom_bits``; a scaled format's column stays empty, its
scale follows the data) and forward-output SQNR against fp32 in dB.  Each cell shows its value; a broken layer's
cell is outlined.  Rows are the layers in the order their forwards finished, the leaf modules only once a model
has more than ``MAX_ROWS_WITH_CONTAINERS`` modules (a container's output is mostly its last child's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ampkit._util.svgcharts import figure, literal, svg_markup
from ampkit.diagnose.preflight.result import LayerReport, PreflightResult

__all__ = ["MAX_ROWS_WITH_CONTAINERS", "heatmap_modules", "render_heatmaps"]

MAX_ROWS_WITH_CONTAINERS = 40


@dataclass(frozen=True)
class _Scale:
    """One chart's colour scale: values clip to [low, high] on a red (bad) to green (good) map."""

    title: str
    unit: str
    low: float
    high: float


_HEADROOM = _Scale("fp16 / bf16 headroom: bits from a layer's largest output\nto the format's largest value",
                   "headroom, bits (< 0 overflows)", -4.0, 16.0)
_SQNR = _Scale("Forward-output SQNR against fp32", "SQNR, dB (higher is closer to fp32)", 0.0, 60.0)


def heatmap_modules(result: PreflightResult) -> list[str]:
    """The rows: every judged module in forward order, or only the leaves of a model with many modules."""
    names = list(dict.fromkeys(layer.module for f in result.formats for layer in f.layers))
    if len(names) <= MAX_ROWS_WITH_CONTAINERS:
        return names
    return [n for n in names if not any(other != n and (n == "" or other.startswith(n + ".")) for other in names)]


def render_heatmaps(result: PreflightResult) -> dict[str, str]:
    """``{"headroom": svg, "sqnr": svg}``, or ``{}`` when no format has layer rows (nothing was judged)."""
    modules = heatmap_modules(result)
    if not modules:
        return {}
    return {"headroom": _heatmap("preflight-headroom", result, modules, _HEADROOM, lambda r: r.headroom_bits),
            "sqnr": _heatmap("preflight-sqnr", result, modules, _SQNR, lambda r: r.forward_sqnr_db)}


def _heatmap(name: str, result: PreflightResult, modules: list[str], scale: _Scale,
             value_of: Callable[[LayerReport], float | None]) -> str:
    import numpy as np

    values, cells = _grid(result, modules, scale, value_of)
    with figure(name, width=_width(modules, len(result.formats)), height=1.9 + 0.24 * len(modules),
                style={"axes.facecolor": "#f2f2f2"}) as (fig, (ax,)):
        mesh = ax.pcolormesh(np.ma.masked_invalid(values), cmap="RdYlGn", vmin=scale.low, vmax=scale.high,
                             edgecolors="white", linewidth=0.5)
        for i, j, text, broken in cells:
            red, green, blue, _ = mesh.cmap(mesh.norm(values[i, j]))
            dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5  # white text on a dark cell (ITU-R 601 luma)
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=7.5, color="white" if dark else "black")
            if broken:
                ax.add_patch(_outline(j, i))
        ax.set_xticks([j + 0.5 for j in range(len(result.formats))],
                      [f.format + (" (emulated)" if f.emulated else "") for f in result.formats],
                      rotation=35, ha="left", rotation_mode="anchor")
        ax.xaxis.tick_top()
        ax.set_yticks([i + 0.5 for i in range(len(modules))], [literal(m or "(model)") for m in modules])
        ax.set_ylim(len(modules), 0)  # first layer at the top
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(scale.title + "\n(outlined: a layer where the format breaks; grey: not measured)", fontsize=9)
        fig.colorbar(mesh, ax=ax, label=scale.unit, extend="both", fraction=0.04, pad=0.02)
        return svg_markup(fig)


def _grid(result: PreflightResult, modules: list[str], scale: _Scale,
          value_of: Callable[[LayerReport], float | None]) -> tuple[Any, list[tuple[int, int, str, bool]]]:
    """The colour values (NaN: no cell) and the cells to label: row, column, text, broken."""
    import numpy as np

    values = np.full((len(modules), len(result.formats)), np.nan)
    cells = []
    for j, report in enumerate(result.formats):
        by_module = {layer.module: layer for layer in report.layers}
        for i, module in enumerate(modules):
            layer = by_module.get(module)
            value = None if layer is None else value_of(layer)
            if layer is None or value is None:
                continue  # not measured for this format: the cell stays empty
            # a NaN (the format made the output non-finite) takes the worst colour
            values[i, j] = scale.low if math.isnan(value) else min(max(value, scale.low), scale.high)
            cells.append((i, j, _cell_text(value), layer.broken))
    return values, cells


def _cell_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return ("∞" if value > 0 else "−∞") if math.isinf(value) else f"{value:.1f}"


def _outline(column: int, row: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((column + 0.04, row + 0.06), 0.92, 0.88, fill=False, edgecolor="#111111", linewidth=2.2,
                     zorder=3)


def _width(modules: list[str], columns: int) -> float:
    """Inches: the longest module name at about 0.065 in a character (capped), the cells, the colour bar."""
    label = min(0.065 * max(len(m) for m in modules), 4.0)
    return 1.6 + label + 0.85 * max(columns, 2)
