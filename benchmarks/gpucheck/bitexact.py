"""Section ``bitexact``: the engine against the hand-written torch.amp recipe, bit for bit, on the device.

Two copies of one model train on the same batches, one with the official recipe written out
(autocast, ``GradScaler.scale(loss).backward()``, accumulate, ``unscale_``, clip, ``step``,
``update``), one with ``ampkit.MixedPrecision``.  Pass: every parameter, every optimizer state
tensor and the final loss scale are bitwise equal.  Skips are forced by an inf in the input of
chosen steps (the loss and every gradient turn non-finite), so they happen at the same steps at any
model size; bf16 has no loss scaling, hence no skip variant.  On CUDA the section runs with
``torch.use_deterministic_algorithms(True)`` so that only the step logic can differ.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.nn import functional as F

import ampkit
from gpucheck.checks import Check, check, first_difference
from gpucheck.models import mlp, mlp_batches

__all__ = ["CONFIGS", "Config", "run"]


@dataclass(frozen=True)
class Config:
    name: str
    precision: str
    accumulation: int = 1
    clip: float | None = None
    fused: bool = False
    skip_at: tuple[int, ...] = ()
    """Optimizer steps (0-based) whose first micro-batch gets an inf input."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16 if self.precision == "fp16" else torch.bfloat16


CONFIGS = tuple(
    cfg
    for p in ("fp16", "bf16")
    for cfg in (
        Config(f"{p}-plain", p),
        Config(f"{p}-clip", p, clip=0.5),
        Config(f"{p}-accumulate-4", p, accumulation=4),
        *([Config(f"{p}-forced-skips", p, skip_at=(1, 3))] if p == "fp16" else []),
        Config(f"{p}-fused-adamw", p, fused=True, clip=1.0, skip_at=(2,) if p == "fp16" else ()),
    )
)


def _micro_batches(cfg: Config, steps: int, device: torch.device, tiny: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = mlp_batches(tiny, steps * cfg.accumulation, device)
    for step in cfg.skip_at:
        x, y = batches[step * cfg.accumulation]
        x = x.clone()
        x[0, 0] = math.inf
        batches[step * cfg.accumulation] = (x, y)
    return batches


def _recipe(cfg: Config, model, opt, batches, device: torch.device) -> float:
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    for i, (x, y) in enumerate(batches):
        with torch.autocast(device.type, dtype=cfg.dtype):
            loss = F.cross_entropy(model(x), y) / cfg.accumulation
        scaler.scale(loss).backward()
        if (i + 1) % cfg.accumulation == 0:
            scaler.unscale_(opt)
            if cfg.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return scaler.get_scale() if scaler.is_enabled() else 1.0


def _engine(cfg: Config, model, opt, batches, device: torch.device) -> tuple[float, int]:
    mp = ampkit.MixedPrecision(cfg.precision, device=device, grad_accumulation=cfg.accumulation,
                               clip_grad_norm=cfg.clip)
    mp.prepare(model)
    results = []
    for x, y in batches:
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        results.append(mp.step(opt))
    skipped = sum(bool(r.skipped) for r in results if r.boundary)  # host reads after the run
    return float(mp.scale), skipped


def compare(cfg: Config, device: torch.device, tiny: bool, steps: int) -> Check:
    base = mlp(tiny).to(device)
    batches = _micro_batches(cfg, steps, device, tiny)
    m_recipe, m_engine = copy.deepcopy(base), copy.deepcopy(base)

    def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cfg.fused)

    opt_r, opt_e = optimizer(m_recipe), optimizer(m_engine)
    scale_r = _recipe(cfg, m_recipe, opt_r, batches, device)
    scale_e, skipped = _engine(cfg, m_engine, opt_e, batches, device)
    problem = (first_difference(dict(m_recipe.named_parameters()), dict(m_engine.named_parameters()), "param")
               or first_difference(opt_r.state_dict(), opt_e.state_dict(), "optimizer")
               or first_difference(scale_r, scale_e, "loss scale"))
    if problem is None and skipped != len(cfg.skip_at):
        problem = f"the engine skipped {skipped} steps where {len(cfg.skip_at)} were forced"
    if problem is None and all(torch.equal(p, q) for p, q in zip(base.parameters(), m_engine.parameters())):
        problem = "training did not change the weights"
    return check("bitexact.recipe", cfg.name, problem is None, problem or "bitwise equal",
                 steps=steps, skipped=skipped, scale=scale_e)


def run(device: torch.device, *, tiny: bool) -> Iterator[Check]:
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)  # needs CUBLAS_WORKSPACE_CONFIG, set by the runner
    steps = 6 if tiny else 30
    for cfg in CONFIGS:
        yield compare(cfg, device, tiny, steps)
