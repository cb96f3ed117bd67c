"""torchao's float8 recipes as ampkit reads them from a layer's ``Float8LinearConfig``, and the input
cast that lets ``rowwise_with_gw_hp`` train under CPU autocast.

* ``named_recipe(f8, config)``: torchao's recipe whose casts ``config`` has, None for a config of
  its own (``prepare`` refuses layers converted with another recipe than the engine's);
* ``fp8_recipe_of(config)``: the nearest of ampkit's recipes, from the casts alone (the doctor's
  precision for a model it did not convert);
* ``autocast_input``: the forward pre-hook ``Fp8Converter.convert`` gives a layer whose recipe feeds
  the input to a GEMM uncast (``hook_autocast_input``).

Why ``rowwise_with_gw_hp`` needs ``autocast_input`` (torchao 0.18, pytorch/ao #4616): its
weight-gradient GEMM multiplies ``grad_output`` by the input in high precision, without fp8.
``Float8Linear.forward`` duplicates autocast's cast of the input for ``F.linear``, but asks
``torch.is_autocast_enabled()`` and ``torch.get_autocast_gpu_dtype()``, which answer for CUDA (the
mistake lint's AMP110 reports).  Under CPU autocast the input therefore stays fp32 and is saved
fp32 for the backward, while the forward GEMM comes out bf16 (autocast relabels torchao's fp8
operands as bf16 for the matmul), so ``grad_output`` is bf16: the weight-gradient GEMM gets a
bf16 and an fp32 operand and raises "expected m1 and m2 to have the same dtype, but got:
c10::BFloat16 != float".  tensorwise and rowwise cast both operands of every GEMM to fp8, so
their dtypes never meet.  ``autocast_input`` makes the cast torchao makes on CUDA, on every device:
the layer then computes what it computes under CUDA autocast (the input rounded to bf16 before its
fp8 cast, the weight gradient a bf16 GEMM), and without autocast it does nothing.

torchao is never imported here: the config is read through its attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampkit.precision import Fp8RecipeName

__all__ = ["autocast_input", "fp8_recipe_of", "hook_autocast_input", "named_recipe"]

_CASTS = ("cast_config_input", "cast_config_input_for_grad_weight", "cast_config_weight",
          "cast_config_weight_for_grad_input", "cast_config_grad_output", "cast_config_grad_output_for_grad_weight")
_GRAD_WEIGHT_CASTS = ("cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight")
_INPUT_CASTS = ("cast_config_input", "cast_config_input_for_grad_weight")


def named_recipe(f8: Any, config: Any) -> str | None:
    """The name of torchao's recipe whose casts ``config`` has (``f8``: ``torchao.float8``), or None for a
    config of its own.  Only the casts are compared: ``emulate`` and the FSDP all-gather follow the device
    and the sharding, not the recipe."""
    for recipe in f8.Float8LinearRecipeName:
        named = f8.Float8LinearConfig.from_recipe_name(recipe)
        if all(getattr(config, c) == getattr(named, c) for c in _CASTS):
            return str(recipe.value)
    return None


def _uncast(config: Any, casts: Sequence[str]) -> bool:
    """Whether one of ``casts`` is torchao's ``ScalingType.DISABLED``: that GEMM takes the operand in high precision."""
    return any(getattr(config, c).scaling_type.value == "disabled" for c in casts)


def fp8_recipe_of(config: Any) -> Fp8RecipeName:
    """The recipe of ampkit's fp8 precisions that ``config`` (a ``Float8LinearConfig``) is, or is nearest to.

    ``rowwise_with_gw_hp`` when the weight-gradient GEMM takes an operand in high precision, else
    ``rowwise`` when the input is scaled per row (torchao's ``axiswise``), else ``tensorwise``.
    """
    if _uncast(config, _GRAD_WEIGHT_CASTS):
        return "rowwise_with_gw_hp"
    return "rowwise" if config.cast_config_input.scaling_granularity.value == "axiswise" else "tensorwise"


def autocast_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Forward pre-hook of a ``Float8Linear``: its input cast to the autocast dtype of the input's device
    while that autocast is on (the module docstring says why); None (the input unchanged) otherwise.

    Cost: a Python call per forward; where the input arrives in fp32, one cast kernel (a read of the
    fp32 input and a write of its bf16 copy), and the input saved for the backward then takes half the
    memory.  On CUDA torchao's own cast then finds the input cast already: the same numbers as without
    the hook.
    """
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    device = x.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        return None
    dtype = torch.get_autocast_dtype(device)
    return None if x.dtype == dtype else (x.to(dtype), *args[1:])


def hook_autocast_input(layer: nn.Module) -> None:
    """Give the ``Float8Linear`` ``layer`` the ``autocast_input`` pre-hook, once, when a GEMM of its recipe
    takes the input uncast (``rowwise_with_gw_hp``).

    Other recipes cast the input to fp8 for both its GEMMs and keep torchao's own behaviour on every
    device (on a CPU: the fp32 input cast straight to fp8), which the engine matches bit for bit.
    The hook is a plain function: a deep copy or a pickle of the model keeps it.
    """
    if not _uncast(layer.config, _INPUT_CASTS):
        return
    if not any(hook is autocast_input for hook in layer._forward_pre_hooks.values()):
        layer.register_forward_pre_hook(autocast_input)
