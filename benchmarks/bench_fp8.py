"""Step time of the fp8 engine vs torchao's hand-written float8 recipe, side by side, on CPU.

Both loops train their own copy of the same small GPT (every Linear converted by torchao's
``convert_to_float8_training``) on the same batches, with gradient clipping and fused AdamW.
Steps are interleaved (engine, recipe, recipe, engine, ...) so drift in machine load hits both
alike, with Python's garbage collector paused while they run so that neither arm pays for the
other's garbage.  Printed per recipe: the quartiles (q1 / median / q3) of each arm's step over
the steps after warm-up, ``ratio`` = median(engine) / median(recipe), and ``paired`` = the median
of the per-step ratios engine[i] / recipe[i] (the two steps of a pair run back to back on the
same batch).  The target is a ratio of at most 1.01: without a loss scaler the engine reads its
non-finite check off the clip's norm, so all it adds to torchao's work is a few scalar kernels
and Python bookkeeping.

Made for a machine shared with other work.  One torch thread by default: a step on several
threads waits at OpenMP's barriers for whichever core another process holds and slows by up to
100x.  The CPU time the process ran by default (``--clock wall`` for elapsed time): it leaves out
the time other processes hold the core, which otherwise swings the median by a few percent
between runs.  The default of 400 timed steps takes about 50 s for both recipes.

    python benchmarks/bench_fp8.py [--steps 400] [--warmup 10] [--precisions fp8,fp8-rowwise]
                                   [--threads 1] [--clock cpu|wall] [--control]

``--control`` times a second copy of the recipe in the engine's place: the ratios it prints are
this machine's noise, the margin within which an engine ratio says nothing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from bench_engine import engine_step, interleaved_times

import ampkit
from ampkit.tasks.gpt import GPT, GPTConfig
from gpucheck.fp8recipe import recipe_step, torchao_config

# CPU fp8 runs on torch's CPU _scaled_mm: a small GPT keeps the run to a minute.
CONFIG, BATCH = GPTConfig(n_layer=2, n_head=4, d_model=128, block_size=64), 4
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def bench(precision: str, steps: int, warmup: int, clock: Callable[[], float] = time.process_time,
          control: bool = False) -> tuple[list[float], list[float], int]:
    """The engine's and the recipe's step times; ``control``: a second copy of the recipe in the engine's place."""
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    base = GPT(CONFIG)
    m_recipe = convert_to_float8_training(copy.deepcopy(base), config=torchao_config(precision))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "no fp8 GEMM on the CPU" warning: known here
        mp = ampkit.MixedPrecision(precision, device="cpu", clip_grad_norm=1.0)
    m_engine = mp.prepare(copy.deepcopy(base))
    opt_r = torch.optim.AdamW(m_recipe.parameters(), lr=1e-4, fused=True)
    opt_e = torch.optim.AdamW(m_engine.parameters(), lr=1e-4, fused=True)

    def first(i: int) -> None:
        x, y = data[i, :, :-1], data[i, :, 1:]
        if control:
            recipe_step(m_engine, opt_e, x, y, 1.0)
        else:
            engine_step(m_engine, opt_e, mp, x, y)

    data = torch.randint(0, CONFIG.vocab_size, (steps + warmup, BATCH, CONFIG.block_size + 1))
    gc.collect()
    gc.disable()
    try:
        times = interleaved_times({
            "engine": first,
            "recipe": lambda i: recipe_step(m_recipe, opt_r, data[i, :, :-1], data[i, :, 1:], 1.0),
        }, steps, warmup, clock=clock)
    finally:
        gc.enable()
    t_engine, t_recipe = times["engine"], times["recipe"]
    return t_engine, t_recipe, len(mp.fp8.layers)


def _quartiles(times: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(times, n=4)
    return q1 * 1e3, q2 * 1e3, q3 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="timed steps per loop (after warm-up)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--precisions", default="fp8,fp8-rowwise")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--control", action="store_true",
                    help="time a second copy of the recipe in the engine's place: the ratio this machine's noise gives")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: the CPU time this process ran, all its threads (default); wall: elapsed time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} timed steps each, "
          f"GPT d_model={CONFIG.d_model} n_layer={CONFIG.n_layer} batch={BATCH}x{CONFIG.block_size}, "
          f"clip_grad_norm=1.0, AdamW(fused=True), {args.clock} clock"
          + (", control: the 'engine' column is a second copy of the recipe" if args.control else ""))
    print(f"{'precision':<13}{'layers':>7}{'engine ms (q1 / median / q3)':>32}{'recipe ms (q1 / median / q3)':>32}"
          f"{'ratio':>8}{'paired':>8}")
    for precision in args.precisions.split(","):
        t_engine, t_recipe, layers = bench(precision, args.steps, args.warmup, CLOCKS[args.clock], args.control)
        e, r = (" / ".join(f"{v:.2f}" for v in _quartiles(t)) for t in (t_engine, t_recipe))
        ratio = statistics.median(t_engine) / statistics.median(t_recipe)
        paired = statistics.median(a / b for a, b in zip(t_engine, t_recipe))
        print(f"{precision:<13}{layers:>7}{e:>32}{r:>32}{ratio:>8.3f}{paired:>8.3f}")


if __name__ == "__main__":
    main()
