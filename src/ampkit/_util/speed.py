"""Measured matrix-multiply throughput per dtype: the evidence behind SLOW_LOW_PRECISION and `ampkit env`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch

__all__ = ["fp8_gemm_samples", "matmul_samples", "matmul_tflops", "synchronize", "timed_rounds"]


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU): the edge of every timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_tflops(
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
    device: str | torch.device = "cpu",
    *,
    n: int = 512,
    rounds: int = 5,
    min_time_s: float = 0.02,
) -> dict[torch.dtype, float]:
    """Median TFLOP/s of an ``n×n @ n×n`` matmul per dtype, measured interleaved.

    Each round times every dtype once, back to back, so a frequency change or a noisy
    neighbour hits all dtypes alike; the median over ``rounds`` is reported.

    >>> r = matmul_tflops((torch.float32,), n=64, rounds=1, min_time_s=0.001)
    >>> r[torch.float32] > 0
    True
    """
    samples = matmul_samples(dtypes, device, n=n, rounds=rounds, min_time_s=min_time_s)
    return {dt: sorted(v)[len(v) // 2] for dt, v in samples.items()}


def matmul_samples(
    dtypes: tuple[torch.dtype, ...], device: str | torch.device = "cpu", *, n: int = 512, rounds: int = 5,
    min_time_s: float = 0.02,
) -> dict[torch.dtype, list[float]]:
    """TFLOP/s of every round per dtype (``matmul_tflops`` takes their median); each sample runs for at
    least ``min_time_s``."""
    dev = torch.device(device)
    mats = {dt: (torch.randn(n, n, device=dev).to(dt), torch.randn(n, n, device=dev).to(dt)) for dt in dtypes}
    kernels = {dt: (lambda a=a, b=b: torch.mm(a, b)) for dt, (a, b) in mats.items()}
    return timed_rounds(kernels, dev, flop=2.0 * n**3, rounds=rounds, min_time_s=min_time_s)


def fp8_gemm_samples(device: str | torch.device = "cpu", *, n: int = 512, rounds: int = 3,
                     min_time_s: float = 0.02) -> dict[str, list[float]]:
    """TFLOP/s of every round of a bf16 ``torch.mm`` and of the e4m3 ``torch._scaled_mm`` fp8 layers run
    (tensorwise scales, bf16 output), interleaved, keys ``bf16`` and ``fp8``."""
    dev = torch.device(device)
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()  # _scaled_mm: b column-major
    one = torch.ones((), device=dev)
    a16, b16 = a.bfloat16(), b.bfloat16()
    kernels = {"bf16": lambda: torch.mm(a16, b16),
               "fp8": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)}
    return timed_rounds(kernels, dev, flop=2.0 * n**3, rounds=rounds, min_time_s=min_time_s)


K = TypeVar("K")


def timed_rounds(kernels: Mapping[K, Callable[[], object]], device: torch.device, *, flop: float, rounds: int,
                 min_time_s: float) -> dict[K, list[float]]:
    """TFLOP/s of each kernel per round, the kernels timed back to back in every round (a frequency change
    or a noisy neighbour hits them alike); each sample runs for at least ``min_time_s``, after one warm-up call."""
    for fn in kernels.values():  # warm-up: first calls pick kernels and allocate
        fn()
    synchronize(device)
    samples: dict[K, list[float]] = {k: [] for k in kernels}
    for _ in range(rounds):
        for key, fn in kernels.items():
            iters, elapsed = 0, 0.0
            start = time.perf_counter()
            while elapsed < min_time_s:
                fn()
                iters += 1
                synchronize(device)  # a no-op on CPU; on accelerators it bounds the timed region
                elapsed = time.perf_counter() - start
            samples[key].append(flop * iters / elapsed / 1e12)
    return samples
