"""BACKWARD_OVERFLOW: the first backward op that made gradients non-finite, judged against the scale.

A backward producer is classified by re-running the backward at loss scale 1:

* finite at scale 1: ordinary dynamic loss scaling (**info**; the largest safe scale is given);
* still non-finite: the gradient itself exceeds the format (**error**: no loss scale ≥ 1 helps).

Among the errors, a **derivative singularity** (``singularity``) is told apart: the backward of
sqrt, pow(x, p < 1), a vector norm or cdist at 0, of acos/asin at ±1, or of atan2 at (0, 0) is
infinite, so it overflows at any scale.  In low precision this happens when a small quantity
underflowed to exactly 0 (an ``eps`` of 1e-8 is 0 in fp16; a difference of nearly equal
values rounds to 0; a cosine of nearly parallel vectors rounds to 1).  The fix is never a
different loss scale: keep that computation in fp32, with the epsilon inside the sqrt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.core.display import display_location, display_module, keep_fp32_fix
from ampkit.diagnose.core.stats import FORMATS
from ampkit.diagnose.step.events import Producer, find_producer
from ampkit.diagnose.step.session import RunResult, Session
from ampkit.diagnose.step.trace import TraceLog
from ampkit.findings import Finding

__all__ = ["Singularity", "backward_finding", "node_singularity", "remedy", "singularity"]


@dataclass(frozen=True)
class Singularity:
    """A backward op that differentiates a function at a point where its derivative is infinite."""

    function: str
    """``sqrt``, ``pow``, ``norm``, ``cdist``, ``acos``, ``asin`` or ``atan2``."""
    point: str
    """Where the derivative is infinite: ``0``, ``±1`` or ``(0, 0)``."""
    confirmed: bool
    """Whether the forward values show the point was hit (an output of exactly 0, an input of ±1);
    atan2's point cannot be read from a range, so it rests on the backward alone."""

    def to_json(self) -> dict[str, Any]:
        return {"function": self.function, "at": self.point, "confirmed": self.confirmed}


# Autograd node -> (function, point, what the forward range must show: "out0" an output of 0,
# "in1" an input of ±1, None nothing readable).
_NODES: dict[str, tuple[str, str, str | None]] = {
    "SqrtBackward0": ("sqrt", "0", "out0"),
    "PowBackward0": ("pow", "0", "out0"),
    "PowBackward1": ("pow", "0", "out0"),
    "NormBackward0": ("norm", "0", "out0"),
    "NormBackward1": ("norm", "0", "out0"),
    "NormBackward2": ("norm", "0", "out0"),
    "LinalgVectorNormBackward0": ("norm", "0", "out0"),
    "CdistBackward0": ("cdist", "0", "out0"),
    "AcosBackward0": ("acos", "±1", "in1"),
    "AsinBackward0": ("asin", "±1", "in1"),
    "Atan2Backward0": ("atan2", "(0, 0)", None),
}

_REMEDY = {
    "sqrt": "move the epsilon inside the sqrt and add it in fp32: torch.sqrt(x.float() + eps)",
    "pow": "add the epsilon inside, in fp32: (x.float() + eps) ** p",
    "norm": "compute the norm in fp32 with the epsilon inside: torch.sqrt((d.float() ** 2).sum(-1) + eps)",
    "cdist": "compute the distances in fp32 with the epsilon inside: torch.sqrt(squared_distances.float() + eps)",
    "acos": "compute the cosine in fp32 and clamp it to [-1 + 1e-6, 1 - 1e-6] before acos (or use "
            "atan2(|a × b|, a · b))",
    "asin": "compute the argument in fp32 and clamp it to [-1 + 1e-6, 1 - 1e-6] before asin",
    "atan2": "compute it in fp32 and keep (y, x) away from (0, 0) (add eps to x)",
}


