"""What a verify worker does differently when ``ampkit verify --nproc N`` runs it under torchrun.

The worker is the same program on every rank (``ampkit.verify.worker``); this module holds the
distributed parts: joining the process group torchrun describes (gloo on CPU, nccl on CUDA,
from ``AMPKIT_DIST_BACKEND``), giving each rank its slice of the global batch, and the few
collectives the protocol needs *outside* the timed loop (the divergence decision at evaluation
points, and the step losses averaged over ranks at the end).

Strong scaling: the task's batch is the global batch, split evenly over the ranks, so a step
on N ranks does the work of a step on one process and the loss curves are comparable.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankInfo", "any_rank", "average_step_losses", "close", "init", "mean_over_ranks", "shard_batch"]

PG_TIMEOUT = datetime.timedelta(minutes=30)
"""A collective that waits longer than this fails instead of hanging (an evaluation is the longest wait)."""


class RankInfo:
    """This process's place in the launch: ``rank``, ``world_size`` and its device."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device


def init(device: torch.device) -> RankInfo:
    """Join torchrun's process group; on CUDA each rank takes the GPU of its local rank."""
    from ampkit.distributed import BACKEND_ENV

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    backend = os.environ.get(BACKEND_ENV) or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=PG_TIMEOUT,
                                device_id=device if backend == "nccl" else None)
    return RankInfo(dist.get_rank(), dist.get_world_size(), device)


def shard_batch(batch: Any, info: RankInfo, samples: int) -> Any:
    """This rank's contiguous slice of every tensor whose first dimension is the global batch.

    Tensors with another leading size (a shared mask, a scalar) are given whole to every rank.

    >>> info = RankInfo(1, 2, torch.device("cpu"))
    >>> x, y = shard_batch((torch.arange(8).view(4, 2), torch.arange(4)), info, 4)
    >>> x.tolist(), y.tolist()
    ([[4, 5], [6, 7]], [2, 3])
    """
    if info.world_size == 1:
        return batch
    if isinstance(batch, torch.Tensor):
        if batch.dim() and batch.shape[0] == samples:
            per = samples // info.world_size
            return batch[info.rank * per:(info.rank + 1) * per]
        return batch
    if isinstance(batch, dict):
        return {k: shard_batch(v, info, samples) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        parts = [shard_batch(v, info, samples) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    return batch


def any_rank(flag: bool, info: RankInfo) -> bool:
    """True on every rank when ``flag`` is True on one (a collective: all ranks must call it)."""
    if info.world_size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())  # a host sync, at evaluation points only


def average_step_losses(records: list[dict[str, Any]], info: RankInfo) -> None:
    """Make each record's ``loss`` the mean over ranks and ``loss_nonfinite`` true when any rank's was.

    Each rank's loss is the mean over its slice; with equal slices the mean of the rank losses is
    the loss of the global batch, which is what a one-process run records.  One collective for
    the whole run, at the end.  ``skipped``, ``scale`` and ``grad_norm`` are already the same on
    every rank (DDP averages the gradients; ``ampkit.distributed.setup`` shares the skip).
    """
    if info.world_size == 1 or not records:
        return
    bad = torch.tensor([float(r["loss_nonfinite"]) for r in records], dtype=torch.float64, device=info.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    for r, mean, nonfinite in zip(records, mean_over_ranks([r["loss"] for r in records], info), bad.tolist()):
        r["loss"], r["loss_nonfinite"] = mean, nonfinite > 0


def mean_over_ranks(values: list[float], info: RankInfo) -> list[float]:
    """Each value averaged over the ranks (one collective); the values themselves on one rank."""
    if info.world_size == 1 or not values:
        return list(values)
    total = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total / info.world_size).tolist()


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
