"""Step time of ampkit.MixedPrecision vs the hand-written torch.amp recipe, side by side.

Both loops train their own copy of the same small GPT on the same batches.  Steps are
interleaved (engine, recipe, engine, recipe, ...) so drift in machine load hits both alike;
the ratio is median(engine step) / median(recipe step) over the steps after warm-up.

    python benchmarks/bench_engine.py [--steps 40] [--warmup 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

import ampkit
from ampkit.tasks.gpt import GPT, GPTConfig

SHAPES = {
    # bf16 runs fast on CPUs with AVX512-BF16/AMX: a realistic small GPT.
    "bf16": (GPTConfig(n_layer=4, n_head=4, d_model=256, block_size=128), 8),
    # fp16 has no fast CPU path (30-50x slower than fp32): a smaller model keeps the run short.
    "fp16": (GPTConfig(n_layer=2, n_head=4, d_model=128, block_size=64), 4),
}


def recipe_step(model, opt, scaler, dtype, x, y, clip):
    """One step of the hand-written torch.amp recipe (also timed by the GPU check's ``ratios`` section)."""
    with torch.autocast(x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def engine_step(model, opt, mp, x, y):
    with mp.autocast():
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    mp.backward(loss)
    mp.step(opt)


def interleaved_times(
    arms: dict[str, Callable[[int], object]], steps: int, warmup: int, *,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds of every arm's step ``i`` (the arm is called with ``i``), after ``warmup`` untimed steps.

    The arms alternate which goes first, so neither always runs on a warmer cache.  ``clock``:
    wall time by default; ``time.process_time`` counts only the CPU time this process ran.
    """
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps + warmup):
        for name in names if i % 2 == 0 else names[::-1]:
            start = clock()
            arms[name](i)
            elapsed = clock() - start
            if i >= warmup:
                times[name].append(elapsed)
    return times


def bench(precision: str, steps: int, warmup: int) -> tuple[float, float, float]:
    cfg, batch = SHAPES[precision]
    torch.manual_seed(0)
    base = GPT(cfg)
    m_recipe, m_engine = copy.deepcopy(base), copy.deepcopy(base)
    opt_r = torch.optim.AdamW(m_recipe.parameters(), lr=1e-4, fused=True)
    opt_e = torch.optim.AdamW(m_engine.parameters(), lr=1e-4, fused=True)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    mp = ampkit.MixedPrecision(precision, device="cpu", clip_grad_norm=1.0)
    mp.prepare(m_engine)
    data = torch.randint(0, cfg.vocab_size, (steps + warmup, batch, cfg.block_size + 1))
    times = interleaved_times({
        "engine": lambda i: engine_step(m_engine, opt_e, mp, data[i, :, :-1], data[i, :, 1:]),
        "recipe": lambda i: recipe_step(m_recipe, opt_r, scaler, dtype, data[i, :, :-1], data[i, :, 1:], 1.0),
    }, steps, warmup)
    t_engine, t_recipe = times["engine"], times["recipe"]
    med_e, med_r = statistics.median(t_engine), statistics.median(t_recipe)
    return med_e, med_r, med_e / med_r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per loop (after warm-up)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precisions", default="bf16,fp16")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} timed steps each")
    print(f"{'precision':<10}{'engine ms':>12}{'recipe ms':>12}{'ratio':>9}")
    for precision in args.precisions.split(","):
        med_e, med_r, ratio = bench(precision, args.steps, args.warmup)
        print(f"{precision:<10}{med_e * 1e3:>12.2f}{med_r * 1e3:>12.2f}{ratio:>9.3f}")


if __name__ == "__main__":
    main()
