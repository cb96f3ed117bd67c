"""SLOW_LOW_PRECISION: low precision that is slower than fp32 on this device, measured (and
SLOW_FP8_GEMM: an fp8 GEMM slower than bf16, ``fp8_gemm_speed``).

``ampkit._util.speed.matmul_samples`` times a square matmul per dtype, interleaved (each round
times every dtype back to back), median of the rounds.  A CPU without fp16 units emulates
fp16 matmuls and runs them tens of times slower than fp32; the finding names the measured
ratio and the fastest format of the device.  The matmul is 512×512: a second's work at most.

The verdict must not flip with a noisy neighbour, so the measurement is made robust five ways:

* on a CPU, one intra-op thread timed by its own CPU clock (``thread_clock``): time spent waiting
  for a core is not counted, so every core busy with other processes leaves the ratio within a few
  per cent (on the wall clock with two threads, a loaded 2-core machine now and then measured bf16
  with bf16 units at 0.3-0.7x fp32, 2 times in about 45; its truth is 2-4x);
* every sample runs for at least ``MIN_CPU_SAMPLE_S`` on a CPU thread's clock, ``MIN_SAMPLE_S`` on the
  wall clock (one emulated matmul already takes longer);
* ``rounds`` interleaved rounds, and the median of each dtype's samples;
* hysteresis: a ratio inside the borderline band of ``ampkit.thresholds`` (0.9 ± 12 %) after those
  rounds earns ``EXTRA_ROUNDS`` more, and the verdict is taken on the median of all of them.  A
  ratio that stays inside the band is a borderline info row, never a warning;
* a verdict that contradicts the capability probe (a CPU whose bf16 units the kernels may use,
  measured slow at bf16) needs a *settled* measurement: rounds are added, up to ``SETTLE_BUDGET_S``,
  until the last ``SETTLE_ROUNDS`` rounds' ratios lie within the band's width of each other
  (``settled``).  A measurement that does not settle gives no warning: an info row says that the
  measurement was disturbed, with the load in its evidence (``disturbed_finding``).

A first round whose ratio lies ``DECISIVE`` times beyond the band's far edge decides alone (``decided``),
unless it contradicts the probe: the common cases are far out (bf16 units: about 2-4x fp32; fp16 or
bf16 emulated: 0.03-0.05x), and one round is a tenth of a second of the doctor's end-of-run analysis.

Every finding records how it was measured and under what load (``evidence["measurement"]``): the clock,
the per-round ratios and their spread, whether they settled, the measuring thread's CPU time over its
wall time (1.0: it had a core to itself), and the load average.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

from ampkit._util.dtypes import dtype_name
from ampkit._util.speed import fp8_gemm_samples, load_average, matmul_samples, uses_thread_clock
from ampkit.findings import Finding
from ampkit.precision import Precision, cpu_has_fast_bf16, cpu_has_fast_fp16
from ampkit.thresholds import THRESHOLDS, Outcome, Threshold, as_borderline

__all__ = ["DECISIVE", "EXTRA_ROUNDS", "MIN_CPU_SAMPLE_S", "MIN_SAMPLE_S", "SETTLE_BUDGET_S", "SETTLE_ROUNDS",
           "SLOW_RATIO", "Measured", "decided", "disturbed_finding", "fp8_gemm_speed", "low_precision_speed",
           "robust_samples", "settled", "speed_outcome"]

SLOW_RATIO = THRESHOLDS["SLOW_LOW_PRECISION"].threshold
"""Report when the precision's matmul throughput is below this fraction of fp32's (beyond the band)."""
MIN_SAMPLE_S = 0.05
"""Shortest sample timed on the wall clock (an accelerator): shorter ones are decided by timer and scheduler
noise."""
MIN_CPU_SAMPLE_S = 0.02
"""Shortest sample timed on one CPU thread's own clock: no scheduler noise enters it, and at 20 ms (five fp32
512×512 matmuls on one thread) 8 rounds agree within 10-17 % with every core busy, against 23-55 % at 10 ms."""
EXTRA_ROUNDS = 4
"""Rounds added when the ratio after ``rounds`` rounds falls inside the borderline band."""
DECISIVE = 1.5
"""How far beyond the band (as a factor) a first round's ratio must lie to decide alone."""
SETTLE_ROUNDS = 3
"""How many of the latest rounds must agree (within the band's width) for a measurement to be settled."""
SETTLE_BUDGET_S = 3.0
"""Wall-clock seconds a measurement that contradicts the capability probe may take to settle: a round of fp32 and
bf16 (with bf16 units) on one CPU thread is 0.04 s of its CPU time, so about 25 rounds on a machine at three times
its cores' load, where a settled measurement needs 3."""

