"""Measured matrix-multiply throughput per dtype: the evidence behind SLOW_LOW_PRECISION and `ampkit env`.

Two clocks.  `ampkit env` reports what the machine delivers: wall time, every intra-op thread.  A speed
*verdict* (``thread_clock=True``) must not depend on what else the machine runs, so on a CPU it times one
intra-op thread by that thread's CPU clock (``time.thread_time``).  Wall time on a loaded machine counts
the time the measuring threads waited for a core, and with several threads every matmul waits at its
barrier for the last thread the scheduler left out: the shorter kernel (bf16 with bf16 units) pays that
wait more often, so a loaded 2-core machine measured such a bf16 below fp32 (0.3-0.7x, where the truth is
2-4x).  One thread's CPU time counts only the work; the ratio of two dtypes stays within a few per cent
with every core busy.  On an accelerator the host waits for the device, so its wall clock is the clock.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import torch

__all__ = ["fp8_gemm_samples", "load_average", "matmul_samples", "matmul_tflops", "one_thread", "synchronize",
           "timed_rounds", "uses_thread_clock"]


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
    min_time_s: float = 0.02, thread_clock: bool = False,
) -> dict[torch.dtype, list[float]]:
    """TFLOP/s of every round per dtype (``matmul_tflops`` takes their median); each sample runs for at
    least ``min_time_s``; ``thread_clock``: see ``timed_rounds``."""
    dev = torch.device(device)
    mats = {dt: (torch.randn(n, n, device=dev).to(dt), torch.randn(n, n, device=dev).to(dt)) for dt in dtypes}
    kernels = {dt: (lambda a=a, b=b: torch.mm(a, b)) for dt, (a, b) in mats.items()}
    return timed_rounds(kernels, dev, flop=2.0 * n**3, rounds=rounds, min_time_s=min_time_s,
                        thread_clock=thread_clock)


def fp8_gemm_samples(device: str | torch.device = "cpu", *, n: int = 512, rounds: int = 3,
                     min_time_s: float = 0.02, thread_clock: bool = False) -> dict[str, list[float]]:
    """TFLOP/s of every round of a bf16 ``torch.mm`` and of the e4m3 ``torch._scaled_mm`` fp8 layers run
    (tensorwise scales, bf16 output), interleaved, keys ``bf16`` and ``fp8``; ``thread_clock``: see
    ``timed_rounds``."""
    dev = torch.device(device)
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()  # _scaled_mm: b column-major
    one = torch.ones((), device=dev)
    a16, b16 = a.bfloat16(), b.bfloat16()
    kernels = {"bf16": lambda: torch.mm(a16, b16),
               "fp8": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)}
    return timed_rounds(kernels, dev, flop=2.0 * n**3, rounds=rounds, min_time_s=min_time_s,
                        thread_clock=thread_clock)


K = TypeVar("K")


def uses_thread_clock(device: torch.device, thread_clock: bool) -> bool:
    """Whether ``timed_rounds(..., thread_clock=thread_clock)`` on ``device`` times one thread's CPU clock
    (a CPU) rather than the wall clock (an accelerator, or ``thread_clock=False``)."""
    return thread_clock and device.type == "cpu"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one for the block, then restored.  The setting is the process's:
    torch work that another thread of the process runs meanwhile is single-threaded too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_average() -> float | None:
    """The 1-minute load average (runnable processes, all cores together); None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has no load average
        return None


def timed_rounds(kernels: Mapping[K, Callable[[], object]], device: torch.device, *, flop: float, rounds: int,
                 min_time_s: float, thread_clock: bool = False) -> dict[K, list[float]]:
    """TFLOP/s of each kernel per round, the kernels timed back to back in every round (a frequency change
    or a noisy neighbour hits them alike); each sample runs for at least ``min_time_s``, after one warm-up call.

    ``thread_clock`` on a CPU: the kernels run on one intra-op thread, timed by that thread's CPU clock,
    so other processes do not enter the figure (see the module docstring); elsewhere it changes nothing."""
    on_thread = uses_thread_clock(device, thread_clock)
    clock = time.thread_time if on_thread else time.perf_counter
    with one_thread() if on_thread else contextlib.nullcontext():
        for fn in kernels.values():  # warm-up: first calls pick kernels (per thread count) and allocate
            fn()
        synchronize(device)
        samples: dict[K, list[float]] = {k: [] for k in kernels}
        for _ in range(rounds):
            for key, fn in kernels.items():
                iters, elapsed = 0, 0.0
                start = clock()
                while elapsed < min_time_s:
                    fn()
                    iters += 1
                    synchronize(device)  # a no-op on CPU; on accelerators it bounds the timed region
                    elapsed = clock() - start
                samples[key].append(flop * iters / elapsed / 1e12)
    return samples
