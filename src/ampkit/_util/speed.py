"""Measured matrix-multiply throughput per dtype: the evidence behind SLOW_LOW_PRECISION and `ampkit env`."""

from __future__ import annotations

import time

import torch

__all__ = ["matmul_samples", "matmul_tflops", "synchronize"]


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
    for a, b in mats.values():  # warm-up: first calls pick kernels and allocate
        torch.mm(a, b)
    synchronize(dev)
    samples: dict[torch.dtype, list[float]] = {dt: [] for dt in dtypes}
    for _ in range(rounds):
        for dt, (a, b) in mats.items():
            iters, elapsed = 0, 0.0
            start = time.perf_counter()
            while elapsed < min_time_s:
                torch.mm(a, b)
                iters += 1
                synchronize(dev)  # a no-op on CPU; on accelerators it bounds the timed region
                elapsed = time.perf_counter() - start
            samples[dt].append(2.0 * n**3 * iters / elapsed / 1e12)
    return samples
