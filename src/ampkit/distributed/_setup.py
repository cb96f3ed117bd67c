"""Join an engine to a process group: one skip decision for all ranks, checked configuration.

``setup(engine)`` does three things:

1. **Checks** that every rank built the same engine (precision, accumulation, scaler kind and
   state, clipping, keep-fp32 rules, step counters).  Each rank all-gathers a small JSON
   descriptor and compares; on a mismatch *every* rank raises ``DistributedSetupError`` with
   the per-rank values, instead of hanging or silently mixing dtypes in the first collective.
2. **Reduces ``found_inf``** with an all-reduce(MAX) over the group, so a non-finite gradient
   on any rank, or in any rank's shard, skips the step on all of them and every scaler takes
   the same update.  The all-reduce is launched asynchronously right after the unscale and
   waited for only right before the step decision, overlapping the gradient-norm computation.
   Every rank joins it once per optimizer with a ``found_inf`` that starts at 0, so a rank
   whose shard of some parameter is empty (FSDP2 with more ranks than rows) still works.
3. **Remembers each rank's local verdict** (non-finite loss in this window, non-finite local
   gradients before the reduction) so that ``ctx.first_nonfinite_rank()`` can name the rank a
   NaN started on.  That costs a few scalar kernels per micro-batch and no host sync.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from ampkit._util.version import __version__
from ampkit.distributed._comm import ProcessGroup, all_gather_bytes, describe_ranks, require_process_group
from ampkit.engine import Engine
from ampkit.hooks import EngineHook, HookedEngine

__all__ = [
    "DistributedContext",
    "DistributedSetupError",
    "check_consistent",
    "engine_descriptor",
    "first_nonfinite_rank",
    "nonfinite_ranks",
    "setup",
]

# Keys whose mismatch is reported as a warning: mixed builds usually still agree numerically.
_ADVISORY = ("ampkit", "torch")


class DistributedSetupError(RuntimeError):
    """Ranks disagree on something that must be identical; raised on every rank at once."""


def engine_descriptor(engine: Engine) -> dict[str, Any]:
    """What must be identical on every rank for the ranks to take identical steps.

    The engine's configuration (``EngineConfig.describe()``), its scaler and step counters, and
    the versions.  Reads the live loss scale from the device (a host sync; setup only).
    """
    return {
        **engine.config.describe(),
        "scaler": type(engine.scaler).__name__,
        "scaler_state": engine.scaler.state_dict(),
        "micro_step": engine.micro_step,
        "optimizer_steps": engine.optimizer_steps,
        "ampkit": __version__,
        "torch": torch.__version__,
    }


def check_consistent(local: dict[str, Any], group: ProcessGroup = None, *, caller: str, fix: str) -> None:
    """All-gather ``local`` and raise ``DistributedSetupError`` on every rank if any key differs.

    Keys in ``("ampkit", "torch")`` only warn.  Values must be JSON-serialisable (others are
    compared by ``repr``).  Two small collectives; a host sync.
    """
    payload = json.dumps(local, sort_keys=True, default=repr).encode()
    gathered = [json.loads(b) for b in all_gather_bytes(payload, group)]
    keys = sorted(set().union(*(g.keys() for g in gathered)))
    wrong: list[str] = []
    advisory: list[str] = []
    for key in keys:
        values = [g.get(key) for g in gathered]
        if any(v != values[0] for v in values[1:]):
            line = f"  {key}: {describe_ranks(values)}"
            (advisory if key in _ADVISORY else wrong).append(line)
    if advisory:
        warnings.warn(
            f"{caller}: ranks run different versions (numerics may differ slightly):\n" + "\n".join(advisory),
            UserWarning,
            stacklevel=3,
        )
    if wrong:
        raise DistributedSetupError(
            f"{caller}: the {len(gathered)} ranks disagree, so their steps would differ or their first "
            "collective would hang; every rank raises this error:\n" + "\n".join(wrong) + f"\nFix: {fix}"
        )


class DistributedContext(EngineHook):
    """The process-group side of one engine; ``setup`` attaches it with ``engine.add_hook``.

    It keeps this rank's local verdicts of the last boundary, read by ``nonfinite_ranks()`` /
    ``first_nonfinite_rank()``; it is the first of ``engine.hooks``, and telemetry and the
    doctor find it there (``isinstance(h, DistributedContext)``).  This class only tracks;
    ``setup(reduce_found_inf=True)`` attaches the subclass that also reduces ``found_inf``.
    """

    reduces_found_inf = False
    """Whether this context makes ``found_inf`` global (all-reduce MAX)."""

    def __init__(self, group: ProcessGroup = None) -> None:
        self.engine: HookedEngine | None = None
        self.group = group
        self.rank = dist.get_rank(group)
        """This process's rank within ``group``."""
        self.world_size = dist.get_world_size(group)
        self._local_found: list[torch.Tensor] = []
        self._window_loss: torch.Tensor | None = None
        self.loss_nonfinite: torch.Tensor | None = None
        """bool device scalar, last boundary: a loss this rank passed to ``backward`` was non-finite."""
        self.grads_nonfinite: torch.Tensor | None = None
        """bool device scalar, last boundary: this rank's gradient shards were non-finite before the
        found_inf reduction (after DDP's or FSDP's own gradient communication)."""

    @override
    def on_attach(self, engine: HookedEngine) -> None:
        self.engine = engine

    # -- hooks ----------------------------------------------------------------------------------
    @override
    def on_backward(self, engine: HookedEngine, loss: torch.Tensor) -> None:
        # Three scalar kernels per micro-batch, no sync.  The loss is this rank's own: it names
        # the origin of a NaN before any gradient communication spreads it to every rank.
        bad = torch.isfinite(loss.detach()).logical_not().any()
        self._window_loss = bad if self._window_loss is None else self._window_loss | bad

    @override
    def before_optimizer_step(
        self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer], found_inf: torch.Tensor,
        grad_norm: torch.Tensor | None,
    ) -> None:
        local = self._local_found
        self.grads_nonfinite = torch.stack(local).gt(0).any() if local else None
        self.loss_nonfinite = self._window_loss
        self._local_found, self._window_loss = [], None

    # -- diagnostics (host syncs, off the hot path) ------------------------------------------------
    def nonfinite_ranks(self) -> list[int]:
        """The ranks where the last boundary's non-finite values started (a collective; every rank calls it).

        Ranks whose loss was non-finite, if any: the gradient communication of DDP/FSDP spreads
        their NaN to every rank's gradients, so those are the origin.  Otherwise (an overflow in
        backward) the ranks whose gradient shards were non-finite before the found_inf reduction.
        """
        loss_bad = bool(self.loss_nonfinite.item()) if self.loss_nonfinite is not None else False
        grads_bad = bool(self.grads_nonfinite.item()) if self.grads_nonfinite is not None else False
        code = bytes([2 * loss_bad + grads_bad])
        codes = [b[0] if b else 0 for b in all_gather_bytes(code, self.group)]
        by_loss = [rank for rank, c in enumerate(codes) if c & 2]
        return by_loss or [rank for rank, c in enumerate(codes) if c & 1]

    def first_nonfinite_rank(self) -> int | None:
        """The lowest rank in ``nonfinite_ranks()``, or None when the last boundary was finite."""
        ranks = self.nonfinite_ranks()
        return ranks[0] if ranks else None

    def __repr__(self) -> str:
        return (f"DistributedContext(rank={self.rank}, world_size={self.world_size}, "
                f"reduces_found_inf={self.reduces_found_inf})")


