"""``ampkit doctor --compare-compiled``: compare the script's last captured step compiled vs eager.

The step is the last forward of a model the doctor captured (its batch, RNG and autocast state,
and the gradient its outputs received), compared module by module by
``ampkit.diagnose.step.compiled.compare_compiled`` with the options of the script's own
``torch.compile`` call (inductor by default).  Each module whose compiled outputs or gradients
differ beyond its dtype's tolerance, while none of its descendants does, becomes a
COMPILED_DIVERGENCE finding.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.core.display import display_module
from ampkit.diagnose.step.compiled import CompiledComparison, ModuleDelta, TensorDelta, compare_compiled
from ampkit.findings import Finding

if TYPE_CHECKING:
    from ampkit.diagnose.script.context import Context

__all__ = ["compare_last_step", "divergence_findings"]


def compare_last_step(ctx: Context, wanted: bool = True) -> tuple[CompiledComparison | None, list[Finding]]:
    """The comparison of the last captured step and its findings; ``(None, [])`` when not ``wanted``, when
    no model forward was captured, or when the comparison failed (the reason is printed)."""
    comparison = _compare(ctx) if wanted else None
    return comparison, divergence_findings(comparison, ctx) if comparison is not None else []


def _compare(ctx: Context) -> CompiledComparison | None:
    cap = ctx.state.models.last
    if cap is None:
        return None
    device, dtype, enabled = cap.device.type, cap.autocast_dtype, cap.autocast_enabled
    print(f"ampkit doctor: comparing torch.compile against eager on step {cap.step}, module by module "
          "(one compile per compared module)", file=sys.stderr)
    try:
        with ctx.state.pause(), cap.running_stats_before():
            return compare_compiled(
                cap.root, cap.args, cap.kwargs, grads=cap.seed_grads(), rng_cpu=cap.rng_cpu,
                autocast=lambda: torch.autocast(device, dtype=dtype, enabled=enabled),
                dtype=cap.low_precision or torch.float32, options=ctx.compiles.module_options())
    except Exception as exc:  # the comparison must never cost the user the run's other findings
        print(f"ampkit doctor: could not compare compiled against eager: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return None


def divergence_findings(comparison: CompiledComparison, ctx: Context) -> list[Finding]:
    """One COMPILED_DIVERGENCE per reported module, named as the doctor names modules."""
    cap = ctx.state.models.last
    if cap is None:
        return []
    return [_finding(m, worst, ctx.state.models.qualify(cap.root, m.module) or "", cap.location, cap.step)
            for m in comparison.culprits() if (worst := m.worst) is not None]


def _finding(m: ModuleDelta, worst: TensorDelta, name: str, location: str | None, step: int) -> Finding:
    shown = display_module(name)
    dtype = dtype_name(m.dtype)
    if worst.nonfinite is not None:
        which = {"compiled": "under torch.compile, where eager is finite",
                 "eager": "eagerly, where torch.compile is finite"}.get(worst.nonfinite, "at different places in each")
        what = (f"its {worst.what} holds inf/NaN {which}, on the same inputs and weights; every submodule compared "
                f"agrees, so the difference is born in this module's own ops (an intermediate kept, saved or "
                f"recomputed in {dtype} by one and not the other)")
    else:
        what = (f"its {worst.what} has an SQNR of {worst.sqnr_db:.1f} dB against eager on the same inputs and "
                f"weights (tolerance {m.tolerance_db:.1f} dB for {dtype}; max abs diff {worst.max_abs_diff:.3g}, "
                f"max rel diff {worst.max_rel_diff:.3g}), while every submodule compared agrees: the difference "
                f"is born in this module's own ops (typically {dtype} rounding that eager does after each op and "
                "the fused compiled kernel does once)")
    return Finding(
        code="COMPILED_DIVERGENCE", severity="warning", module=name, location=location, step=step,
        message=f"{shown} computes differently under torch.compile: {what}",
        fix=(f"make the result independent of rounding order: compute `{shown}` in fp32 "
             f"(MixedPrecision(..., keep_fp32=[{name!r}]) or `torch.autocast(..., enabled=False)` with `.float()` "
             "inputs), or rewrite the cancelling expression (e.g. `(a + b) - a` -> `b`); "
             "`torch.compiler.disable` on the module only hides the difference"),
        evidence={k: v for k, v in m.to_dict().items() if k != "module"},
    )