K = TypeVar("K")


@dataclasses.dataclass
class Measured:
    """The samples a speed verdict is taken on, and how they were taken (``robust_samples``)."""

    samples: dict[Any, list[float]]
    """TFLOP/s per kernel, one entry per round kept for the verdict."""
    round_ratios: list[float]
    """The ratio of every round timed, in order (those left out of ``samples`` included)."""
    settled: bool
    """Whether the last ``SETTLE_ROUNDS`` rounds agree within the band's width (``settled``)."""
    thread_clock: bool
    """Timed by the measuring thread's CPU clock on one intra-op thread (a CPU), else by the wall clock."""
    wall_s: float
    """Wall-clock seconds the measurement took."""
    cpu_share: float
    """The measuring thread's CPU time over ``wall_s``: 1.0 when it had a core to itself, 0.3 when it got a
    third of one (other processes ran)."""
    load_average: float | None
    """The 1-minute load average at the end (None where the OS has none)."""

    def evidence(self) -> dict[str, Any]:
        """``evidence["measurement"]`` of a speed finding."""
        ratios = self.round_ratios[-SETTLE_ROUNDS:]
        return {"clock": "thread_cpu" if self.thread_clock else "wall", "threads": 1 if self.thread_clock else None,
                "round_ratios": self.round_ratios, "rounds_judged": len(next(iter(self.samples.values()))),
                "spread": _spread(ratios), "settled": self.settled, "wall_s": self.wall_s,
                "cpu_share": self.cpu_share, "load_average_1m": self.load_average}


