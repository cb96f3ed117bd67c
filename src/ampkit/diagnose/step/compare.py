"""The FP32 shadow: per-module SQNR of outputs and parameter gradients, and gradient underflow.

The reference is a deep copy of the model in fp32 that runs the same batch with the same RNG
state (see ``ampkit.diagnose.step.session``).  For a module output ``x`` and its fp32 reference
``r``::

    SQNR(x) = 10 · log10(‖r‖² / ‖r − x‖²)   dB, reduced in float64 (float32 on mps)

Thresholds (documented defaults, both configurable):

* ``SQNR_THRESHOLD_DB = 20``: below it the error's RMS exceeds 10 % of the signal's RMS.
  A healthy bf16 step of a small transformer sits around 30–45 dB on activations and
  25–40 dB on gradients; fp16 about 20 dB higher.  20 dB is a loss that changes results, not
  rounding noise.
* ``UNDERFLOW_THRESHOLD = 0.01``: a module whose parameter gradients are non-zero in fp32 but
  exactly zero after the low-precision backward (unscaled) for at least 1 % of the elements.
  GRADIENT_UNDERFLOW names the module with the largest such share (``flushed_shares``), not the
  first module of the model: a small-gradient layer deep in the net (a residual branch behind a
  layer scale of 1e-6) is flushed while the stem's gradients are fine.

PRECISION_LOSS is only reported for a step without overflow; it names the first module (in
the order forwards complete, so the innermost one) whose output falls below the threshold,
and separately the module whose parameter gradients are worst.

Both rules have a borderline band (``ampkit.thresholds``: ±1.5 dB of SQNR, ±0.5 percentage
points of flushed share): a value inside it is an info row marked ``borderline``, the same on
every CPU, and only a value beyond it is a warning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ampkit.diagnose.core.display import display_module, fp8_filter_fix, preflight_hint
from ampkit.diagnose.core.modules import reduction_dtype
from ampkit.diagnose.step.fp8 import layers_to_filter
from ampkit.findings import Finding
from ampkit.precision import PrecisionName
from ampkit.thresholds import THRESHOLDS, Threshold, as_borderline

__all__ = [
    "SQNR_THRESHOLD_DB",
    "UNDERFLOW_THRESHOLD",
    "GradComparison",
    "compare_grads",
    "flush_bound",
    "flushed_shares",
    "fp8_precision_fix",
    "module_sqnr",
    "precision_findings",
    "sqnr_db",
    "underflow_finding",
]

SQNR_THRESHOLD_DB = THRESHOLDS["PRECISION_LOSS"].threshold
UNDERFLOW_THRESHOLD = THRESHOLDS["GRADIENT_UNDERFLOW"].threshold


def sqnr_db(signal: float, noise: float) -> float:
    """SQNR in dB from energies; ``inf`` for an exact match, ``nan`` when undefined.

    >>> sqnr_db(100.0, 1.0)
    20.0
    >>> sqnr_db(1.0, 0.0)
    inf
    """
    if not (math.isfinite(signal) and math.isfinite(noise)):
        return math.nan
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return math.nan
    return 10.0 * math.log10(signal / noise)


def module_sqnr(energies: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, float]:
    """Per module SQNR over all its calls (one host transfer)."""
    names = [n for n, pairs in energies.items() if pairs]
    if not names:
        return {}
    rows = []
    for n in names:
        sig = torch.stack([p[0] for p in energies[n]]).sum()
        noise = torch.stack([p[1] for p in energies[n]]).sum()
        rows.append(torch.stack([sig, noise]).to(torch.float64 if sig.device.type != "mps" else torch.float32))
    values = torch.stack([r.cpu() for r in rows]).tolist()
    return {n: sqnr_db(s, e) for n, (s, e) in zip(names, values)}


@dataclass
class GradComparison:
    """Low-precision parameter gradients (unscaled) against the fp32 reference, per module."""

    sqnr_db: dict[str, float] = field(default_factory=dict)
    underflow: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Module -> (elements zero here but non-zero in fp32, elements non-zero in fp32)."""
    global_sqnr_db: float = math.nan

    def underflow_frac(self, module: str) -> float:
        lost, nonzero = self.underflow.get(module, (0, 0))
        return lost / nonzero if nonzero else 0.0


def flush_bound(dtype: torch.dtype, loss_scale: float) -> float:
    """Largest unscaled fp32 gradient magnitude whose zero in ``dtype`` counts as flushed.

    A gradient entry is flushed when the format's range cannot hold it: at or near the
    smallest normal, or a sum of such entries.  Beyond 2^10 times the smallest normal (fp16:
    0.06) the format holds the value easily, and a zero comes from another decision taken
    under rounding (a ReLU or a max choosing differently), which is precision loss, not
    underflow.  bf16's bound, 1e-35, leaves only true underflow.

    >>> flush_bound(torch.float16, 1.0) == 2.0 ** -14 * 2 ** 10
    True
    """
    return float(torch.finfo(dtype).tiny) * 2.0**10 / loss_scale


