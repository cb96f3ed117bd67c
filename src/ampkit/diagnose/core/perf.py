"""SLOW_LOW_PRECISION: low precision that is slower than fp32 on this device, measured.

``ampkit._util.speed.matmul_tflops`` times a square matmul per dtype, interleaved (each round
times every dtype back to back), median of the rounds.  A CPU without fp16 units emulates
fp16 matmuls and runs them tens of times slower than fp32; the finding names the measured
ratio and the fastest format of the device.  The matmul is 512×512: small enough to take about
a second, large enough that thread start-up and contention from other processes do not
decide the ratio (at 128–256 they can invert it on a busy machine).
"""

from __future__ import annotations

import torch

from ampkit._util.dtypes import dtype_name
from ampkit._util.speed import matmul_tflops
from ampkit.findings import Finding
from ampkit.precision import Precision

__all__ = ["SLOW_RATIO", "low_precision_speed"]

SLOW_RATIO = 0.9
"""Report when the precision's matmul throughput is below this fraction of fp32's."""


def low_precision_speed(precision: str | Precision, device: str | torch.device | None = None, *, n: int = 512,
                        rounds: int = 3, slow_ratio: float = SLOW_RATIO) -> Finding | None:
    """A SLOW_LOW_PRECISION warning when ``precision`` is measurably slower than fp32, else None.

    >>> low_precision_speed("fp32", "cpu") is None
    True
    """
    prec = precision if isinstance(precision, Precision) else Precision.parse(precision, device or "auto")
    if not prec.is_low_precision:
        return None
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    tflops = matmul_tflops(dtypes, device=prec.device, n=n, rounds=rounds, min_time_s=0.01)
    ratio = tflops[prec.dtype] / tflops[torch.float32]
    if ratio >= slow_ratio:
        return None
    best = max(dtypes, key=lambda d: tflops[d])
    measured = {dtype_name(d): round(v, 4) for d, v in tflops.items()}
    better = dtype_name(best)
    return Finding(
        code="SLOW_LOW_PRECISION", severity="warning",
        message=(f"{prec.name} matrix multiplication on {prec.device} runs at {tflops[prec.dtype]:.3g} TFLOP/s, "
                 f"{1 / ratio:.1f}× slower than fp32 ({tflops[torch.float32]:.3g} TFLOP/s): this device has no fast "
                 f"{prec.name} path, so mixed precision costs time instead of saving it"),
        fix=(f"Use {better!r} on this device (the fastest measured: {tflops[best]:.3g} TFLOP/s)"
             + ("" if better == "fp32" else f": MixedPrecision({better!r})")
             + f"; keep {prec.name} for hardware with {prec.name} units (run `ampkit env` to compare)."),
        evidence={"tflops": measured, "ratio_vs_fp32": ratio, "matmul_n": n, "device": str(prec.device)},
    )
