"""FSDP2 sharding with a ``MixedPrecisionPolicy`` derived from an ampkit ``Precision``.

``shard(model, "bf16")`` applies ``torch.distributed.fsdp.fully_shard`` bottom-up: to every
block (by default the children of each ``nn.ModuleList``, the layout of transformer stacks),
to every module the engine keeps in fp32, then to the root.  Each unit gets

    MixedPrecisionPolicy(param_dtype=<bf16 | fp16 | None for fp32>, reduce_dtype=torch.float32)

so parameters are stored sharded in fp32 (the master weights the optimizer updates), all-gathered
in the low-precision dtype for compute (half the communication and the unsharded memory), and
gradients are reduce-scattered and accumulated in fp32 (no precision lost in the sum over ranks).

How it combines with ``mp.autocast()`` -- use both:

* FSDP's ``param_dtype`` decides the dtype of the all-gathered weights, and it casts the
  floating-point inputs of each unit's ``forward`` to that dtype.
* ``mp.autocast()`` decides the dtype of each *op*: matmuls run in bf16/fp16 either way, but the
  ops autocast keeps in fp32 (softmax, layer/group norm, losses, reductions) upcast their bf16
  inputs and weights and still run in fp32.  Without autocast they would run in bf16.
* Modules the engine keeps in fp32 (``keep_fp32=``) become their own FSDP unit with
  ``param_dtype=None``: their weights stay fp32 when gathered, matching the fp32 inputs the
  keep-fp32 hooks give them.  (Inside a bf16 unit they would meet bf16 weights.)
* With fp16, loss scaling still runs in the engine: gradients are unscaled after the
  reduce-scatter, on each rank's fp32 shard, and ``ampkit.distributed.setup`` all-reduces
  ``found_inf`` so that every rank skips together.
* With fp8 (``"fp8"``, ``"fp8-rowwise"``, ``"fp8-rowwise-gw-hp"``), ``shard`` converts the Linear
  layers to torchao's float8 layers *before* ``fully_shard`` (converting a sharded model fails in the
  first forward), with the engine's ``keep_fp32`` and ``fp8_filter``; ``mp.prepare(model)``
  afterwards converts nothing more.  ``fp8_all_gather=True`` (tensorwise only) all-gathers the
  converted weights in fp8 instead of bf16, and attaches a hook that calls torchao's
  ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step (one all-reduce of
  the weight scales).  It wraps the weights in new parameters, so the optimizer must be built
  after ``shard``; the hook checks that on the first step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from ampkit.distributed._comm import require_process_group
from ampkit.distributed._setup import check_consistent
from ampkit.engine import Engine
from ampkit.fp8 import Fp8Converter
from ampkit.hooks import EngineHook, HookedEngine, StepResult
from ampkit.policy import KeepFp32Rule, resolve_keep_fp32
from ampkit.precision import Precision

__all__ = ["mixed_precision_policy", "shard"]

BlockSpec = (
    Iterable[nn.Module] | type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool] | None
)


def _as_precision(precision: str | Precision | Engine, model: nn.Module | None = None) -> Precision:
    if isinstance(precision, Engine):
        return precision.precision
    if isinstance(precision, Precision):
        return precision
    param = next(model.parameters(), None) if model is not None else None
    return Precision.parse(precision, device=param.device if param is not None else "auto")


def mixed_precision_policy(precision: str | Precision | Engine, *, output_dtype: torch.dtype | None = None) -> Any:
    """The FSDP2 ``MixedPrecisionPolicy`` for ``precision``: its dtype for params, fp32 for reduction.

    >>> mixed_precision_policy(Precision.parse("bf16", device="cpu"))
    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=True)
    >>> mixed_precision_policy(Precision.parse("fp32", device="cpu")).param_dtype is None
    True
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = _as_precision(precision)
    return MixedPrecisionPolicy(
        param_dtype=None if p.name == "fp32" else p.dtype,
        reduce_dtype=torch.float32,
        output_dtype=output_dtype,
    )


