"""The per-layer rows of a format's report: the fp32 range, the headroom, what the format did to the layer."""

from __future__ import annotations

from ampkit.diagnose.preflight.formats import FORMAT_SPECS
from ampkit.diagnose.preflight.fp32pass import Fp32Pass
from ampkit.diagnose.preflight.judge import Replay
from ampkit.diagnose.preflight.result import LayerReport
from ampkit.precision import FormatName

__all__ = ["layer_reports"]


def layer_reports(fp32: Fp32Pass, replay: Replay, operands: dict[str, dict[str, dict[str, float]]], fmt: FormatName, *,
                  broken: set[str], ineligible: dict[str, str]) -> list[LayerReport]:
    """One row per module the fp32 pass saw, in the order their forwards finished, measured without a policy.

    Headroom and the share below the smallest normal apply to the unscaled formats (fp16, bf16): a scaled
    format's scale follows the data, and its operand statistics say what it flushed instead."""
    unscaled = FORMAT_SPECS[fmt].scaling == "none"
    rows = []
    for name, stats in fp32.outputs.items():
        row = LayerReport(module=name, type=fp32.module_types.get(name, ""), absmax=stats.absmax,
                          forward_sqnr_db=replay.forward_sqnr.get(name), grad_sqnr_db=replay.grad_sqnr.get(name),
                          operands=operands.get(name, {}), broken=name in broken)
        if unscaled:
            row.headroom_bits = stats.headroom_bits[fmt][0]
            nonzero = 1.0 - stats.zero_frac
            row.below_normal_share = stats.subnormal_frac[fmt] / nonzero if nonzero > 0 else 0.0
        if name in ineligible:
            row.eligible, row.reason = False, ineligible[name]
        rows.append(row)
    return rows