def low_precision_speed(precision: str | Precision, device: str | torch.device | None = None, *, n: int = 512,
                        rounds: int = 3, slow_ratio: float = SLOW_RATIO) -> Finding | None:
    """A SLOW_LOW_PRECISION warning when ``precision`` is measurably slower than fp32 (beyond the borderline
    band), a borderline info row inside the band, an info row when the measurement contradicts the CPU's
    capability and did not settle, else None.

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
    units = _cpu_units(prec)
    on_thread = uses_thread_clock(prec.device, True)
    sample_s = MIN_CPU_SAMPLE_S if on_thread else MIN_SAMPLE_S
    measured = robust_samples(
        lambda k: matmul_samples(pair, device=prec.device, n=n, rounds=k, min_time_s=sample_s, thread_clock=True),
        lambda s: speed_outcome(s, prec.dtype, rule)[0], rule, rounds, expect_clear=units, thread_clock=on_thread)
    samples = measured.samples
    ratio, outcome = speed_outcome(samples, prec.dtype, rule)
    if outcome == "clear":
        return None
    where = f"{prec.name} matrix multiplication on {prec.device}" + (" (one thread)" if measured.thread_clock else "")
    if units and not measured.settled:
        return disturbed_finding(
            "SLOW_LOW_PRECISION", rule, ratio, measured,
            subject=f"{where} measured {ratio:.2f}× fp32's throughput",
            capability=f"this CPU has {prec.name} matrix instructions (AVX512-BF16/AMX) that the kernels may use")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    rest = tuple(dt for dt in dtypes if dt not in pair)
    samples.update(matmul_samples(rest, device=prec.device, n=n, rounds=len(samples[torch.float32]),
                                  min_time_s=sample_s, thread_clock=True))
    tflops = {dt: statistics.median(samples[dt]) for dt in dtypes}
    best = max(dtypes, key=lambda d: tflops[d])
    better = dtype_name(best)
    finding = Finding(
        code="SLOW_LOW_PRECISION", severity="warning",
        message=(f"{where} runs at {tflops[prec.dtype]:.3g} TFLOP/s, "
                 f"{1 / ratio:.1f}× slower than fp32 ({tflops[torch.float32]:.3g} TFLOP/s): this device has no fast "
                 f"{prec.name} path, so mixed precision costs time instead of saving it"
                 + (f" (measured settled, although the CPU reports {prec.name} matrix instructions)" if units else "")),
        fix=(f"Use {better!r} on this device (the fastest measured: {tflops[best]:.3g} TFLOP/s)"
             + ("" if better == "fp32" else f": MixedPrecision({better!r})")
             + f"; keep {prec.name} for hardware with {prec.name} units (run `ampkit env` to compare)."),
        evidence={"tflops": {dtype_name(d): v for d, v in tflops.items()}, "ratio_vs_fp32": ratio, "matmul_n": n,
                  "rounds": len(samples[torch.float32]), "device": str(prec.device),
                  "judgement": rule.evidence(ratio), "measurement": measured.evidence()},
    )
    return as_borderline(finding, rule, ratio) if outcome == "borderline" else finding


def _cpu_units(prec: Precision) -> bool:
    """Whether the capability probe says this CPU runs ``prec``'s matmuls in hardware (then a slow
    verdict contradicts it); False off the CPU and where the probe does not know."""
    if prec.device.type != "cpu":
        return False
    return cpu_has_fast_bf16() if prec.dtype == torch.bfloat16 else cpu_has_fast_fp16()


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

    The same robust measurement as SLOW_LOW_PRECISION (one thread's CPU clock on a CPU, interleaved
    rounds, samples of at least ``MIN_CPU_SAMPLE_S`` / ``MIN_SAMPLE_S``, ``EXTRA_ROUNDS`` more inside the band,
    settled before a GPU with fp8 GEMMs is called slow at them), against bf16: the precision fp8 training falls back to.
    Severity: a warning on a GPU with fp8 GEMMs, where fp8 is meant to be faster; info on a CPU or an
    emulating GPU, where fp8 runs to check its numerics and is expected to be slower.  None for a
    precision that is not fp8, or a fast enough fp8.
    """
    from ampkit.fp8 import FP8_GEMM_CAPABILITY

    prec = precision if isinstance(precision, Precision) else Precision.parse(precision, device or "auto")
    if not prec.is_fp8:
        return None
    rule = THRESHOLDS["SLOW_FP8_GEMM"]
    dev = prec.device
    native = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= FP8_GEMM_CAPABILITY

    def ratio_of(s: dict[str, list[float]]) -> float:
        return statistics.median(s["fp8"]) / statistics.median(s["bf16"])

    on_thread = uses_thread_clock(dev, True)
    measured = robust_samples(
        lambda k: fp8_gemm_samples(dev, n=n, rounds=k, min_time_s=MIN_CPU_SAMPLE_S if on_thread else MIN_SAMPLE_S,
                                   thread_clock=True),
        ratio_of, rule, rounds, expect_clear=native, thread_clock=on_thread)
    samples = measured.samples
    ratio = ratio_of(samples)
    outcome = rule.judge(ratio)
    if outcome == "clear":
        return None
    if native and not measured.settled:
        return disturbed_finding("SLOW_FP8_GEMM", rule, ratio, measured,
                                 subject=f"an fp8 GEMM on {dev} measured {ratio:.2f}× a bf16 matmul's throughput",
                                 capability=f"{dev} has fp8 GEMMs (compute capability 8.9 or later)")
    where = (f"{dev}, which has fp8 GEMMs" if native else
             "the CPU (torch's CPU _scaled_mm, no fp8 matrix units; one thread)" if dev.type != "cuda" else
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
                  "device": str(dev), "native_fp8_gemm": native, "judgement": rule.evidence(ratio),
                  "measurement": measured.evidence()},
    )
    return as_borderline(finding, rule, ratio) if outcome == "borderline" else finding


def disturbed_finding(code: Literal["SLOW_LOW_PRECISION", "SLOW_FP8_GEMM"], rule: Threshold, ratio: float,
                      measured: Measured, *, subject: str, capability: str) -> Finding:
    """The info row for a slow verdict that contradicts the capability probe on a measurement that did not
    settle: the measurement is reported as disturbed, with the load, and no advice to change precision."""
    ratios = ", ".join(f"{r:.2f}" for r in measured.round_ratios)
    load = "" if measured.load_average is None else f", load average {measured.load_average:.1f}"
    return Finding(
        code=code, severity="info",
        message=(f"measurement disturbed: {subject}, but {capability}, and its rounds did not settle within "
                 f"{SETTLE_BUDGET_S:g} s (round ratios {ratios}; the measuring thread got "
                 f"{measured.cpu_share:.0%} of a core{load}). Other work on the machine is the likely cause, so "
                 "this is no evidence that the precision is slow here"),
        fix="Nothing to change on this evidence. To measure again, run `ampkit env` on a quieter machine.",
        evidence={rule.metric: ratio, "judgement": rule.evidence(ratio), "disturbed": True,
                  "measurement": measured.evidence()},
    )