def _resolve_blocks(model: nn.Module, blocks: BlockSpec) -> list[nn.Module]:
    named = list(model.named_modules())
    chosen: list[nn.Module]
    if blocks is None:
        chosen = [m for _, ml in named if isinstance(ml, nn.ModuleList) for m in ml.children()]
    elif isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)):
        types: Any = blocks
        chosen = [m for name, m in named if name and isinstance(m, types)]
    elif callable(blocks) and not isinstance(blocks, nn.Module):
        predicate: Callable[[str, nn.Module], bool] = blocks  # type: ignore[assignment]
        chosen = [m for name, m in named if name and predicate(name, m)]
    else:
        chosen = list(blocks)  # type: ignore[arg-type]
        known = {id(m) for name, m in named if name}
        stray = [type(m).__name__ for m in chosen if id(m) not in known]
        if stray:
            raise ValueError(
                f"shard(blocks=...): {stray} are not sub-modules of the model; pass modules from "
                "model.named_modules() (not the model itself), a module type, or a predicate(name, module)"
            )
    return chosen


def _structure_digest(model: nn.Module) -> str:
    listing = "\n".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def shard(
    model: nn.Module,
    precision: str | Precision | Engine,
    *,
    blocks: BlockSpec = None,
    keep_fp32: Sequence[KeepFp32Rule] | None = None,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    output_dtype: torch.dtype | None = None,
    check: bool = True,
    fp8_all_gather: bool = False,
) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` per block, per keep-fp32 module and to the root; returns ``model``.

    Args:
        model: the unsharded model, identical on every rank (same seed or loaded weights).
        precision: a precision name, a ``Precision``, or the ``MixedPrecision`` engine (whose
            ``keep_fp32`` rules are then used too).
        blocks: the modules that become FSDP units: ``None`` for the children of every
            ``nn.ModuleList``; a module type (e.g. ``Block``); a ``predicate(name, module)``; or
            the modules themselves.  Found none: only the root is sharded (one unit).
        keep_fp32: module name patterns / types whose weights stay fp32 (default: the engine's).
        mesh: a 1-D ``DeviceMesh`` (default: all ranks of the default group).
        reshard_after_forward: passed to ``fully_shard`` (None: torch's default).
        output_dtype: cast the root's floating-point outputs to this dtype (None: no cast).
        check: all-gather the precision and the parameter layout first, and raise
            ``DistributedSetupError`` on every rank if they differ (a host sync).
        fp8_all_gather: fp8 (tensorwise) only: all-gather the fp8 layers' weights in fp8; needs
            the engine as ``precision`` (its hook precomputes the weight scales after each step).

    See the module docstring for ``mp.autocast()`` and fp8; train the returned model (fp8 may build a new one).
    """
    from torch.distributed.fsdp import fully_shard

    require_process_group("ampkit.distributed.shard")
    prec = _as_precision(precision, model)
    if keep_fp32 is None:
        keep_fp32 = precision.policy.rules if isinstance(precision, Engine) else ()
    if prec.is_fp8 or fp8_all_gather:
        model = _convert_fp8(model, precision, prec, keep_fp32, fp8_all_gather)
    kept_names = resolve_keep_fp32(model, keep_fp32) if keep_fp32 else []
    units = _units(model, prec, blocks, kept_names)
    if check:
        check_consistent(
            {"precision": prec.name, "parameters": _structure_digest(model),
             "units": sorted(n for n, _, _ in units), "keep_fp32": kept_names},
            mesh.get_group() if mesh is not None else None,
            caller="ampkit.distributed.shard",
            fix="build the same model and pass the same precision on every rank (a 'parameters' mismatch "
            "means the architectures differ)",
        )
    kwargs: dict[str, Any] = {} if mesh is None else {"mesh": mesh}
    if reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = reshard_after_forward
    # Bottom-up: fully_shard takes the parameters not already owned by a sharded sub-module.
    for _name, module, unit_policy in sorted(units, key=lambda u: -u[0].count(".")):
        fully_shard(module, mp_policy=unit_policy, **kwargs)
    root_policy = mixed_precision_policy(prec, output_dtype=output_dtype)
    fully_shard(model, mp_policy=root_policy, **kwargs)
    return model


def _convert_fp8(model: nn.Module, precision: str | Precision | Engine, prec: Precision,
                 keep_fp32: Sequence[KeepFp32Rule], all_gather: bool) -> nn.Module:
    """fp8 conversion before ``fully_shard``: with the engine's converter (its filter) when given one."""
    if not prec.is_fp8:
        raise ValueError(f"shard(fp8_all_gather=True) with precision {prec.name!r}: the fp8 all-gather is for "
                         "precision='fp8'; drop fp8_all_gather")
    if all_gather and not isinstance(precision, Engine):
        raise ValueError(
            "shard(model, precision, fp8_all_gather=True) needs the engine as precision (shard(model, mp, ...)): "
            "its hook recomputes the fp8 weight scales after each optimizer step"
        )
    converter = precision.fp8 if isinstance(precision, Engine) else Fp8Converter(prec, keep_fp32=keep_fp32)
    before = {id(p) for p in model.parameters()}
    model = converter.convert(model, all_gather=all_gather)
    if all_gather and isinstance(precision, Engine):  # always an engine here (checked above)
        precision.add_hook(_Fp8AllGatherHook(model, before))
    return model


class _Fp8AllGatherHook(EngineHook):
    """torchao's fp8 all-gather bookkeeping: the weight scales after each step, the optimizer check.

    ``precompute_float8_dynamic_scale_for_fsdp`` computes every fp8 weight's scale with one
    all-reduce (of the amaxes) right after the optimizer step, so the next forward's all-gather
    casts each shard with the global scale.  It runs after skipped steps too (the weights did not
    move, the scales come out the same); reading whether the step applied would be a host sync.
    """

    def __init__(self, model: nn.Module, unsharded_ids: set[int]) -> None:
        self.model = model
        # Ids, not the tensors: holding the unsharded parameters would keep a full copy alive.
        self._stale = unsharded_ids
        self._checked: set[int] = set()

    @override
    def after_unscale(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            if id(opt) in self._checked:
                continue
            current = {id(p) for p in self.model.parameters()}
            stale = sum(id(p) in self._stale and id(p) not in current for g in opt.param_groups for p in g["params"])
            if stale:
                raise RuntimeError(
                    f"{type(opt).__name__} holds {stale} parameters the model no longer has: it was built before "
                    "ampkit.distributed.shard(model, mp, fp8_all_gather=True), which replaces them (FSDP2 shards "
                    "them, the fp8 all-gather wraps the weights), so its step would update nothing. Build the "
                    "optimizer after shard(...): opt = torch.optim.AdamW(model.parameters(), ...)"
                )
            self._checked.add(id(opt))

    @override
    def after_step(self, engine: HookedEngine, result: StepResult, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(self.model)


def _units(model: nn.Module, prec: Precision, blocks: BlockSpec, kept_names: list[str]) -> list[tuple[str, nn.Module, Any]]:
    """The FSDP units below the root: each block (low-precision policy), each kept module (fp32)."""
    modules = dict(model.named_modules())
    units: dict[int, tuple[str, nn.Module, Any]] = {}
    policy = mixed_precision_policy(prec)
    fp32_policy = mixed_precision_policy(Precision(name="fp32", device=prec.device))
    names = {id(m): n for n, m in model.named_modules()}
    for block in _resolve_blocks(model, blocks):
        if any(True for _ in block.parameters()):  # a parameter-free block has nothing to shard
            units[id(block)] = (names[id(block)], block, policy)
    for name in kept_names:
        module = modules[name]
        if name and any(True for _ in module.parameters()):
            units[id(module)] = (name, module, fp32_policy)
    return list(units.values())
