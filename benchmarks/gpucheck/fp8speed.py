"""The ``fp8`` section's speed checks: fp8 against bf16 tokens/s, both arms compiled, on one device.

Two copies of one model train on the same batches, ``MixedPrecision("bf16")`` and
``MixedPrecision("fp8")`` (tensorwise), each ``torch.compile(mp.prepare(model))`` with fused AdamW
and clipping at 1.0, stepped interleaved in a rotating order and timed from a synchronised device
to a synchronised device (``gpucheck.checks.median_ratio``, as the ``ratios`` section times its
arms); the medians after warm-up give tokens/s.  fp8 is compiled because its speed needs it:
eager, the amax, scale and cast of every GEMM operand run as separate kernels (torchtitan and
torchao both compile).  Both arms are compiled so that the ratio is fp8's alone, not inductor's.

* ``mlp_speedup``: one wide MLP block (4096 x 16384, 8192 tokens), where fp8 should win: judged.
* ``gpt_speedup``: the check's 12 x 768 GPT (16 x 512 tokens), whose GEMMs are small: reported.

The warm-up steps include each arm's compile (inductor, forward and backward: tens of seconds for
the GPT), which is why the section has its own call.  On a CPU (``--tiny``) the code runs at tiny
sizes, compiled with ``CPU_BACKEND``, and the speed is reported, not judged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from bench_engine import engine_step
from torch import nn

import ampkit
from gpucheck.checks import Check, check, median_ratio, not_judged
from gpucheck.models import GPT_SIZES, WIDE_MLP_SIZES, gpt, gpt_batches, wide_mlp, wide_mlp_batches

__all__ = ["CPU_BACKEND", "STEPS", "WARMUP", "gpt_speedup", "mlp_speedup", "speedup"]

STEPS, WARMUP = 50, 10
"""Timed steps per arm after warm-up; the warm-up covers the compile and inductor's first-call recompiles."""
CPU_BACKEND = "aot_eager"
"""The compile backend on a CPU (tiny sizes, the tests): dynamo and AOT autograd trace the same forward
and backward graphs as on a GPU, the graphs then run eagerly.  Inductor's CPU code generation is left
out: about 40 C++ kernels for the four arms, most of a minute of g++ on 2 cores, and nothing that a
GPU run uses (there it generates Triton kernels)."""

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _compiled_arm(model: nn.Module, precision: str, device: torch.device, batches: Batches,
                  backend: str) -> Callable[[], None]:
    mp = ampkit.MixedPrecision(precision, device=device, clip_grad_norm=1.0)
    model = mp.prepare(model)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    cursor = [0]

    def step() -> None:
        x, y = batches[cursor[0] % len(batches)]
        cursor[0] += 1
        engine_step(compiled, opt, mp, x, y)

    return step


def speedup(key: str, name: str, base: nn.Module, batches: Batches, device: torch.device, *, tiny: bool) -> Check:
    """fp8 tokens/s over bf16's on copies of ``base``, judged by ``key``'s threshold on a GPU at full size."""
    tokens = batches[0][1].numel()
    backend = CPU_BACKEND if device.type == "cpu" else "inductor"
    arms = {p: _compiled_arm(copy.deepcopy(base).to(device), p, device, batches, backend) for p in ("bf16", "fp8")}
    m = median_ratio(device, arms, STEPS, WARMUP)
    ms = m["median_ms"]
    tokens_per_s = {p: tokens / (ms[p] / 1e3) for p in arms}
    value = round(ms["bf16"] / ms["fp8"], 4)
    detail = (f"fp8 {tokens_per_s['fp8']:,.0f} tokens/s vs bf16 {tokens_per_s['bf16']:,.0f} (median {ms['fp8']:.3f} ms "
              f"vs {ms['bf16']:.3f} ms a step, both compiled ({backend}), {STEPS} steps after {WARMUP} of warm-up)")
    evidence: dict[str, Any] = {"median_ms": ms, "tokens_per_s": tokens_per_s, "tokens_per_step": tokens,
                                "steps": STEPS, "warmup": WARMUP, "backend": backend}
    if device.type != "cuda" or tiny:  # the thresholds are for a GPU's fp8 GEMMs at the GPU sizes
        return not_judged(key, name, value, detail + f"; not judged on {'tiny sizes on ' if tiny else ''}"
                          f"{device.type}", **evidence)
    return check(key, name, value, detail, **evidence)


def mlp_speedup(device: torch.device, tiny: bool) -> Check:
    width, hidden, _, _ = WIDE_MLP_SIZES["tiny" if tiny else "full"]
    return speedup("fp8.mlp_speedup", f"MLP block {width} x {hidden}", wide_mlp(tiny),
                   wide_mlp_batches(tiny, 2, device), device, tiny=tiny)


def gpt_speedup(device: torch.device, tiny: bool) -> Check:
    cfg, _ = GPT_SIZES["tiny" if tiny else "full"]
    return speedup("fp8.gpt_speedup", f"GPT {cfg.n_layer} x {cfg.d_model}", gpt(tiny), gpt_batches(tiny, 4, device),
                   device, tiny=tiny)
