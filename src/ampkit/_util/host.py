"""Deferred device->host reads: learn a device value later instead of waiting for it now.

* ``DeferredReads``: device scalars whose values are needed later, read in one batch per
  device at ``flush()`` (one transfer instead of one sync per value); CPU values are
  delivered at once, since CPU kernels are synchronous and reading them waits for nothing.
* ``HostCopy``: a small tensor copied into (pinned) host memory behind the kernels that
  produce it, with an event that says when it has landed; ``ready()`` polls, never waits.

>>> import torch
>>> reads, got = DeferredReads(), []
>>> reads.read(torch.tensor(2.0), got.append)
>>> got
[2.0]
>>> HostCopy(torch.tensor([True, False])).tolist()
[True, False]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DeferredReads", "HostCopy"]


class HostCopy:
    """``value`` on its way to the host: a pinned copy queued with ``non_blocking=True`` and an event.

    On the CPU the tensor itself is kept (it is already computed).  ``torch.Event`` covers CUDA,
    XPU and MPS alike.
    """

    def __init__(self, value: torch.Tensor) -> None:
        self.event: Any = None
        if value.device.type == "cpu":
            self.host = value
            return
        self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.device.type == "cuda")
        self.host.copy_(value, non_blocking=True)
        self.event = torch.Event(device=value.device)
        self.event.record()

    def ready(self) -> bool:
        """Whether the copy has landed (a poll of the event; never waits)."""
        return self.event is None or bool(self.event.query())

    def tolist(self) -> Any:
        """The values; call only once ``ready()`` (else this waits for the copy: a host sync)."""
        return self.host.tolist()


class DeferredReads:
    """Device scalars whose values are needed later, read in one batch per device.

    Reading a CPU tensor costs nothing (CPU kernels are synchronous), so CPU values are
    delivered at once; values on an accelerator wait for ``flush()``, which stacks them and
    makes one host transfer per device instead of one sync per value.
    """

    def __init__(self) -> None:
        self._queue: list[tuple[torch.Tensor, Callable[[float], None]]] = []

    def read(self, value: torch.Tensor, then: Callable[[float], None], *, now: bool = False) -> None:
        """Deliver ``float(value)`` to ``then``: at once on CPU or when ``now`` (a sync), else at ``flush``."""
        if now or value.device.type == "cpu":
            then(float(value))
        else:
            self._queue.append((value.detach().reshape(()).float(), then))

    def flush(self) -> None:
        queue, self._queue = self._queue, []
        by_device: dict[torch.device, list[tuple[torch.Tensor, Callable[[float], None]]]] = {}
        for t, cb in queue:
            by_device.setdefault(t.device, []).append((t, cb))
        for items in by_device.values():
            # One device->host copy for the whole batch: the only sync this class makes.
            values = torch.stack([t for t, _ in items]).tolist()
            for (_, cb), v in zip(items, values):
                cb(float(v))

    def __len__(self) -> int:
        return len(self._queue)
