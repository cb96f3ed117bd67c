"""How findings are ordered and where they point, the same in every doctor and every output.

>>> display_module(None), display_module(""), display_module("blocks.0.attn")
('code outside the model', "the model's own forward", 'blocks.0.attn')
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ampkit.findings import SEVERITY_ORDER, Finding

if TYPE_CHECKING:
    from ampkit.precision import PrecisionName

__all__ = ["display_location", "display_module", "finding_where", "fp8_filter_fix", "keep_fp32_fix", "preflight_hint",
           "preflight_hint_of",
           "sort_findings"]


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Worst first: errors, then warnings, then info; stable within a severity."""
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def display_location(location: str | None) -> str | None:
    """``file:line`` relative to the working directory when the file lies under it."""
    if location is None:
        return None
    path, _, line = location.rpartition(":")
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return location
    return f"{rel}:{line}" if not rel.startswith("..") else location


def display_module(module: str | None) -> str:
    if module is None:
        return "code outside the model"
    return "the model's own forward" if module == "" else module


def keep_fp32_fix(module: str | None, why: str) -> str:
    if module is None or module == "":
        return why
    return (f"Keep {module!r} in fp32: MixedPrecision(..., keep_fp32=[{module!r}]) "
            f"(or ampkit.keep_fp32(model.get_submodule({module!r})) in a hand-written loop). {why}")


def preflight_hint(precision: str) -> str:
    """The sentence a fix about a format's fit ends with: where to see the whole model in that format.

    >>> preflight_hint("fp16").startswith(" For every layer")
    True
    """
    scale = " and the recommended init_scale" if precision == "fp16" else ""
    return f"{_HINT_START}{precision}{scale}, before training: `ampkit preflight --precision {precision} TARGET`."


_HINT_START = " For every layer's headroom and SQNR in "


def preflight_hint_of(fix: str) -> str:
    """The ``preflight_hint`` a fix ends with, or "": kept when a verified fix replaces the generic one."""
    at = fix.find(_HINT_START)
    return fix[at:] if at >= 0 else ""


def fp8_filter_fix(layers: list[str], why: str = "", *, precision: PrecisionName | None = None) -> str:
    """The remedy on a model with fp8 layers: keep ``layers`` out of fp8 (bf16 under autocast).

    >>> fp8_filter_fix(["head"], "Or use bf16.")
    "Keep 'head' out of fp8: MixedPrecision(..., fp8_filter=['head']). Or use bf16."
    >>> fp8_filter_fix(["a", "b"], precision="fp8")
    "Keep 'a', 'b' out of fp8: MixedPrecision('fp8', fp8_filter=['a', 'b'])."
    """
    names = ", ".join(repr(n) for n in layers)
    args = "..." if precision is None else repr(precision)
    return f"Keep {names} out of fp8: MixedPrecision({args}, fp8_filter={layers!r})." + (f" {why}" if why else "")


def finding_where(f: Finding) -> str:
    """``module · op · file:line · step N``: the parts the finding has."""
    parts = [display_module(f.module) if f.module is not None else None, f.op, f.location,
             f"step {f.step}" if f.step is not None else None]
    return " · ".join(p for p in parts if p)