def decided(ratio: float, rule: Threshold) -> bool:
    """Whether ``ratio`` lies ``DECISIVE`` times beyond the far edge of ``rule``'s band (a lower-is-worse
    rule): still reported if it were that much higher, or still clear if it were that much lower.

    >>> rule = THRESHOLDS["SLOW_LOW_PRECISION"]  # band 0.79-1.01
    >>> decided(0.05, rule), decided(2.0, rule), decided(0.6, rule), decided(1.3, rule)
    (True, True, False, False)
    """
    return rule.judge(ratio * DECISIVE) == "reported" or rule.judge(ratio / DECISIVE) == "clear"


def settled(round_ratios: list[float], rule: Threshold) -> bool:
    """Whether the last ``SETTLE_ROUNDS`` per-round ratios lie within the band's width of each other (their
    range over their median at most twice the band's half-width, relative to the threshold).

    >>> rule = THRESHOLDS["SLOW_LOW_PRECISION"]  # band ±12 %: a range of 24 % of the median settles
    >>> settled([0.3, 2.1, 2.0, 2.2], rule), settled([2.1, 0.7, 2.2], rule), settled([2.0, 2.1], rule)
    (True, False, False)
    """
    last = round_ratios[-SETTLE_ROUNDS:]
    return len(last) == SETTLE_ROUNDS and _spread(last) <= 2 * rule.band / abs(rule.threshold)


def robust_samples(take: Callable[[int], dict[K, list[float]]], ratio_of: Callable[[dict[K, list[float]]], float],
                   rule: Threshold, rounds: int, *, expect_clear: bool = False, thread_clock: bool = False) -> Measured:
    """The samples a speed verdict is taken on (see the module docstring): ``take(k)`` times ``k``
    interleaved rounds; one round when it is ``decided`` (and agrees with ``expect_clear``, the capability
    probe), else ``rounds``, plus ``EXTRA_ROUNDS`` when the ratio is then inside the band.  A verdict that
    is not clear although ``expect_clear`` takes rounds until they settle (at most ``SETTLE_BUDGET_S``) and
    is then taken on the settled rounds only.  ``thread_clock`` says how ``take`` times (for the record)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    samples = take(1)

    def contradicts(s: dict[K, list[float]]) -> bool:
        return expect_clear and rule.judge(ratio_of(s)) != "clear"

    if not decided(ratio_of(samples), rule) or contradicts(samples):
        if rounds > 1:
            samples = _joined(samples, take(rounds - 1))
        if rule.judge(ratio_of(samples)) == "borderline":
            samples = _joined(samples, take(EXTRA_ROUNDS))
        while (contradicts(samples) and not settled(_round_ratios(samples, ratio_of), rule)
               and time.perf_counter() - wall < SETTLE_BUDGET_S):
            samples = _joined(samples, take(1))
    ratios = _round_ratios(samples, ratio_of)
    is_settled = settled(ratios, rule)
    if contradicts(samples) and is_settled:  # judged on the rounds that agree, not on the disturbed ones before
        samples = {k: v[-SETTLE_ROUNDS:] for k, v in samples.items()}
    elapsed = time.perf_counter() - wall
    return Measured(samples=samples, round_ratios=ratios, settled=is_settled, thread_clock=thread_clock,
                    wall_s=elapsed, cpu_share=(time.thread_time() - cpu) / elapsed if elapsed > 0 else 1.0,
                    load_average=load_average())


def _round_ratios(samples: dict[K, list[float]], ratio_of: Callable[[dict[K, list[float]]], float]) -> list[float]:
    rounds = len(next(iter(samples.values())))
    return [ratio_of({k: [v[i]] for k, v in samples.items()}) for i in range(rounds)]


def _spread(ratios: list[float]) -> float:
    """The range of ``ratios`` over their median (0.0 for fewer than two)."""
    if len(ratios) < 2:
        return 0.0
    return (max(ratios) - min(ratios)) / statistics.median(ratios)


def _joined(a: dict[K, list[float]], b: dict[K, list[float]]) -> dict[K, list[float]]:
    return {k: a[k] + b[k] for k in a}
