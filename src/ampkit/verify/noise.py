"""The fp32 noise band, and the three-way verdict it gives a distance: pass, fail or inconclusive.

Pure Python (no torch), so the definitions can be read and tested on their own.

**The band.**  A second fp32 run, the *noise run*, starts from the same initial weights but
draws its batches with another data-order seed (``seed + NOISE_SEED_OFFSET``).  Before each of
its steps it also computes, without gradients, its loss on the batch the baseline trains on at
that step: the *shadow loss*.  So both curves are read on the same batches, and the batch-to-
batch noise of the loss cancels; what is left is how far two fp32 runs that differ only in data
order drift apart.  The band ``b`` of the loss-curve distance is the distance of the shadow-loss
curve to the baseline's (the same definition as every other run's distance); the band of a
metric is ``|noise − fp32| / |fp32|`` of its final value.  The noise run costs one fp32 run plus
one forward per step.

**The verdict** of a distance ``d`` (loss-curve distance, or a metric's relative worsening)
against its tolerance ``tol``, with the factor ``k`` (default ``NOISE_K``):

- **pass**: ``d <= tol``, and the run can resolve the tolerance: ``k·b <= tol`` and at least
  ``MIN_RESOLVED_STEPS`` steps after warm-up;
- **fail**: ``d > tol`` and ``d > k·b``: larger than the tolerance and than the noise;
- **inconclusive** otherwise: too few steps, a band too wide to tell, or no band measured.

Without the band (``--no-noise-band``) the verdict is the single-run one: pass when ``d <= tol``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["BAND_DEFINITION", "MIN_RESOLVED_STEPS", "NOISE_K", "NOISE_SEED_OFFSET", "Judgement", "judge",
           "metric_band", "noise_data_seed"]

NOISE_K = 3.0
"""A difference counts only beyond 3 bands: one noise run estimates the band from a single sample, so
the margin is wide (the usual three-sigma rule, with the band standing in for sigma)."""
MIN_RESOLVED_STEPS = 20
"""Fewest steps after warm-up for a pass: below it the curve's mean gap rests on a handful of losses."""
NOISE_SEED_OFFSET = 1_000_003
"""The noise run's data-order seed is the run's seed plus this (a prime far from any seed a user picks)."""

BAND_DEFINITION = (
    "b = the loss-curve distance between the baseline and a second fp32 run from the same weights with another "
    "data-order seed, whose loss is read on the baseline's batch of each step (so batch noise cancels); a "
    "metric's band is |noise - fp32| / |fp32| of its final value. pass: d <= tol and k*b <= tol with enough "
    "steps; fail: d > tol and d > k*b; inconclusive otherwise"
)


def noise_data_seed(seed: int) -> int:
    """The noise run's data-order seed for a run seeded ``seed``."""
    return seed + NOISE_SEED_OFFSET


@dataclass(frozen=True)
class Judgement:
    """One check's verdict and why."""

    verdict: str
    """``pass``, ``fail`` or ``inconclusive``."""
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason}


def judge(d: float, tol: float, *, band: float | None, k: float, resolved_steps: int | None,
          what: str = "distance", band_missing: str | None = None) -> Judgement:
    """The verdict of ``d`` against ``tol`` and the band; ``band_missing`` says why there is none.

    ``resolved_steps`` is the run's step count after warm-up; ``band=None`` with ``band_missing``
    None is the single-run protocol.

    >>> judge(0.01, 0.03, band=0.005, k=3, resolved_steps=100).verdict
    'pass'
    >>> judge(0.10, 0.03, band=0.005, k=3, resolved_steps=100).verdict
    'fail'
    >>> judge(0.05, 0.03, band=0.02, k=3, resolved_steps=100).verdict  # beyond tol, inside the noise
    'inconclusive'
    >>> judge(0.01, 0.03, band=0.005, k=3, resolved_steps=5).verdict   # too few steps to resolve
    'inconclusive'
    """
    within = d <= tol
    shown = f"{what} {d:.2%} {'<=' if within else '>'} tolerance {tol:.2%}"
    if band is None:
        if band_missing is None:
            return Judgement("pass" if within else "fail", shown)
        return Judgement("inconclusive", f"{shown}, but the fp32 noise band is unknown: {band_missing}")
    noise = k * band
    if not within:
        if d > noise:
            return Judgement("fail", f"{shown} and > {k:g} x noise band {noise:.2%}")
        return Judgement("inconclusive", f"{shown}, but inside {k:g} x the fp32 noise band ({noise:.2%}): "
                                         "as far as two fp32 runs differ")
    if noise > tol:
        return Judgement("inconclusive", f"{shown}, but {k:g} x the fp32 noise band is {noise:.2%} > tolerance: "
                                         "this run cannot resolve the tolerance (more steps or a larger batch "
                                         "narrow the band)")
    if resolved_steps is not None and resolved_steps < MIN_RESOLVED_STEPS:
        return Judgement("inconclusive", f"{shown}, but only {resolved_steps} steps after warm-up (a verdict "
                                         f"needs {MIN_RESOLVED_STEPS})")
    return Judgement("pass", f"{shown}, and {k:g} x noise band {noise:.2%} <= tolerance")


def metric_band(noise: float | None, base: float | None) -> float | None:
    """``|noise − base| / |base|``: the fp32 run-to-run spread of a final metric (None if unknown).

    >>> metric_band(2.1, 2.0) == abs(2.1 - 2.0) / 2.0
    True
    """
    if noise is None or base is None or not (math.isfinite(noise) and math.isfinite(base)):
        return None
    if base == 0:
        return 0.0 if noise == 0 else math.inf
    return abs(noise - base) / abs(base)
