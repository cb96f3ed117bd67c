"""The engine's work on each optimizer at an accumulation boundary: gather, clip, step or skip.

``Engine.step`` calls these in its fixed order (unscale, clip, step or skip); each does what
``torch.amp.GradScaler`` and ``clip_grad_norm_`` do in the official recipe:

- ``grads_to_unscale``: the gradients of an optimizer's parameters.
- ``clip_or_norm``: the recipe's ``clip_grad_norm_`` call, or the norm alone without clipping.
- ``step_or_skip``: ``optimizer.step()`` unless ``found_inf`` says skip.  Optimizers with
  ``_step_supports_amp_scaling`` get ``grad_scale`` and ``found_inf`` set for their step and
  skip by themselves with no host sync; any other is skipped by the engine (one host sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ampkit._util.dtensor import local_shard
from ampkit._util.grads import global_grad_norm

__all__ = ["clip_or_norm", "grads_to_unscale", "step_or_skip"]


def grads_to_unscale(opt: torch.optim.Optimizer, *, local: bool) -> list[torch.Tensor]:
    """The gradients of ``opt``'s parameters for ``LossScaler.unscale_``.

    ``local``: a hook makes ``found_inf`` global, so only this rank's shards are checked; a
    sharded (DTensor) gradient would otherwise run one blocking all-reduce per dtype group.
    """
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    if local:
        with torch.no_grad():  # to_local() then returns the shard itself, no autograd node
            grads = [local_shard(g) for g in grads]
    return grads


def clip_or_norm(params: Sequence[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Clip the gradients of ``params`` to ``max_norm`` (None: no clipping); return their global norm."""
    if max_norm is None:
        return global_grad_norm([p.grad for p in params if p.grad is not None])
    # Same call as the recipe, so the clipped gradients match bit for bit.
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=None)


def step_or_skip(opt: torch.optim.Optimizer, found_inf: torch.Tensor, *, checked: bool) -> None:
    """Call ``opt.step()`` unless ``found_inf > 0``; ``checked``: the gradients were checked at all."""
    if getattr(opt, "_step_supports_amp_scaling", False):
        # Fused kernels read found_inf on the device and skip the update themselves: no sync.
        # grad_scale=None: the gradients were already unscaled.
        opt.grad_scale = None  # type: ignore[attr-defined]
        opt.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            opt.step()
        finally:
            del opt.grad_scale  # type: ignore[attr-defined]
            del opt.found_inf  # type: ignore[attr-defined]
        return
    if not checked:
        opt.step()
        return
    # The one host sync of a non-fused step: the optimizer cannot skip by itself.
    if not found_inf.item():
        opt.step()
