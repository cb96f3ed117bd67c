"""The terminal view of a preflight result: formats as columns, then one format's layers (``--precision F``)."""

from __future__ import annotations

import math
from typing import TextIO

from ampkit.diagnose.core.display import display_location
from ampkit.diagnose.preflight.result import FormatReport, PreflightResult

__all__ = ["render_layers", "render_summary"]

_VERDICT_WORDS = {"safe": "safe", "policy": "safe with policy", "unsafe": "UNSAFE"}


def render_summary(result: PreflightResult, *, file: TextIO) -> None:
    """The verdict table (under a format whose GEMMs were emulated, a line that says so), then per format that
    is not plainly safe, its first break and its policy."""
    names = [f.format + (" (emulated)" if f.emulated else "") for f in result.formats]
    emulated_gemms = [("", ["gemm emulated in fp32" if f.gemm == "emulated" else "" for f in result.formats])]
    rows = [*(emulated_gemms if any(f.gemm == "emulated" for f in result.formats) else []),
            ("verdict", [_VERDICT_WORDS[f.verdict] for f in result.formats]),
            ("policy", [_policy_cell(f) for f in result.formats]),
            ("lowest fwd SQNR dB", [_sqnr_cell(f) for f in result.formats]),
            ("seconds", [f"{f.seconds:.1f}" for f in result.formats])]
    width = max(len(label) for label, _ in rows)
    cols = [max(len(n), *(len(cells[i]) for _, cells in rows)) for i, n in enumerate(names)]
    print(" " * width + "  " + "  ".join(n.ljust(c) for n, c in zip(names, cols)), file=file)
    for label, cells in rows:
        print(label.ljust(width) + "  " + "  ".join(cell.ljust(c) for cell, c in zip(cells, cols)), file=file)
    for f in result.formats:
        if f.first_break is None:
            continue
        b = f.first_break
        where = " · ".join(p for p in (b.module, b.op, display_location(b.location)) if p)
        print(f"\n{f.format}: first break at {where or 'code outside the model'}\n    {b.reason}", file=file)
        if f.verdict == "policy":
            print(f"    fix: {_policy_code(f)}", file=file)
    if result.formats and any(f.format == "fp16" for f in result.formats):
        fp16 = result.report("fp16")
        if fp16.recommended_init_scale is not None:
            print(f"\nfp16: recommended init_scale {fp16.recommended_init_scale:g}; at the scaler's default initial "
                  f"scale {_share(fp16.grad_underflow_at_init_scale)} of the gradients' non-zero values flush to zero",
                  file=file)
    for s in result.skipped:
        print(f"\n{s['format']}: not judged, {s['reason']}", file=file)


def render_layers(report: FormatReport, *, file: TextIO) -> None:
    """One format's per-layer table: fp32 range, headroom, SQNR, the worst operand's flush share."""
    print(f"\n{report.format}: per layer (fp32 range, the format's headroom and SQNR against fp32)", file=file)
    header = ("module", "type", "max |x|", "headroom bits", "below normal", "fwd SQNR", "grad SQNR", "flush", "")
    rows = [header]
    for layer in report.layers:
        flush = max((ops.get("underflows%", 0.0) for ops in layer.operands.values()), default=None)
        rows.append((layer.module or "(model)", layer.type, _num(layer.absmax), _num(layer.headroom_bits, ".1f"),
                     _share(layer.below_normal_share), _num(layer.forward_sqnr_db, ".1f"),
                     _num(layer.grad_sqnr_db, ".1f"), "-" if flush is None else f"{flush:.2f}%",
                     "BREAKS" if layer.broken else ("not eligible: " + (layer.reason or "") if not layer.eligible else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=file)


def _policy_cell(f: FormatReport) -> str:
    if f.verdict != "policy":
        return "-"
    return _policy_code(f)


def _policy_code(f: FormatReport) -> str:
    parts = []
    if f.policy.keep_fp32:
        parts.append(f"keep_fp32={f.policy.keep_fp32!r}")
    if f.policy.fp8_filter:
        parts.append(f"fp8_filter={f.policy.fp8_filter!r}")
    if f.policy.init_scale is not None:
        parts.append(f"init_scale={f.policy.init_scale:g}")
    return ", ".join(parts)


def _sqnr_cell(f: FormatReport) -> str:
    """The lowest module forward SQNR; for a format with a policy, before it and after it (the verifying replay)."""
    if f.policy_sqnr_db.get("after") is not None:
        return f"{_db(f.policy_sqnr_db.get('before'))} -> {_db(f.policy_sqnr_db['after'])}"
    if f.policy_sqnr_db.get("before") == -math.inf:
        return "non-finite"
    values = [layer.forward_sqnr_db for layer in f.layers
              if layer.forward_sqnr_db is not None and not math.isnan(layer.forward_sqnr_db)]
    return f"{min(values):.1f}" if values else "-"


def _db(value: float | None) -> str:
    if value is None:
        return "-"
    return "non-finite" if math.isinf(value) else f"{value:.1f}"


def _num(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"
