"""Section ``nosync``: fp16 steps with fused AdamW make no host sync, under torch's own sync detector.

Inside ``torch.cuda.set_sync_debug_mode("error")`` every synchronising CUDA call raises (``.item()``,
a blocking copy, ``nonzero``...).  Three setups run 20 optimizer steps each there (accumulation 2,
clipping at 1.0, the engine's full hot path), after 2 warm-up steps outside it (first-step
allocations and library start-up):

* ``bare``: ``MixedPrecision("fp16")`` alone;
* ``telemetry``: with ``Telemetry`` between flushes (its flush, the one sync, comes after the region);
* ``doctor``: with ``doctor=True``, whose capture queues its verdict into pinned memory and polls an event.

The loss scale starts at 2^10 so that no step skips: a skipped step is replayed by the doctor, and a
replay is a diagnosis that syncs by design, off the hot path.  Pass: no sync error, and every step
reached the optimizer.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.nn import functional as F

import ampkit
from gpucheck.checks import Check, check, skipped
from gpucheck.models import mlp, mlp_batches

__all__ = ["SETUPS", "run"]

SETUPS = ("bare", "telemetry", "doctor")
STEPS, WARMUP, ACCUMULATION = 20, 2, 2


@contextlib.contextmanager
def cuda_sync_errors() -> Any:
    """Every synchronising CUDA call raises inside; the previous mode is restored after."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _engine(setup: str, device: torch.device, records: list[dict[str, Any]]) -> tuple[ampkit.MixedPrecision, Any]:
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**10)
    telemetry = ampkit.Telemetry(sinks=[records.append], flush_every=64) if setup == "telemetry" else None
    mp = ampkit.MixedPrecision("fp16", device=device, scaler=scaler, grad_accumulation=ACCUMULATION,
                               clip_grad_norm=1.0, telemetry=telemetry, doctor=setup == "doctor")
    return mp, telemetry


def one_setup(setup: str, device: torch.device, tiny: bool,
              guard: Callable[[], AbstractContextManager[Any]]) -> Check:
    records: list[dict[str, Any]] = []
    mp, telemetry = _engine(setup, device, records)
    model = mlp(tiny).to(device)
    mp.prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batches = mlp_batches(tiny, (WARMUP + STEPS) * ACCUMULATION, device)

    def micro(x: torch.Tensor, y: torch.Tensor) -> Any:
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        return mp.step(opt)

    results = [micro(x, y) for x, y in batches[:WARMUP * ACCUMULATION]]
    error = None
    try:
        with guard():
            results += [micro(x, y) for x, y in batches[WARMUP * ACCUMULATION:]]
    except RuntimeError as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "ampkit" in f.filename]
        where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}{where}"
    boundaries = [r for r in results if r.boundary]
    skipped = sum(bool(r.skipped) for r in boundaries)  # host reads, after the guarded region
    if telemetry is not None:
        telemetry.flush()
    problem = error
    if problem is None and (len(boundaries) != WARMUP + STEPS or skipped):
        problem = f"{len(boundaries)} optimizer steps, {skipped} skipped; expected {WARMUP + STEPS}, none skipped"
    if problem is None and telemetry is not None and len(records) != WARMUP + STEPS:
        problem = f"telemetry wrote {len(records)} records after the flush; expected {WARMUP + STEPS}"
    return check("nosync.steps", setup, problem is None, problem or f"{STEPS} steps, no sync",
                 steps=STEPS, accumulation=ACCUMULATION)


def run(device: torch.device, *, tiny: bool,
        guard: Callable[[], AbstractContextManager[Any]] | None = None) -> Iterator[Check]:
    """``guard``: the region's detector (default: CUDA's sync-debug mode, which needs a CUDA device)."""
    if guard is None:
        if device.type != "cuda":
            for setup in SETUPS:
                yield skipped("nosync.steps", setup, "needs CUDA (torch.cuda.set_sync_debug_mode)")
            return
        guard = cuda_sync_errors
    for setup in SETUPS:
        yield one_setup(setup, device, tiny, guard)
