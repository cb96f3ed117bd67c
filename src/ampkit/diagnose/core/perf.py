"""SLOW_LOW_PRECISION: low precision that is slower than fp32 on this device, measured (and
SLOW_FP8_GEMM: an fp8 GEMM slower than bf16, ``fp8_gemm_speed``).

``ampkit._util.speed.matmul_tflops`` times a square matmul per dtype, interleaved (each round
times every dtype back to back), median of the rounds.  A CPU without fp16 units emulates
fp16 matmuls and runs them tens of times slower than fp32; the finding names the measured
ratio and the fastest format of the device.  The matmul is 512×512: small enough to take about
a second, large enough that thread start-up and contention from other processes do not
decide the ratio (at 128–256 they can invert it on a busy machine).

The verdict must not flip with a noisy neighbour, so the measurement is made robust three ways:

* every sample runs for at least ``MIN_SAMPLE_S`` (one emulated matmul already takes longer);
* ``rounds`` interleaved rounds, and the median of each dtype's samples;
* hysteresis: a ratio inside the borderline band of ``ampkit.thresholds`` (0.9 ± 12 %) after those
  rounds earns ``EXTRA_ROUNDS`` more, and the verdict is taken on the median of all of them.  A
  ratio that stays inside the band is a borderline info row, never a warning.

A first round whose ratio lies ``DECISIVE`` times beyond the band's far edge decides alone (``decided``):
no noise seen on a loaded machine moves a back-to-back pair of samples by half again, and the
common cases are far out (bf16 units: about 2x fp32; fp16 or bf16 emulated: 0.03-0.05x).  That
saves two of the three rounds, a fifth of a second of the doctor's end-of-run analysis.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TypeVar

import torch

from ampkit._util.dtypes import dtype_name
from ampkit._util.speed import fp8_gemm_samples, matmul_samples
from ampkit.findings import Finding
from ampkit.precision import Precision
from ampkit.thresholds import THRESHOLDS, Outcome, Threshold, as_borderline

__all__ = ["DECISIVE", "EXTRA_ROUNDS", "MIN_SAMPLE_S", "SLOW_RATIO", "decided", "fp8_gemm_speed", "low_precision_speed",
           "robust_samples", "speed_outcome"]

SLOW_RATIO = THRESHOLDS["SLOW_LOW_PRECISION"].threshold
"""Report when the precision's matmul throughput is below this fraction of fp32's (beyond the band)."""
MIN_SAMPLE_S = 0.05
"""Shortest timed sample: shorter ones are decided by timer and scheduler noise."""
EXTRA_ROUNDS = 4
"""Rounds added when the ratio after ``rounds`` rounds falls inside the borderline band."""
DECISIVE = 1.5
"""How far beyond the band (as a factor) a first round's ratio must lie to decide alone."""

K = TypeVar("K")


def low_precision_speed(precision: str | Precision, device: str | torch.device | None = None, *, n: int = 512,
                        rounds: int = 3, slow_ratio: float = SLOW_RATIO) -> Finding | None:
    """A SLOW_LOW_PRECISION warning when ``precision`` is measurably slower than fp32 (beyond the borderline
    band), a borderline info row inside the band, else None.

    >>> low_precision_speed("fp32", "cpu") is None
    True
    """
    prec = precision if isinstance(precision, Precision) else Precision.parse(precision, device or "auto")
    if not prec.is_low_precision:
        return None
    rule = THRESHOLDS["SLOW_LOW_PRECISION"].at(slow_ratio)
    # The verdict needs fp32 and this precision only; the other 16-bit dtype is timed only for a
    # finding's advice (the fastest dtype), since on a CPU without its units it is the slowest to time
    # (fp16 emulated: half a second of the doctor's end-of-run analysis).
    pair = (torch.float32, prec.dtype)
    samples = robust_samples(
        lambda k: matmul_samples(pair, device=prec.device, n=n, rounds=k, min_time_s=MIN_SAMPLE_S),
        lambda s: speed_outcome(s, prec.dtype, rule)[0], rule, rounds)
    ratio, outcome = speed_outcome(samples, prec.dtype, rule)
    if outcome == "clear":
        return None
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    rest = tuple(dt for dt in dtypes if dt not in pair)
    samples.update(matmul_samples(rest, device=prec.device, n=n, rounds=rounds, min_time_s=MIN_SAMPLE_S))
    tflops = {dt: statistics.median(samples[dt]) for dt in dtypes}
    best = max(dtypes, key=lambda d: tflops[d])
    better = dtype_name(best)
    finding = Finding(
        code="SLOW_LOW_PRECISION", severity="warning",
        message=(f"{prec.name} matrix multiplication on {prec.device} runs at {tflops[prec.dtype]:.3g} TFLOP/s, "
                 f"{1 / ratio:.1f}× slower than fp32 ({tflops[torch.float32]:.3g} TFLOP/s): this device has no fast "
                 f"{prec.name} path, so mixed precision costs time instead of saving it"),
        fix=(f"Use {better!r} on this device (the fastest measured: {tflops[best]:.3g} TFLOP/s)"
             + ("" if better == "fp32" else f": MixedPrecision({better!r})")
             + f"; keep {prec.name} for hardware with {prec.name} units (run `ampkit env` to compare)."),
        evidence={"tflops": {dtype_name(d): v for d, v in tflops.items()}, "ratio_vs_fp32": ratio, "matmul_n": n,
                  "rounds": len(samples[torch.float32]), "device": str(prec.device),
                  "judgement": rule.evidence(ratio)},
    )
    return as_borderline(finding, rule, ratio) if outcome == "borderline" else finding


