"""This rank's shard of a (possibly) sharded tensor, without communication.

A DTensor (FSDP2 parameters and gradients) answers most operations with collectives, which
in the hot path would be a host sync per call.  ``local_shard`` hands back the rank's own
tensor instead (``DTensor.to_local()``, which shares storage, so in-place updates reach the
DTensor); any other tensor is returned as it is.

>>> import torch
>>> t = torch.ones(2)
>>> local_shard(t) is t
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["local_shard"]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.to_local()`` for a DTensor (no autograd node: run under ``torch.no_grad()``), else ``tensor``."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()  # type: ignore[no-any-return]