class _ReducingContext(DistributedContext):
    """A ``DistributedContext`` that also makes ``found_inf`` global with an all-reduce(MAX).

    ``reduce_found_inf`` starts the all-reduce of one optimizer's ``found_inf`` asynchronously;
    ``wait_found_inf`` (called by the engine after clipping) completes every pending one.
    """

    reduces_found_inf = True

    def __init__(self, group: ProcessGroup = None) -> None:
        super().__init__(group)
        self._pending: list[Any] = []

    @override
    def reduce_found_inf(self, engine: HookedEngine, found_inf: torch.Tensor) -> torch.Tensor:
        # One scalar copy: the local verdict survives the in-place reduction for diagnostics.
        self._local_found.append(found_inf.detach().clone())
        work = dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending.append(work)
        return found_inf

    @override
    def wait_found_inf(self, engine: HookedEngine) -> None:
        """Complete the pending all-reduces (NCCL: orders the stream, no host block; gloo: blocks)."""
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait()


def nonfinite_ranks(found_inf: torch.Tensor | bool | float, group: ProcessGroup = None) -> list[int]:
    """All-gather each rank's *local* non-finite flag; return the ranks where it was set.

    Every rank of ``group`` must call it.  It is a host sync plus two small collectives: use it
    after a skipped step (the doctor, telemetry alarms), never on every step.  Pass a flag from
    before any cross-rank reduction (a reduced ``found_inf`` is set on every rank);
    ``DistributedContext.nonfinite_ranks()`` picks the right one for you.
    """
    require_process_group("ampkit.distributed.nonfinite_ranks")
    if isinstance(found_inf, torch.Tensor):
        local = bool(found_inf.detach().float().gt(0).any().item())
    else:
        local = bool(found_inf)
    gathered = all_gather_bytes(b"\x01" if local else b"\x00", group)
    return [rank for rank, b in enumerate(gathered) if b == b"\x01"]