def speed_outcome(samples: dict[torch.dtype, list[float]], dtype: torch.dtype, rule: Threshold) -> tuple[float, Outcome]:
    """(median throughput of ``dtype`` over fp32's, the rule's outcome) from per-round samples.

    >>> rule = THRESHOLDS["SLOW_LOW_PRECISION"]
    >>> speed_outcome({torch.float32: [1.0, 1.1, 0.9], torch.float16: [0.05, 0.04, 0.06]}, torch.float16, rule)
    (0.05, 'reported')
    >>> speed_outcome({torch.float32: [1.0], torch.bfloat16: [0.95]}, torch.bfloat16, rule)[1]
    'borderline'
    """
    ratio = statistics.median(samples[dtype]) / statistics.median(samples[torch.float32])
    return ratio, rule.judge(ratio)


def fp8_gemm_speed(precision: str | Precision, device: str | torch.device | None = None, *, n: int = 512,
                   rounds: int = 3) -> Finding | None:
    """SLOW_FP8_GEMM when the fp8 GEMM (``torch._scaled_mm``, e4m3) is measurably slower than a bf16 matmul here.

    The same robust measurement as SLOW_LOW_PRECISION (interleaved rounds, samples of at least
    ``MIN_SAMPLE_S``, ``EXTRA_ROUNDS`` more inside the band), against bf16: the precision fp8 training
    falls back to.  Severity: a warning on a GPU with fp8 GEMMs, where fp8 is meant to be faster; info
    on a CPU or an emulating GPU, where fp8 runs to check its numerics and is expected to be slower.
    None for a precision that is not fp8, or a fast enough fp8.
    """
    from ampkit.fp8 import FP8_GEMM_CAPABILITY

    prec = precision if isinstance(precision, Precision) else Precision.parse(precision, device or "auto")
    if not prec.is_fp8:
        return None
    rule = THRESHOLDS["SLOW_FP8_GEMM"]

    def ratio_of(s: dict[str, list[float]]) -> float:
        return statistics.median(s["fp8"]) / statistics.median(s["bf16"])

    samples = robust_samples(lambda k: fp8_gemm_samples(prec.device, n=n, rounds=k, min_time_s=MIN_SAMPLE_S),
                             ratio_of, rule, rounds)
    ratio = ratio_of(samples)
    outcome = rule.judge(ratio)
    if outcome == "clear":
        return None
    dev = prec.device
    native = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= FP8_GEMM_CAPABILITY
    where = (f"{dev}, which has fp8 GEMMs" if native else
             "the CPU (torch's CPU _scaled_mm, no fp8 matrix units)" if dev.type != "cuda" else
             f"{dev}, below compute capability 8.9 (torchao emulates fp8)")
    tflops = {k: statistics.median(v) for k, v in samples.items()}
    finding = Finding(
        code="SLOW_FP8_GEMM", severity="warning" if native else "info",
        message=(f"an fp8 GEMM ({n}x{n}, e4m3 with tensorwise scales) on {where} runs at {tflops['fp8']:.3g} "
                 f"TFLOP/s, {1 / ratio:.1f}x slower than bf16 ({tflops['bf16']:.3g} TFLOP/s)"
                 + ("" if native else ": expected here, where fp8 runs to check its numerics, not for speed")),
        fix=("Compile the model (torch.compile fuses torchao's casts into the GEMMs, and fp8's speed comes with "
             "it), keep GEMMs too small to gain out of fp8 (fp8_filter='auto'), or train in 'bf16'." if native else
             "Nothing to change to check fp8's numerics here; train in 'bf16' on this device, and in fp8 on a GPU "
             "of compute capability 8.9 or later (Ada, Hopper, Blackwell)."),
        evidence={"tflops": tflops, "ratio_vs_bf16": ratio, "matmul_n": n, "rounds": len(samples["fp8"]),
                  "device": str(dev), "native_fp8_gemm": native, "judgement": rule.evidence(ratio)},
    )
    return as_borderline(finding, rule, ratio) if outcome == "borderline" else finding


def decided(ratio: float, rule: Threshold) -> bool:
    """Whether ``ratio`` lies ``DECISIVE`` times beyond the far edge of ``rule``'s band (a lower-is-worse
    rule): still reported if it were that much higher, or still clear if it were that much lower.

    >>> rule = THRESHOLDS["SLOW_LOW_PRECISION"]  # band 0.79-1.01
    >>> decided(0.05, rule), decided(2.0, rule), decided(0.6, rule), decided(1.3, rule)
    (True, True, False, False)
    """
    return rule.judge(ratio * DECISIVE) == "reported" or rule.judge(ratio / DECISIVE) == "clear"


def robust_samples(take: Callable[[int], dict[K, list[float]]], ratio_of: Callable[[dict[K, list[float]]], float],
                   rule: Threshold, rounds: int) -> dict[K, list[float]]:
    """The samples a speed verdict is taken on (see the module docstring): ``take(k)`` times ``k``
    interleaved rounds; one round when it is ``decided``, else ``rounds``, plus ``EXTRA_ROUNDS`` when
    the ratio is then inside the band."""
    samples = take(1)
    if decided(ratio_of(samples), rule):
        return samples
    if rounds > 1:
        samples = _joined(samples, take(rounds - 1))
    if rule.judge(ratio_of(samples)) == "borderline":
        samples = _joined(samples, take(EXTRA_ROUNDS))
    return samples


def _joined(a: dict[K, list[float]], b: dict[K, list[float]]) -> dict[K, list[float]]:
    return {k: a[k] + b[k] for k in a}
