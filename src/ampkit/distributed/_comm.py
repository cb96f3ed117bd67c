"""Small collectives over a process group: which device they run on, and moving bytes.

Descriptors, RNG states and digests travel as uint8 tensors, never as pickles
(``all_gather_object`` unpickles whatever a peer sends).  Every helper here is a host sync and
is meant for setup, checkpoints and diagnostics, never for the training step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ProcessGroup", "all_gather_bytes", "collective_device", "describe_ranks", "require_process_group"]

ProcessGroup = Any  # torch.distributed.ProcessGroup; None means the default group


def require_process_group(what: str) -> None:
    """Raise a ``RuntimeError`` that says how to start one when no process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialized torch.distributed process group. Launch with torchrun and "
            "call torch.distributed.init_process_group('nccl' if torch.cuda.is_available() else 'gloo') "
            "first (see docs/distributed.md)"
        )


def collective_device(group: ProcessGroup = None) -> torch.device:
    """The device whose tensors ``group``'s backend moves: CUDA for nccl, else CPU.

    A mixed backend such as ``"cpu:gloo,cuda:nccl"`` moves CPU tensors through gloo.
    """
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(data: bytes, group: ProcessGroup = None) -> list[bytes]:
    """Gather ``data`` from every rank of ``group``; entry ``i`` is group rank ``i``'s bytes.

    Two collectives: the lengths first, then the payload padded to the longest one, so ranks
    that send different lengths still join the same collectives (no hang on a mismatch).
    """
    device = collective_device(group)
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t.item()) for t in lengths]
    buf = torch.zeros(max(1, *sizes), dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [b[:n].cpu().numpy().tobytes() for b, n in zip(bufs, sizes)]


def describe_ranks(values: list[Any]) -> str:
    """``"'bf16' on rank 0; 'fp16' on ranks 1, 3"``: each distinct value with the ranks holding it.

    >>> describe_ranks(["bf16", "fp16", "bf16"])
    "'bf16' on ranks 0, 2; 'fp16' on rank 1"
    """
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), []).append(rank)
    parts = []
    for value, ranks in groups.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{value} on {label} {', '.join(map(str, ranks))}")
    return "; ".join(parts)
