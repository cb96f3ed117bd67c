"""Section ``nccl``: a 1-rank NCCL process group through ``ampkit.distributed``.

* ``setup``: an FSDP2-sharded fp16 model (``ampkit.distributed.shard``) joins the group with
  ``ampkit.distributed.setup``; an inf input at step 2 must skip that step through the found_inf
  all-reduce (the scale halves), and ``first_nonfinite_rank()`` (an all-gather) must name rank 0.
* ``dcp_round_trip``: ``save_distributed_checkpoint`` after step 3, then a model built from another
  seed loads it; its parameters, optimizer state and engine state must equal the saved ones bitwise,
  and two more steps on both must leave them bitwise equal.

``backend`` is a parameter so that the CPU tests run the same code on gloo.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

import ampkit
import ampkit.distributed as ad
from gpucheck.checks import Check, check, first_difference, skipped
from gpucheck.models import mlp, mlp_batches

__all__ = ["run"]


def _build(device: torch.device, tiny: bool, seed: int) -> tuple[torch.nn.Module, ampkit.MixedPrecision, Any, Any]:
    model = mlp(tiny, seed=seed).to(device)
    mp = ampkit.MixedPrecision("fp16", device=device, scaler=ampkit.DynamicLossScaler(init_scale=2.0**10))
    ad.shard(model, mp)
    mp.prepare(model)
    ctx = ad.setup(mp)
    return model, mp, ctx, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _steps(model: torch.nn.Module, mp: ampkit.MixedPrecision, opt: Any, batches: list[Any]) -> list[Any]:
    results = []
    for x, y in batches:
        with mp.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        mp.backward(loss)
        results.append(mp.step(opt))
    return results


def _state(model: torch.nn.Module, mp: ampkit.MixedPrecision, opt: Any) -> dict[str, Any]:
    with torch.no_grad():
        params = {n: p.full_tensor().clone() if hasattr(p, "full_tensor") else p.clone()
                  for n, p in model.named_parameters()}
    return {"params": params, "optimizer": opt.state_dict(), "engine": mp.state_dict()}


def _checks(device: torch.device, tiny: bool, tmp: Path) -> Iterator[Check]:
    batches = mlp_batches(tiny, 6, device)
    x, y = batches[1]
    bad = x.clone()
    bad[0, 0] = math.inf
    batches[1] = (bad, y)
    model, mp, ctx, opt = _build(device, tiny, seed=0)
    results = _steps(model, mp, opt, batches[:2])
    culprit = ctx.first_nonfinite_rank()  # a collective over the group (NCCL: an all-gather)
    scale = float(mp.scale)
    ok = bool(results[1].skipped) and not results[0].skipped and scale == 2.0**9 and culprit == 0
    yield check("nccl.setup", "setup + found_inf all-reduce", ok,
                f"step 2 skipped: {bool(results[1].skipped)}, scale {scale:g} (want 512), "
                f"first_nonfinite_rank {culprit} (want 0); reduces_found_inf {mp.reduces_found_inf}",
                backend=dist.get_backend())
    _steps(model, mp, opt, batches[2:3])
    ad.save_distributed_checkpoint(tmp / "ck", model=model, optimizer=opt, engine=mp, extra={"step": 3})
    saved = _state(model, mp, opt)
    fresh, fresh_mp, _, fresh_opt = _build(device, tiny, seed=99)
    _steps(fresh, fresh_mp, fresh_opt, batches[3:4])  # so the optimizer has state to overwrite
    extra = ad.load_distributed_checkpoint(tmp / "ck", model=fresh, optimizer=fresh_opt, engine=fresh_mp)
    problem = first_difference(saved, _state(fresh, fresh_mp, fresh_opt), "loaded")
    if problem is None and extra != {"step": 3}:
        problem = f"extra {extra!r} != {{'step': 3}}"
    if problem is None:
        _steps(model, mp, opt, batches[4:6])
        _steps(fresh, fresh_mp, fresh_opt, batches[4:6])
        problem = first_difference(_state(model, mp, opt), _state(fresh, fresh_mp, fresh_opt), "after 2 more steps")
    yield check("nccl.dcp_round_trip", "DCP save + load", problem is None,
                problem or "loaded state and 2 further steps bitwise equal", backend=dist.get_backend())


def run(device: torch.device, *, tiny: bool, backend: str = "nccl") -> Iterator[Check]:
    if backend == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        for name in ("setup", "dcp_round_trip"):
            yield skipped(f"nccl.{name}", name, "needs CUDA and a torch built with NCCL")
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="ampkit-gpu-check-nccl-") as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield from _checks(device, tiny, Path(tmp))
        finally:
            dist.destroy_process_group()