def first_nonfinite_rank(found_inf: torch.Tensor | bool | float, group: ProcessGroup = None) -> int | None:
    """The lowest rank whose local flag is set, or None when every rank is finite (collective).

    See ``nonfinite_ranks`` for which flag to pass and what it costs.
    """
    ranks = nonfinite_ranks(found_inf, group)
    return ranks[0] if ranks else None


def setup(
    engine: Engine,
    process_group: ProcessGroup = None,
    *,
    reduce_found_inf: bool = True,
    check: bool = True,
) -> DistributedContext:
    """Make ``engine`` take the same step on every rank of ``process_group``; returns the context.

    Call it on every rank after building the engine (and after ``shard``/DDP wrapping), before
    the first step.  ``check`` compares ``engine_descriptor`` across ranks (a collective; raises
    ``DistributedSetupError`` on every rank on a mismatch).  ``reduce_found_inf`` installs the
    all-reduce(MAX) of ``found_inf``: required under FSDP2, where each rank checks only its
    shards (without it a sharded gradient is checked by DTensor with one blocking all-reduce per
    dtype group); under DDP the gradient all-reduce already spreads a NaN to every rank, and the
    extra scalar all-reduce also covers parameters DDP does not reduce.  With
    ``reduce_found_inf=False`` the context only tracks the local verdicts.  Calling ``setup``
    again replaces the previous context.
    """
    require_process_group("ampkit.distributed.setup")
    if not isinstance(engine, Engine):
        raise TypeError(f"ampkit.distributed.setup(engine=...) needs an ampkit.MixedPrecision, got {type(engine).__name__}")
    if check:
        check_consistent(
            engine_descriptor(engine),
            process_group,
            caller="ampkit.distributed.setup",
            fix="build MixedPrecision(...) with the same arguments on every rank and load the same checkpoint "
            "everywhere; a value that differs usually comes from a rank-local environment variable, config "
            "file or default (e.g. precision='auto' on ranks with different devices)",
        )
    for old in [h for h in engine.hooks if isinstance(h, DistributedContext)]:
        engine.remove_hook(old)
    ctx = _ReducingContext(process_group) if reduce_found_inf else DistributedContext(process_group)
    engine.add_hook(ctx, first=True)
    return ctx
