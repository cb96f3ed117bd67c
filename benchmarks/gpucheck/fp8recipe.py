"""torchao's float8 training recipe written out by hand, and the fp8 engine on the same batches.

One copy, used three ways: the GPU check's ``fp8`` section compares the two bit for bit on the
device, ``tests/test_engine_fp8.py`` does the same on the CPU, and ``benchmarks/bench_fp8.py``
times the recipe's step against the engine's.  The recipe is torchao's own: the model converted
by ``convert_to_float8_training`` with the recipe's ``Float8LinearConfig`` (``emulate=False``:
torch's ``_scaled_mm``, the CPU's or an fp8 GPU's), the optimizer built after converting, the
forward and loss under bf16 autocast, backward, ``clip_grad_norm_``, the optimizer step.
``autocast=False`` runs the forward without autocast, in both the recipe and the engine: on a CPU
torchao's ``rowwise_with_gw_hp`` recipe runs only so (docs/fp8.md, "Recipes").

torchao is imported inside the functions, so that importing this module (the section's
availability check, a test collecting) never needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import ampkit
from gpucheck.checks import first_difference

__all__ = ["RECIPES", "fp8_sized", "loss_of", "recipe_step", "torchao_config", "train_engine", "train_recipe", "training_difference"]

RECIPES = {"fp8": "tensorwise", "fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise",
           "fp8-rowwise-gw-hp": "rowwise_with_gw_hp"}
"""ampkit's precision name -> torchao's recipe name (``Float8LinearConfig.from_recipe_name``)."""

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension: (batch, classes) or (batch, time, vocab) logits."""
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())


def recipe_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, clip: float | None,
                *, accumulation: int = 1, boundary: bool = True, autocast: bool = True) -> None:
    """One micro-batch of the recipe; ``boundary``: the last of ``accumulation``, which clips and steps."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of(model(x), y) / accumulation
    loss.backward()
    if boundary:
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)


def fp8_sized(module: nn.Module, fqn: str) -> bool:
    """A ``module_filter_fn`` for torchao: Linear layers whose in and out features are multiples of 16.

    CUDA's fp8 GEMM needs them (torchtitan's filter checks the same); the engine converts only those.
    """
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def torchao_config(precision: str) -> Any:
    """torchao's ``Float8LinearConfig`` of ``precision``'s recipe."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(RECIPES[precision])


def train_recipe(model: nn.Module, precision: str, batches: Batches, *, accumulation: int = 1,
                 clip: float | None = None, lr: float = 1e-2,
                 module_filter_fn: Callable[[nn.Module, str], bool] | None = None, autocast: bool = True,
                 ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Convert ``model`` with torchao and train it on ``batches``; returns the converted model and its optimizer."""
    from torchao.float8 import convert_to_float8_training

    model = convert_to_float8_training(model, config=torchao_config(precision), module_filter_fn=module_filter_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    for i, (x, y) in enumerate(batches):
        recipe_step(model, opt, x, y, clip, accumulation=accumulation, boundary=(i + 1) % accumulation == 0,
                    autocast=autocast)
    return model, opt


def train_engine(model: nn.Module, precision: str, batches: Batches, *, lr: float = 1e-2, autocast: bool = True,
                 **engine: Any) -> tuple[nn.Module, torch.optim.Optimizer, ampkit.MixedPrecision]:
    """``MixedPrecision(precision, **engine)`` on the device of ``batches`` trains ``model`` on them
    (``autocast=False``: the forward outside ``mp.autocast()``)."""
    mp = ampkit.MixedPrecision(precision, device=batches[0][0].device, **engine)
    model = mp.prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    for x, y in batches:
        with mp.autocast() if autocast else contextlib.nullcontext():
            loss = loss_of(model(x), y)
        mp.backward(loss)
        mp.step(opt)
    return model, opt, mp


def training_difference(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer],
                        ) -> str | None:
    """Where two trainings first differ (parameters, then optimizer state), or None when bitwise equal."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    return (first_difference(dict(model_a.named_parameters()), dict(model_b.named_parameters()), "param")
            or first_difference(opt_a.state_dict(), opt_b.state_dict(), "optimizer"))