def node_singularity(node: str, exponent: float | None = None) -> tuple[str, str] | None:
    """(function, point) when the autograd node ``node`` differentiates a function with an infinite
    derivative somewhere (``SqrtBackward0``: sqrt at 0); None for any other node.  A pow node is
    singular only for an exponent below 1 (``exponent``, when known).

    >>> node_singularity("SqrtBackward0"), node_singularity("PowBackward0", 2.0), node_singularity("MulBackward0")
    (('sqrt', '0'), None, None)
    """
    known = _NODES.get(node)
    if known is None or (known[0] == "pow" and exponent is not None and exponent >= 1):
        return None
    return known[0], known[1]


def remedy(function: str) -> str:
    """How to compute ``function`` (a ``node_singularity`` function) away from its singular point."""
    return _REMEDY[function]


def singularity(log: TraceLog, p: Producer) -> Singularity | None:
    """The derivative singularity behind backward producer ``p``, or None for an ordinary overflow."""
    rec = p.record
    known = _NODES.get(rec.node or "")
    if known is None or rec.forward_op is None:
        return None
    function, point, check = known
    if function == "pow" and rec.op.split("::", 1)[-1] != "pow":
        return None  # x ** p for p ≥ 1 overflows in its multiplications, not at a singular point
    fwd = log.records[rec.forward_op]
    confirmed = False
    if check == "out0" and fwd.out_slots:
        confirmed = log.values[fwd.out_slots[0]][0] == 0.0  # these outputs are ≥ 0: min 0 means a 0
    elif check == "in1" and fwd.in_slots:
        mn, mx = log.values[fwd.in_slots[0]]
        confirmed = mn == -1.0 or mx == 1.0
    if check is not None and not confirmed:
        return None
    return Singularity(function, point, confirmed)


def backward_finding(s: Session, lp: RunResult, p: Producer, *, step: int | None,
                     ref: RunResult | None) -> Finding:
    """BACKWARD_OVERFLOW for backward producer ``p`` of run ``lp`` (see the module docstring);
    ``ref`` is the fp32 shadow's run, when there is one."""
    rec = p.record
    scale = s.program.loss_scale
    fwd_op = lp.log.records[rec.forward_op].op if lp.log and rec.forward_op is not None else None
    lp_name = dtype_name(s.precision.dtype)
    evidence: dict[str, Any] = {
        "phase": "backward", "kind": p.kind, "loss_scale": scale, "forward_op": fwd_op, "node": rec.node,
        "input_dtypes": list(p.in_dtypes), "output_dtype": p.out_dtype,
        "grad_absmax_unscaled": p.in_absmax / scale,
    }
    where = f"{rec.op} (backward of {fwd_op or 'an op'} in {display_module(rec.module)})"
    log = lp.log
    if scale > 1.0:
        unit = s.run(s.work, mode="unit", trace=True, stats=False)
        s.reset_work()
        evidence["overflows_at_scale_1"] = not unit.finite
        if unit.finite:
            return _dynamic_scaling(p, where, scale, peak_backward(unit, lp_name), lp_name, evidence, step)
        # The op that overflows at any scale is the first producer of the scale-1 run: at the
        # larger scale an ordinary overflow elsewhere may have come first.
        persistent = find_producer(unit.log, "backward") if unit.log is not None else None
        if persistent is not None and unit.log is not None and singularity(unit.log, persistent) is not None:
            p, log = persistent, unit.log
            rec = p.record
            fwd_op = log.records[rec.forward_op].op if rec.forward_op is not None else None
            evidence.update(forward_op=fwd_op, node=rec.node, input_dtypes=list(p.in_dtypes), output_dtype=p.out_dtype,
                            grad_absmax_unscaled=p.in_absmax, kind=p.kind)
            where = f"{rec.op} (backward of {fwd_op or 'an op'} in {display_module(rec.module)})"
    sing = singularity(log, p) if log is not None else None
    if sing is not None:
        return _singular(p, sing, where, fwd_op, evidence, step, ref)
    message = (f"{where} produced non-finite {dtype_name(p.out_dtype)} gradients from finite ones"
               + (f" at loss scale {scale:g}, and still does at scale 1" if scale > 1.0 else
                  " with no loss scaling") + ": the gradient itself exceeds the format's range, so no loss scale ≥ 1 "
               "avoids it")
    fix = keep_fp32_fix(rec.module, "Or reduce the magnitudes involved (normalise, clip activations) or use bf16.")
    return Finding(code="BACKWARD_OVERFLOW", severity="error", message=message, fix=fix, module=rec.module,
                   op=rec.op, location=display_location(rec.location), step=step, evidence=evidence)


