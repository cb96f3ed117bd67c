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
- ``found_inf_from_norm``: without a loss scaler, the non-finite check read off that norm
  (``checks_by_norm`` says when it is exact), instead of a second pass over the gradients.
- ``step_or_skip``: ``optimizer.step()`` unless ``found_inf`` says skip.  Optimizers with
  ``_step_supports_amp_scaling`` get ``grad_scale`` and ``found_inf`` set for their step, as
  under ``GradScaler``; those whose ``step`` is torch's own (the fused kernels) skip by
  themselves with no host sync, any other is skipped by the engine (one host sync), so an
  optimizer that ignores ``found_inf`` cannot apply a step that must be skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._util.dtensor import local_shard
from ampkit._util.grads import global_grad_norm

__all__ = [
    "as_optimizers",
    "checks_by_norm",
    "clip_or_norm",
    "found_inf_from_norm",
    "grads_to_unscale",
    "skips_by_itself",
    "step_or_skip",
]

# Dtypes whose norms overflow only where fp32 does, far above any trainable gradient norm
# (a complex norm is that of its real and imaginary parts, reduced in the part's dtype).
_FP32_RANGE = (torch.float32, torch.bfloat16, torch.float64, torch.complex64, torch.complex128)


def as_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    """``mp.step``'s argument as a list of optimizers; raise ``TypeError`` for anything else."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    opts = list(optimizers) if isinstance(optimizers, Iterable) else []
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise TypeError(f"mp.step() takes a torch.optim.Optimizer or a list of them, got {optimizers!r}")
    return opts


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
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> torch.Tensor:
    """Clip the gradients of ``params`` to ``max_norm`` (None: no clipping); return their global norm.

    ``models`` (those passed to ``prepare``), else the ``param_names`` of ``optimizers`` built from
    ``named_parameters()``, name a parameter in the error for sparse gradients with clipping.
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
        raise NotImplementedError(_sparse_clip_message(sparse[0], max_norm, models, optimizers)) from exc


def checks_by_norm(params: Iterable[torch.Tensor]) -> bool:
    """Whether the global norm of these parameters' gradients is non-finite exactly when one of them is.

    An inf or NaN gradient element makes the norm inf or NaN.  The converse needs a dtype whose
    norm cannot overflow while its elements are finite: fp32, bf16, fp64 (and complex64, complex128,
    whose norm is that of their parts) overflow only above a
    norm of about 1.8e19 (the square's fp32 limit), where clipping would multiply every gradient
    by max_norm / inf = 0 anyway; fp16 (norm above 65504) and DTensor shards (a norm that needs a
    collective) keep the separate check.
    """
    return all(p.dtype in _FP32_RANGE and not hasattr(p, "to_local") for p in params)


def found_inf_from_norm(norm: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``found_inf`` read off the global gradient norm: 1.0 when it is inf or NaN, else 0.0 (no host sync).

    Two scalar kernels; ``None`` (no gradient at all) is a fresh 0.0.

    >>> cpu = torch.device("cpu")
    >>> found_inf_from_norm(torch.tensor(float("nan")), cpu), found_inf_from_norm(None, cpu)
    (tensor(1.), tensor(0.))
    """
    if norm is None:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.isfinite(norm).logical_not().to(device=device, dtype=torch.float32)


def _sparse_clip_message(p: torch.Tensor, max_norm: float, models: Sequence[nn.Module],
                         optimizers: Sequence[torch.optim.Optimizer]) -> str:
    names = [n for m in models for n, q in m.named_parameters() if q is p]
    # torch >= 2.6 keeps the names of an optimizer built from named_parameters() in each group.
    names += [n for opt in optimizers for g in opt.param_groups
              for n, q in zip(g.get("param_names") or (), g["params"]) if q is p]
    what = f"parameter {names[0]!r}" if names else f"a parameter of shape {list(p.shape)}"
    unnamed = "" if names else (
        " (call mp.prepare(model) before training, or build the optimizer from model.named_parameters(), and this "
        "error names the parameter)"
    )
    return (
        f"MixedPrecision(clip_grad_norm={max_norm!r}) cannot clip sparse gradients, and {what} has one{unnamed}: "
        "torch.nn.utils.clip_grad_norm_ has no norm for sparse tensors (linalg_vector_norm has no sparse "
        "kernel). Build the engine with clip_grad_norm=None (the step still reports the gradient norm), or "
        "let the module produce dense gradients (e.g. nn.Embedding(..., sparse=False))"
    )


def skips_by_itself(opt: torch.optim.Optimizer) -> bool:
    """True when ``opt.step`` is torch's own and ``opt`` declares ``_step_supports_amp_scaling``.

    torch's optimizers declare it only with ``fused=True``, whose kernels read ``found_inf`` on the
    device and leave parameters and state untouched when it is 1.0.  A step written elsewhere
    (a custom optimizer, or a subclass that overrides ``step``) is not taken on trust.
    """
    step = getattr(type(opt), "step", None)
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) and str(
        getattr(step, "__module__", "")).startswith("torch.optim.")


def step_or_skip(opt: torch.optim.Optimizer, found_inf: torch.Tensor, *, checked: bool) -> None:
    """Call ``opt.step()`` unless ``found_inf > 0``; ``checked``: the gradients were checked at all.

    For an optimizer with ``_step_supports_amp_scaling`` the step sees ``opt.found_inf`` and
    ``opt.grad_scale``, deleted again afterwards, as ``GradScaler.step`` sets them.  The engine
    has already unscaled the gradients, so ``grad_scale`` is the scale the caller set on the
    optimizer, else None: ``GradScaler`` passes the product of its scale and the caller's, and the
    engine's factor is 1 once it has unscaled.
    """
    if checked and not skips_by_itself(opt) and found_inf.item():
        # The one host sync of such a step: the optimizer cannot be trusted to skip by itself.
        return
    if not getattr(opt, "_step_supports_amp_scaling", False):
        opt.step()
        return
    opt.grad_scale = getattr(opt, "grad_scale", None)  # type: ignore[attr-defined]
    opt.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        opt.step()
    finally:
        del opt.grad_scale  # type: ignore[attr-defined]
        del opt.found_inf  # type: ignore[attr-defined]
