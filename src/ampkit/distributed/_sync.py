"""Gradient accumulation without communication, for DDP and FSDP2 alike.

``mp.no_sync(model)`` covers DDP (``model.no_sync()``).  FSDP2 modules have no ``no_sync``;
they take ``set_requires_gradient_sync(False)`` instead, which ``no_sync(mp, model)`` sets for
the micro-batches inside an accumulation window and clears for the last one.

The trade-off under FSDP2: without sync, each rank keeps the *unsharded* gradients until the
boundary (upcast to the fp32 ``reduce_dtype`` for accumulation, so no precision is lost): the
full model's gradients in fp32 on every rank, for one reduce-scatter per optimizer step
instead of one per micro-batch.  When memory is what FSDP2 is used for, keep syncing (do not
use this) -- that is what ``mp.no_sync`` does for FSDP2 models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ampkit.engine import Engine

__all__ = ["no_sync"]


@contextlib.contextmanager
def no_sync(engine: Engine, model: nn.Module) -> Iterator[None]:
    """Skip gradient communication for this micro-batch unless the next ``engine.step`` is a boundary.

    Wrap the forward and ``mp.backward`` of each micro-batch::

        with ampkit.distributed.no_sync(mp, model):
            with mp.autocast():
                loss = ...
            mp.backward(loss)
        mp.step(opt)
    """
    if engine.sync_gradients:
        yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is None:  # DDP, or a module that does not communicate
        with engine.no_sync(model):
            yield
        return
    set_sync(False)
    try:
        yield
    finally:
        set_sync(True)
