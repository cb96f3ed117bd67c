"""Distributed training with ``torch.distributed``: DDP and FSDP2 under torchrun.

The engine works unchanged under DDP; ``setup`` adds what sharding needs and what every
multi-rank run should have::

    dist.init_process_group(os.environ.get("AMPKIT_DIST_BACKEND", "gloo"))
    model = ampkit.distributed.shard(model, "bf16")        # FSDP2; or DDP(model)
    mp = ampkit.MixedPrecision("bf16")
    mp.prepare(model)
    ctx = ampkit.distributed.setup(mp)                      # config check + found_inf all-reduce
    ...same loop as on one process...
    ampkit.distributed.save_distributed_checkpoint("ckpt/step-100", model=model, optimizer=opt, engine=mp)

* ``setup(engine)``: checks the engine is configured identically on every rank and makes
  every rank take the same skip decision (async all-reduce(MAX) of ``found_inf``).
* ``shard(model, precision)``: FSDP2 ``fully_shard`` with a ``MixedPrecisionPolicy`` derived from
  the precision (param dtype = the precision's, reduce dtype = fp32).
* ``save/load_ddp_checkpoint`` (one file, rank 0 writes) and ``save/load_distributed_checkpoint``
  (``torch.distributed.checkpoint``), both with the engine, scaler and per-rank RNG states.
* ``no_sync(mp, model)``: accumulation without communication for DDP and FSDP2.
* ``first_nonfinite_rank`` / ``nonfinite_ranks``: which rank a NaN started on (a sync).
* ``launch_torchrun`` and ``scaling_efficiency``: run a module on N local ranks and score it.

See docs/distributed.md for torchrun commands and what has been tested where.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ampkit._util.lazy import lazy_attributes

if TYPE_CHECKING:
    from ampkit.distributed._checkpoint import (
        load_ddp_checkpoint,
        load_distributed_checkpoint,
        save_ddp_checkpoint,
        save_distributed_checkpoint,
    )
    from ampkit.distributed._launch import (
        BACKEND_ENV,
        RankResult,
        TorchrunResult,
        default_backend,
        launch_torchrun,
        scaling_efficiency,
    )
    from ampkit.distributed._setup import (
        DistributedContext,
        DistributedSetupError,
        engine_descriptor,
        first_nonfinite_rank,
        nonfinite_ranks,
        setup,
    )
    from ampkit.distributed._shard import mixed_precision_policy, shard
    from ampkit.distributed._sync import no_sync

# Public name -> private module.  Loaded on first use: DCP and FSDP take about a second to
# import, which `ampkit verify --nproc` and the launch helpers do not need.
_LAZY = {
    "BACKEND_ENV": "_launch",
    "DistributedContext": "_setup",
    "DistributedSetupError": "_setup",
    "RankResult": "_launch",
    "TorchrunResult": "_launch",
    "default_backend": "_launch",
    "engine_descriptor": "_setup",
    "first_nonfinite_rank": "_setup",
    "launch_torchrun": "_launch",
    "load_ddp_checkpoint": "_checkpoint",
    "load_distributed_checkpoint": "_checkpoint",
    "mixed_precision_policy": "_shard",
    "no_sync": "_sync",
    "nonfinite_ranks": "_setup",
    "save_ddp_checkpoint": "_checkpoint",
    "save_distributed_checkpoint": "_checkpoint",
    "scaling_efficiency": "_launch",
    "setup": "_setup",
    "shard": "_shard",
}

__all__ = [
    "BACKEND_ENV",
    "DistributedContext",
    "DistributedSetupError",
    "RankResult",
    "TorchrunResult",
    "default_backend",
    "engine_descriptor",
    "first_nonfinite_rank",
    "launch_torchrun",
    "load_ddp_checkpoint",
    "load_distributed_checkpoint",
    "mixed_precision_policy",
    "no_sync",
    "nonfinite_ranks",
    "save_ddp_checkpoint",
    "save_distributed_checkpoint",
    "scaling_efficiency",
    "setup",
    "shard",
]


__getattr__, __dir__ = lazy_attributes(__name__, {name: f"ampkit.distributed.{module}" for name, module in _LAZY.items()})
