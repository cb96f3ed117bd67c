"""The engine's work on each optimizer at an accumulation boundary: gather, clip, step or skip.

``Engine.step`` calls these in its fixed order (unscale, clip, step or skip); each does what
``torch.amp.GradScaler`` and ``clip_grad_norm_`` do in the official recipe, and differs only
where the recipe fails or goes wrong:

- ``grads_to_unscale``: the gradients of an optimizer's parameters.  An fp16 sparse gradient is
  coalesced onto the parameter first (``p.grad = p.grad.coalesce()``), as ``GradScaler`` does:
  duplicate indices can overflow fp16 only once summed, so the check must see the sums, and the
  unscaled tensor must be the one the optimizer reads.
- ``clip_or_norm``: the recipe's ``clip_grad_norm_`` call, or the norm alone without clipping
  (sparse gradients included); clipping sparse gradients is refused, as torch cannot.
- ``step_or_skip``: ``optimizer.step()`` unless ``found_inf`` says skip.  Optimizers with
  ``_step_supports_amp_scaling`` get ``grad_scale`` and ``found_inf`` set for their step and
  skip by themselves with no host sync; any other is skipped by the engine (one host sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ampkit._util.dtensor import local_shard
from ampkit._util.grads import global_grad_norm

__all__ = ["clip_or_norm", "grads_to_unscale", "step_or_skip"]


def grads_to_unscale(opt: torch.optim.Optimizer, *, local: bool) -> list[torch.Tensor]:
    """The gradients of ``opt``'s parameters for ``LossScaler.unscale_`` (fp16 sparse ones coalesced in place).

    ``local``: a hook makes ``found_inf`` global, so only this rank's shards are checked; a
    sharded (DTensor) gradient would otherwise run one blocking all-reduce per dtype group.
    """
    grads: list[torch.Tensor] = []
    with torch.no_grad():  # to_local() then returns the shard itself, no autograd node
        for group in opt.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse and g.dtype is torch.float16:
                    # A sort and a copy of the values, for fp16 sparse gradients only; a no-op
                    # when already coalesced.
                    p.grad = g = g.coalesce()
                grads.append(local_shard(g) if local else g)
    return grads


def clip_or_norm(
    params: Sequence[torch.Tensor], max_norm: float | None, models: Sequence[nn.Module] = (),
) -> torch.Tensor:
    """Clip the gradients of ``params`` to ``max_norm`` (None: no clipping); return their global norm.

    ``models`` name a parameter in the error for sparse gradients with clipping.
    """
    if max_norm is None:
        return global_grad_norm([p.grad for p in params if p.grad is not None])
    try:
        # Same call as the recipe, so the clipped gradients match bit for bit.
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=None)
    except NotImplementedError as exc:
        sparse = [p for p in params if p.grad is not None and p.grad.is_sparse]
        if not sparse:
            raise
        # The norm fails before any gradient is multiplied: nothing was clipped.
        raise NotImplementedError(_sparse_clip_message(sparse[0], max_norm, models)) from exc


def _sparse_clip_message(p: torch.Tensor, max_norm: float, models: Sequence[nn.Module]) -> str:
    names = [n for m in models for n, q in m.named_parameters() if q is p]
    what = f"parameter {names[0]!r}" if names else f"a parameter of shape {list(p.shape)}"
    return (
        f"MixedPrecision(clip_grad_norm={max_norm!r}) cannot clip sparse gradients, and {what} has one: "
        "torch.nn.utils.clip_grad_norm_ has no norm for sparse tensors (linalg_vector_norm has no sparse "
        "kernel). Build the engine with clip_grad_norm=None (the step still reports the gradient norm), or "
        "let the module produce dense gradients (e.g. nn.Embedding(..., sparse=False))"
    )


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
