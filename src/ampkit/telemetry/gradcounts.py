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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ampkit._util.dtensor import local_shard
from ampkit.telemetry.metrics import GradCounter

__all__ = ["StepGradCounts", "grads_of", "params_with_grads"]

Counts = tuple[torch.Tensor, torch.Tensor]


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
        self._counts: Counts | None = None
        self._noted: list[tuple[int, int]] | None = None
        """(data pointer, version counter) of each noted gradient: a view of the same gradient (an FSDP2
        shard's ``to_local()``, fetched again) shares both, an in-place change bumps the version."""

    def zero_step(self, step: int) -> bool:
        every = self.zero_grads_every
        return bool(every) and (step - 1) % every == 0

    def before_clip(self, grads: list[torch.Tensor], step: int, *, engine_clips: bool) -> None:
        """Count now, or (CPU, no zero count, no clip by the engine) only note the gradients."""
        if self.counter.reads_free and not self.zero_step(step) and not engine_clips:
            self._noted = [_identity(g) for g in grads]
        else:
            self._counts = self.count(grads, step)

    def count(self, grads: list[torch.Tensor], step: int) -> Counts:
        return self.counter.count(grads, zeros=self.zero_step(step))

    def take(self, grads: list[torch.Tensor], step: int, grad_norm: torch.Tensor | None) -> Counts:
        """``(zeros, nonfinite)`` of the step: what ``before_clip`` counted or noted, else counted now."""
        counts, self._counts = self._counts, None
        noted, self._noted = self._noted, None
        if counts is not None:
            return counts
        if noted is None:
            return self.count(grads, step)
        # Finite norm: every element was finite, and no pass is needed (the read is no sync: CPU only).
        if grad_norm is not None and bool(torch.isfinite(grad_norm)):
            return self._nan, torch.zeros((), dtype=torch.float32, device=self._nan.device)
        # A non-finite norm is rare: count now if no one changed a gradient since the note (same
        # memory, same version counters).  A hook that did (a clip by value, a clip with a NaN
        # coefficient) leaves the count not measured (NaN: None in the record).
        unchanged = len(noted) == len(grads) and all(_identity(g) == n for n, g in zip(noted, grads))
        return self.counter.count(grads, zeros=False) if unchanged else (self._nan, self._nan)