def compare_grads(
    reference: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], *, inv_scale: float,
    param_module: dict[str, str], flushed_below: float = math.inf,
) -> GradComparison:
    """Compare gradients parameter by parameter and aggregate per owning module (one transfer).

    An entry counts as lost when it is non-zero in fp32 but exactly zero here, and its fp32
    magnitude is below ``flushed_below`` (``flush_bound``: unscaled units)."""
    names = [n for n in reference if n in grads]
    if not names:
        return GradComparison()
    rows = []
    # Elementwise passes over every gradient (a model's worth of memory traffic): the scale-1
    # multiply and the bound of an infinite ``flushed_below`` are skipped, not run as no-ops.
    for n in names:
        ref = reference[n].detach()
        acc = reduction_dtype(ref.device)
        g = grads[n].detach().to(device=ref.device, dtype=acc)
        if inv_scale != 1.0:
            g = g * inv_scale
        r = ref.to(acc)
        ref_nz = r != 0
        zeroed = ref_nz & (g == 0)
        if flushed_below != math.inf:
            zeroed &= r.abs() < flushed_below
        rows.append(torch.stack([
            torch.linalg.vector_norm(r).square(), torch.linalg.vector_norm(r - g).square(),
            torch.count_nonzero(zeroed).to(acc), torch.count_nonzero(ref_nz).to(acc),
        ]))
    values = torch.stack(rows).cpu().tolist()  # one read-back for all parameters
    out = GradComparison()
    per_module: dict[str, list[float]] = {}
    for n, (sig, noise, lost, nz) in zip(names, values):
        acc_row = per_module.setdefault(param_module.get(n, ""), [0.0, 0.0, 0.0, 0.0])
        for i, v in enumerate((sig, noise, lost, nz)):
            acc_row[i] += v
    for module, (sig, noise, lost, nz) in per_module.items():
        out.sqnr_db[module] = sqnr_db(sig, noise)
        out.underflow[module] = (int(lost), int(nz))
    total = [sum(v[i] for v in per_module.values()) for i in range(2)]
    out.global_sqnr_db = sqnr_db(total[0], total[1])
    return out


def _first_judged(sqnr: dict[str, float], rule: Threshold,
                  order: list[str] | None = None) -> tuple[list[tuple[str, float]], bool]:
    """(module, SQNR) reported under ``rule`` (in ``order``, else worst first), or failing any, the
    borderline ones (flag True)."""
    names = order if order is not None else sorted(sqnr, key=lambda n: sqnr[n])
    return rule.pick([(n, sqnr[n]) for n in names if n in sqnr], lambda row: row[1])


def precision_findings(
    *, order: list[str], out_sqnr: dict[str, float], grads: GradComparison | None, threshold_db: float,
    underflow_threshold: float, precision: PrecisionName, loss_scale: float, step: int | None,
    fp8_layers: Sequence[str] | None = None,
) -> list[Finding]:
    """PRECISION_LOSS (activations, gradients) and GRADIENT_UNDERFLOW for a finite step.

    A module within the borderline band of ``threshold_db`` is an info row (``ampkit.thresholds``),
    reported only when no module is clearly below it.  ``fp8_layers``: the model's ``Float8Linear``
    layers on an fp8 model, whose PRECISION_LOSS fix keeps layers out of fp8 (``fp8_filter``)."""
    findings: list[Finding] = []
    rule = THRESHOLDS["PRECISION_LOSS"].at(threshold_db)

    def precision_loss(judged: tuple[list[tuple[str, float]], bool], kind: str, message: Callable[[str, float], str],
                       advice: str, **evidence: Any) -> None:
        """PRECISION_LOSS at the first module ``judged`` names, if any (a borderline row when only those are)."""
        below, borderline = judged
        if not below:
            return
        name, value = below[0]
        finding = Finding(
            code="PRECISION_LOSS", severity="warning", message=message(display_module(name), value),
            fix=(f"Keep {name!r} in fp32 (MixedPrecision(..., keep_fp32=[{name!r}])){advice}" if fp8_layers is None
                 else fp8_precision_fix(name, fp8_layers, order, gradient=kind == "gradient")) + preflight_hint(precision),
            module=name, step=step,
            evidence={"kind": kind, "sqnr_db": value, "threshold_db": threshold_db, **evidence,
                      "below_threshold": dict(below[:12]), "judgement": rule.evidence(value)},
        )
        findings.append(as_borderline(finding, rule, value) if borderline else finding)

    precision_loss(
        _first_judged(out_sqnr, rule, order), "activation",
        lambda module, value: (f"{module}'s output differs from the fp32 reference by {value:.1f} dB SQNR (threshold "
                               f"{threshold_db:g} dB: the error is {100 * 10 ** (-value / 20):.0f}% of the signal) "
                               "with no overflow; it is the first module in forward order below the threshold"),
        ", or compute its sensitive part (reductions, exp/log, long accumulations) in fp32.", precision=precision)
    if grads is not None:
        precision_loss(
            _first_judged(grads.sqnr_db, rule), "gradient",
            lambda module, value: (f"the parameter gradients of {module} differ from fp32 by {value:.1f} dB SQNR "
                                   f"(threshold {threshold_db:g} dB; global gradient SQNR {grads.global_sqnr_db:.1f} dB)"),
            "; for fp16 check the loss scale is high enough that small gradients keep their precision.",
            global_sqnr_db=grads.global_sqnr_db)
        underflow = underflow_finding(grads, threshold=underflow_threshold, precision=precision,
                                      loss_scale=loss_scale, step=step)
        if underflow is not None:
            findings.append(underflow)
    return findings


