"""fp8 scenarios on every rank (``python -m dist_fp8 --out DIR``), all in one launch.

Importing torch and torchao costs seconds per rank, so DDP, FSDP2, FSDP2 with the fp8 all-gather
and the refused combinations all run in this one process pair.  Each engine run is compared with
torchao's recipe written out by hand on the same ranks (convert, wrap, bf16 autocast, backward,
clip, step); each scenario writes ``<out>/<name>.rank<R>.pt`` for tests/distributed/test_fp8.py.
"""

from __future__ import annotations

import argparse
import os
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)

import ampkit
import ampkit.distributed as ad
import ampkit.fp8

STEPS = 6
D = 32
CLIP = 1.0
warnings.filterwarnings("ignore", message="precision='fp8.*no fp8 GEMM")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def rank() -> int:
    return dist.get_rank()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50_021 + 97 * step + rank())
    return torch.randn(8, D, generator=g), torch.randint(0, 16, (8,), generator=g)


def fresh_net() -> Net:
    torch.manual_seed(7)  # the same weights on every rank
    return Net()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DDP) else model
    out = {}
    for name, p in inner.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone().float()
    return out


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def fsdp_by_hand(model: nn.Module) -> nn.Module:
    """The FSDP2 layout ``ampkit.distributed.shard`` builds: one unit per block, then the root."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def recipe(recipe_name: str, wrap: Callable[[nn.Module], nn.Module], *, all_gather: bool = False) -> dict[str, Any]:
    config = Float8LinearConfig.from_recipe_name(recipe_name)
    if all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    model = wrap(convert_to_float8_training(fresh_net(), config=config))
    opt = adamw(model)
    for step in range(STEPS):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if all_gather:
            precompute_float8_dynamic_scale_for_fsdp(model)
    return full_params(model)


def fp8_weights(model: nn.Module) -> dict[str, Any]:
    """How each fp8 layer's weight is held: its local tensor's class and whether a scale was precomputed."""
    return {name: (type(getattr(m.weight, "_local_tensor", m.weight)).__name__,
                   getattr(getattr(m.weight, "_local_tensor", None), "_precomputed_scale", None) is not None)
            for name, m in model.named_modules() if name in set(ampkit.fp8.fp8_layer_names(model))}


def engine(precision: str, build: Callable[[ampkit.MixedPrecision], nn.Module]) -> tuple[dict[str, Any], list[str]]:
    mp = ampkit.MixedPrecision(precision, device="cpu", clip_grad_norm=CLIP)
    model = build(mp)
    model = mp.prepare(model)
    ad.setup(mp)
    opt = adamw(model)
    for step in range(STEPS):
        x, y = batch(step)
        with mp.no_sync(model):
            with mp.autocast():
                loss = F.cross_entropy(model(x), y)
            mp.backward(loss)
        mp.step(opt)
    full = full_params(model)
    full["__weights__"] = fp8_weights(model)
    return full, mp.fp8.layers


def compare(name: str, out: Path, ours: tuple[dict[str, Any], list[str]], theirs: dict[str, Any]) -> None:
    params, layers = ours
    weights = params.pop("__weights__")
    torch.save({"engine": params, "recipe": theirs, "layers": layers, "weights": weights},
               out / f"{name}.rank{rank()}.pt")
    print(f"scenario {name}: done", flush=True)


def ddp(model: nn.Module) -> nn.Module:
    return DDP(model)


def scenario_ddp(out: Path) -> None:
    compare("ddp_fp8", out, engine("fp8", lambda mp: DDP(mp.prepare(fresh_net()))), recipe("tensorwise", ddp))


def scenario_fsdp(out: Path) -> None:
    for precision, recipe_name in (("fp8", "tensorwise"), ("fp8-rowwise", "rowwise")):
        ours = engine(precision, lambda mp: ad.shard(fresh_net(), mp))
        compare(f"fsdp_{precision}", out, ours, recipe(recipe_name, fsdp_by_hand))


def scenario_fsdp_all_gather(out: Path) -> None:
    outcome: dict[str, Any] = {}
    try:
        ours = engine("fp8", lambda mp: ad.shard(fresh_net(), mp, fp8_all_gather=True))
        compare("fsdp_fp8_all_gather", out, ours, recipe("tensorwise", fsdp_by_hand, all_gather=True))
        return
    except Exception as exc:  # recorded for the test, which reports it
        outcome["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    torch.save(outcome, out / f"fsdp_fp8_all_gather.rank{rank()}.pt")


def _error(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _stale_optimizer() -> None:
    mp = ampkit.MixedPrecision("fp8", device="cpu")
    model = fresh_net()
    opt = adamw(model)  # built before shard: its parameters are replaced
    model = mp.prepare(ad.shard(model, mp, fp8_all_gather=True))
    with mp.autocast():
        loss = F.cross_entropy(model(batch(0)[0]), batch(0)[1])
    mp.backward(loss)
    mp.step(opt)


def _convert_after_fully_shard() -> None:
    mp = ampkit.MixedPrecision("fp8", device="cpu")
    mp.prepare(fsdp_by_hand(fresh_net()))


def scenario_refusals(out: Path) -> None:
    errors = {
        "rowwise_all_gather": _error(lambda: ad.shard(
            fresh_net(), ampkit.MixedPrecision("fp8-rowwise", device="cpu"), fp8_all_gather=True)),
        "all_gather_without_engine": _error(lambda: ad.shard(fresh_net(), "fp8", fp8_all_gather=True)),
        "stale_optimizer": _error(_stale_optimizer),
        "convert_after_fully_shard": _error(_convert_after_fully_shard),
    }
    torch.save(errors, out / f"refusals.rank{rank()}.pt")
    print("scenario refusals: done", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group(os.environ.get(ad.BACKEND_ENV, "gloo"))
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        if rank() == 0:
            (args.out / "ampkit_file.txt").write_text(ampkit.__file__)
        for scenario in (scenario_ddp, scenario_fsdp, scenario_fsdp_all_gather, scenario_refusals):
            scenario(args.out)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