def _dynamic_scaling(p: Producer, where: str, scale: float, peak: float, lp_name: str, evidence: dict[str, Any],
                     step: int | None) -> Finding:
    safe = None
    if peak > 0 and lp_name in FORMATS:
        safe = 2.0 ** math.floor(math.log2(FORMATS[lp_name].max / peak))
    evidence["largest_unscaled_gradient"] = peak
    evidence["max_safe_scale"] = safe
    message = (f"{where} overflowed at loss scale {scale:g}; at scale 1 the same backward is finite "
               f"(largest unscaled gradient {peak:.4g}" + (f", so scales up to {safe:g} fit)" if safe else ")")
               + ": this is ordinary dynamic loss scaling — the step is skipped and the scale backs off")
    fix = ("Nothing to change if it happens now and then. If most steps are skipped, start lower: "
           f"DynamicLossScaler(init_scale={safe:g})" if safe else
           "Nothing to change if it happens now and then; if most steps are skipped, lower init_scale.")
    rec = p.record
    return Finding(code="BACKWARD_OVERFLOW", severity="info", message=message, fix=fix, module=rec.module, op=rec.op,
                   location=display_location(rec.location), step=step, evidence=evidence)


def _singular(p: Producer, sing: Singularity, where: str, fwd_op: str | None, evidence: dict[str, Any],
              step: int | None, ref: RunResult | None) -> Finding:
    rec = p.record
    fp32_finite = None if ref is None else ref.finite
    evidence.update(singularity=sing.to_json(), overflows_at_any_scale=True, fp32_gradients_finite=fp32_finite)
    low = p.out_dtype if p.out_dtype in ("fp16", "bf16") else "low precision"
    hit = ("a value near ±1 rounded to exactly ±1" if sing.point == "±1" else
           "a small quantity underflowed to exactly 0")
    why = (f" The fp32 reference's gradients are finite: {hit} in {low}." if fp32_finite else
           " The fp32 reference hits it too: the value is exactly at the singular point in any precision."
           if fp32_finite is False else "")
    loc = display_location(rec.location)
    message = (f"{where} produced non-finite gradients from finite ones: the derivative of {sing.function} at "
               f"{sing.point} is infinite ({fwd_op or sing.function}"
               + (f" at {loc}" if loc else "") + " was evaluated there), so it overflows at any scale; "
               f"a larger or smaller loss scale does not change it.{why}")
    remedy = _REMEDY[sing.function]
    eps = " An epsilon below 6e-8 is 0 in fp16." if sing.point == "0" else ""
    fix = keep_fp32_fix(rec.module, f"Or keep that computation in fp32 by hand (torch.autocast(..., enabled=False) "
                        f"and .float()): {remedy}.{eps} Changing the loss scale is not the remedy: the gradient is "
                        "infinite at any scale.")
    return Finding(code="BACKWARD_OVERFLOW", severity="error", message=message, fix=fix, module=rec.module,
                   op=rec.op, location=loc, step=step, evidence=evidence)


def peak_backward(run: RunResult, fmt: str) -> float:
    """Largest finite |gradient| among backward op outputs in the low-precision format."""
    if run.log is None:
        return 0.0
    dtype = dtype_name(FORMATS[fmt].torch_dtype) if fmt in FORMATS else ""
    peak = 0.0
    for rec in run.log.records:
        if rec.phase != "backward":
            continue
        for slot, d in zip(rec.out_slots, rec.out_dtypes):
            if d == dtype:
                v = run.log.absmax(slot)
                if math.isfinite(v):
                    peak = max(peak, v)
    return peak