def fp8_precision_fix(module: str, fp8_layers: Sequence[str], order: Sequence[str], *, gradient: bool) -> str:
    """PRECISION_LOSS's fix on an fp8 model: keep the fp8 layer that loses the precision out of fp8.

    >>> fp8_precision_fix("norm", ["body.0", "head"], ["body.0", "norm", "head", ""], gradient=True)
    "'norm' holds no fp8 layer; its gradient comes back through 'head'. Keep 'head' out of fp8: \
MixedPrecision(..., fp8_filter=['head']). Out of fp8 a layer computes in bf16 under autocast."
    """
    what = "gradient comes back through" if gradient else "input comes through"
    layers = layers_to_filter(module, fp8_layers, order, gradient=gradient)
    if not layers:
        return (f"Keep the fp8 layers next to {module!r} out of fp8 (MixedPrecision(..., fp8_filter=[...])); out "
                "of fp8 a layer computes in bf16 under autocast.")
    why = "Out of fp8 a layer computes in bf16 under autocast."
    if layers == [module]:
        return fp8_filter_fix(layers, why)
    return f"{module!r} holds no fp8 layer; its {what} {layers[0]!r}. " + fp8_filter_fix(layers, why)


def flushed_shares(grads: GradComparison) -> list[tuple[str, float, int, int]]:
    """(module, share, flushed, non-zero in fp32) for every module with a flushed gradient entry, most
    flushed first: the largest share, then the most entries, then model order.

    >>> g = GradComparison(underflow={"stem": (1, 100), "blocks.3.proj": (90, 100), "head": (0, 10)})
    >>> flushed_shares(g)
    [('blocks.3.proj', 0.9, 90, 100), ('stem', 0.01, 1, 100)]
    """
    rows = [(m, lost / nz, lost, nz) for m, (lost, nz) in grads.underflow.items() if lost and nz]
    return sorted(rows, key=lambda r: (-r[1], -r[2]))


def underflow_finding(grads: GradComparison, *, threshold: float, precision: PrecisionName, loss_scale: float,
                      step: int | None) -> Finding | None:
    """GRADIENT_UNDERFLOW at the module whose gradients are flushed: the largest share of its entries
    non-zero in fp32 and exactly zero here (judged unscaled), wherever it sits in the model."""
    rule = THRESHOLDS["GRADIENT_UNDERFLOW"].at(threshold)
    shares = flushed_shares(grads)
    flagged, borderline = rule.pick(shares, lambda row: row[1])
    if not flagged:
        return None
    name, frac, lost, nonzero = flagged[0]
    fix = (f"Raise the loss scale (it was {loss_scale:g}; DynamicLossScaler grows it by itself after clean "
           "steps), or train in bf16, whose exponent range is fp32's." if loss_scale != 1.0 else
           "Use loss scaling: MixedPrecision('fp16') scales dynamically by default (with torch.amp, use "
           "torch.amp.GradScaler), or train in bf16.")
    finding = Finding(
        code="GRADIENT_UNDERFLOW", severity="warning",
        message=(f"{frac:.1%} of {display_module(name)}'s parameter-gradient elements ({lost} of {nonzero}) are "
                 f"non-zero in fp32 but flush to zero in {precision} (loss scale {loss_scale:g}), the largest share "
                 f"of any module; {len(flagged)} module(s) lose at least {rule.threshold + rule.margin:.1%}"
                 if not borderline else
                 f"{frac:.1%} of {display_module(name)}'s parameter-gradient elements ({lost} of {nonzero}) are "
                 f"non-zero in fp32 but flush to zero in {precision} (loss scale {loss_scale:g})"),
        fix=fix, module=name, step=step,
        evidence={"fraction": frac, "threshold": threshold, "loss_scale": loss_scale,
                  "modules": {m: f for m, f, _, _ in flagged[:20]},
                  "shares": {m: {"share": f, "flushed": lo, "nonzero_fp32": nz} for m, f, lo, nz in shares[:20]},
                  "judgement": rule.evidence(frac)},
    )
    return as_borderline(finding, rule, frac) if borderline else finding


def summary(out_sqnr: dict[str, float], grads: GradComparison | None) -> dict[str, Any]:
    """Compact JSON-ready summary of the comparison (for the result and the HTML page)."""
    return {
        "output_sqnr_db": out_sqnr,
        "grad_sqnr_db": grads.sqnr_db if grads else {},
        "grad_global_sqnr_db": grads.global_sqnr_db if grads else None,
        "grad_underflow": {m: grads.underflow_frac(m) for m in grads.underflow} if grads else {},
    }
