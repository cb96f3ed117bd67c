"""``StepGradCounts``: when and how a step's gradient elements are counted (zeros, non-finite).

The counting kernels are ``metrics.GradCounter``'s; this module decides, per step, whether a
count runs at all.  A count is one more read of every gradient, memory-bound on a CPU and there
about as dear as the rest of the telemetry together (about 1 % of the step of a 3 M-parameter
model on a CPU with bf16 units), so:

* the zero count runs on steps 1, 1+K, ... (``zero_grads_every=K``; NaN, None in the record, on
  the others);
* on CPU, where a scalar read waits for nothing (``metrics.reads_are_free``), a step without the
  zero count and without the engine's clip only *notes* its gradients before the clip; the
  non-finite count is then read off the engine's global gradient norm, which read every gradient
  anyway: a finite norm means no element is inf or NaN.  Elsewhere, and when the engine clips
  (a clip with a NaN coefficient would leave every element NaN), the count runs before the clip.
  When no other hook can change a gradient between the note and the norm (``settled``: the
  telemetry knows the engine's hooks), not even the note is taken: such a step walks no parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ampkit._util.dtensor import local_shard
from ampkit._util.overrides import overrides
from ampkit.hooks import EngineHook
from ampkit.telemetry.metrics import GradCounter

__all__ = ["StepGradCounts", "grads_of", "params_with_grads", "settled_among"]

Counts = tuple[torch.Tensor, torch.Tensor]


def settled_among(hook: EngineHook, hooks: Sequence[EngineHook]) -> bool:
    """Whether no other of ``hooks`` can change a gradient between ``hook``'s ``after_unscale`` and its
    ``before_optimizer_step``: none after it has an ``after_unscale``, none a found_inf reduction or
    wait, none before it a ``before_optimizer_step``."""
    mine = next((i for i, h in enumerate(hooks) if h is hook), len(hooks))
    return not any(
        (i > mine and overrides(h, EngineHook, "after_unscale")) or overrides(h, EngineHook, "reduce_found_inf")
        or overrides(h, EngineHook, "wait_found_inf") or (i < mine and overrides(h, EngineHook, "before_optimizer_step"))
        for i, h in enumerate(hooks) if h is not hook)


def params_with_grads(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [p for opt in optimizers for group in opt.param_groups for p in group["params"]
            if p.grad is not None and p.grad.numel()]


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # A sharded (FSDP2 DTensor) gradient is counted through this rank's shard: operating on
    # the DTensor itself would run collectives (a sync) in the hot path.
    with torch.no_grad():
        return [local_shard(p.grad) for p in params if p.grad is not None]


def _identity(g: torch.Tensor) -> tuple[int, int]:
    """(data pointer, version counter) of a gradient's memory.  A sparse gradient has no storage of its
    own (``data_ptr`` raises): its values' memory stands for it, and an in-place change of a sparse
    tensor bumps its version (and reallocates the values)."""
    if g.layout is torch.strided:
        return g.data_ptr(), g._version
    values = g._values() if g.layout is torch.sparse_coo else g.values()
    return values.data_ptr(), g._version


class StepGradCounts:
    """Counts of one step at a time: ``before_clip`` (the engine's ``after_unscale``), then ``take``."""

    def __init__(self, device: torch.device, zero_grads_every: int) -> None:
        self.counter = GradCounter(device)
        self.zero_grads_every = zero_grads_every
        self._nan = torch.full((), float("nan"), dtype=torch.float32, device=device)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._counts: Counts | None = None
        self._noted: tuple[list[torch.Tensor], list[int]] | None = None
        """The noted gradients and their version counters; compared by ``_identity`` (data pointer, version):
        a view of the same gradient (an FSDP2 shard's ``to_local()``, fetched again) shares both, an in-place
        change bumps the version."""
        self._deferred = False
        """``before_clip`` left the count to the norm without a note (nothing could change the gradients)."""

    def zero_step(self, step: int) -> bool:
        every = self.zero_grads_every
        return bool(every) and (step - 1) % every == 0

    def defers(self, step: int, *, engine_clips: bool) -> bool:
        """Whether ``before_clip`` leaves the step's count to the norm (CPU, no zero count, no clip by the engine)."""
        return self.counter.reads_free and not engine_clips and not self.zero_step(step)

    def before_clip(self, grads: Callable[[], list[torch.Tensor]], step: int, *, engine_clips: bool,
                    settled: bool = False) -> list[torch.Tensor] | None:
        """Count now, or (CPU, no zero count, no clip by the engine) only note the gradients; returns the
        gradients ``grads()`` fetched, None when none was needed (``settled`` and deferred: no other hook can
        change a gradient before ``take``, so there is nothing to note)."""
        if self.defers(step, engine_clips=engine_clips):
            if settled:
                self._deferred = True
                return None
            local = grads()
            self._noted = (local, [g._version for g in local])
            return local
        local = grads()
        self._counts = self.count(local, step)
        return local

    def count(self, grads: list[torch.Tensor], step: int) -> Counts:
        return self.counter.count(grads, zeros=self.zero_step(step))

    def take(self, grads: Callable[[], list[torch.Tensor]], step: int, grad_norm: torch.Tensor | None) -> Counts:
        """``(zeros, nonfinite)`` of the step: what ``before_clip`` counted, noted or deferred, else the gradients
        ``grads()`` returns (those the parameters hold now) counted now.

        The tensors returned are never written afterwards (a row may hold them as they are).
        """
        counts, self._counts = self._counts, None
        noted, self._noted = self._noted, None
        deferred, self._deferred = self._deferred, False
        if counts is not None:
            return counts
        if noted is None and not deferred:
            return self.count(grads(), step)
        # Finite norm: every element was finite, and no pass is needed (the read is no sync: CPU only).
        if grad_norm is not None and math.isfinite(grad_norm.item()):
            return self._nan, self._zero
        now = grads()
        if noted is None:  # deferred: these are the gradients as they were before the clip
            return self.counter.count(now, zeros=False)
        # A non-finite norm is rare: count now if no one changed a gradient since the note (same
        # memory, same version counters).  A hook that did (a clip by value, a clip with a NaN
        # coefficient) leaves the count not measured (NaN: None in the record).
        old, versions = noted
        unchanged = len(old) == len(now) and all(
            _identity(g) == (_identity(o)[0], v) for g, o, v in zip(now, old, versions))
        return self.counter.count(now, zeros=False) if unchanged else (self._nan, self._nan)
