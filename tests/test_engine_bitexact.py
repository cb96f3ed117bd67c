"""The engine against the hand-written official torch.amp recipe, bit for bit, over 30 steps."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch.nn import functional as F

import ampkit
from tests.helpers.models import TinyNet, make_batches

STEPS = 30


@dataclass(frozen=True)
class Config:
    name: str
    precision: str
    init_scale: float = 2.0**16
    accumulation: int = 1
    clip: float | None = None
    optimizer: str = "adamw"  # adamw | adamw-fused | sgd

    @property
    def dtype(self) -> torch.dtype:
        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.precision]


CONFIGS = [
    Config("fp16-forced-skips", "fp16", init_scale=2.0**40),
    Config("fp16-clip", "fp16", clip=0.5),
    Config("fp16-accumulate-4", "fp16", accumulation=4),
    Config("bf16", "bf16", clip=1.0),
    Config("fp16-fused-adamw-skips-clip", "fp16", init_scale=2.0**40, clip=0.5, optimizer="adamw-fused"),
    Config("bf16-fused-adamw-accumulate", "bf16", accumulation=2, optimizer="adamw-fused"),
    Config("fp16-sgd-momentum", "fp16", init_scale=2.0**30, optimizer="sgd"),
]


def make_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=(kind == "adamw-fused"))


def run_recipe(cfg: Config, model, opt, batches) -> torch.Tensor:
    """The official recipe, written out by hand (torch AMP examples: accumulate, unscale, clip)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=cfg.init_scale, enabled=cfg.precision == "fp16")
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=cfg.dtype):
            loss = F.cross_entropy(model(x), y)
            loss = loss / cfg.accumulation
        scaler.scale(loss).backward()
        if (i + 1) % cfg.accumulation == 0:
            scaler.unscale_(opt)
            if cfg.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return scaler.get_scale() if scaler.is_enabled() else 1.0


def run_engine(cfg: Config, model, opt, batches) -> tuple[float, int]:
    scaler = ampkit.DynamicLossScaler(init_scale=cfg.init_scale) if cfg.precision == "fp16" else None
    mp = ampkit.MixedPrecision(
        cfg.precision, device="cpu", grad_accumulation=cfg.accumulation, clip_grad_norm=cfg.clip, scaler=scaler
    )
    mp.prepare(model)
    skipped = 0
    for x, y in batches:
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        result = mp.step(opt)
        skipped += int(result.skipped)
    return float(mp.scale), skipped


def assert_state_equal(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        va, vb = a[key], b[key]
        if isinstance(va, dict):
            assert_state_equal(va, vb, f"{where}.{key}")
        elif isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), f"{where}.{key} differs"
        else:
            assert va == vb, f"{where}.{key}: {va!r} != {vb!r}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_engine_bitexact_with_official_recipe(cfg: Config, seed: int) -> None:
    reference = TinyNet()
    batches = make_batches(STEPS * cfg.accumulation if cfg.accumulation > 1 else STEPS, seed=seed)
    model_a, model_b = copy.deepcopy(reference), copy.deepcopy(reference)
    opt_a, opt_b = make_optimizer(model_a, cfg.optimizer), make_optimizer(model_b, cfg.optimizer)

    scale_recipe = run_recipe(cfg, model_a, opt_a, batches)
    scale_engine, skipped = run_engine(cfg, model_b, opt_b, batches)

    for (name, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs from the recipe"
    assert_state_equal(opt_a.state_dict(), opt_b.state_dict(), "optimizer")
    assert scale_engine == scale_recipe
    if cfg.init_scale > 2.0**24:
        assert skipped > 0, "the forced-skip configuration must actually skip steps"
    assert not torch.equal(reference.fc1.weight, model_b.fc1.weight), "training must change the weights"
