"""Step time of the fp8 engine vs torchao's hand-written float8 recipe, side by side, on CPU.

Both loops train their own copy of the same small GPT (every Linear converted by torchao's
``convert_to_float8_training``) on the same batches, with gradient clipping and fused AdamW.
Steps are interleaved (engine, recipe, recipe, engine, ...) so drift in machine load hits both
alike; the ratio is median(engine step) / median(recipe step) over the steps after warm-up, and
the quartiles show the spread.  The target is a ratio of at most 1.01: the engine adds only its
non-finite check and bookkeeping to torchao's own work.

    python benchmarks/bench_fp8.py [--steps 60] [--warmup 5] [--precisions fp8,fp8-rowwise]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings

import torch
from bench_engine import engine_step, interleaved_times
from torch.nn import functional as F

import ampkit
from ampkit.tasks.gpt import GPT, GPTConfig

# CPU fp8 runs on torch's CPU _scaled_mm: a small GPT keeps the run to a minute.
CONFIG, BATCH = GPTConfig(n_layer=2, n_head=4, d_model=128, block_size=64), 4
RECIPES = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}


def recipe_step(model, opt, x, y, clip):
    """One step of torchao's float8 training recipe, written out by hand."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench(precision: str, steps: int, warmup: int) -> tuple[list[float], list[float], int]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    base = GPT(CONFIG)
    config = Float8LinearConfig.from_recipe_name(RECIPES[precision])
    m_recipe = convert_to_float8_training(copy.deepcopy(base), config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "no fp8 GEMM on the CPU" warning: known here
        mp = ampkit.MixedPrecision(precision, device="cpu", clip_grad_norm=1.0)
    m_engine = mp.prepare(copy.deepcopy(base))
    opt_r = torch.optim.AdamW(m_recipe.parameters(), lr=1e-4, fused=True)
    opt_e = torch.optim.AdamW(m_engine.parameters(), lr=1e-4, fused=True)
    data = torch.randint(0, CONFIG.vocab_size, (steps + warmup, BATCH, CONFIG.block_size + 1))
    times = interleaved_times({
        "engine": lambda i: engine_step(m_engine, opt_e, mp, data[i, :, :-1], data[i, :, 1:]),
        "recipe": lambda i: recipe_step(m_recipe, opt_r, data[i, :, :-1], data[i, :, 1:], 1.0),
    }, steps, warmup)
    t_engine, t_recipe = times["engine"], times["recipe"]
    return t_engine, t_recipe, len(mp.fp8.layers)


def _quartiles(times: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(times, n=4)
    return q1 * 1e3, q2 * 1e3, q3 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per loop (after warm-up)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precisions", default="fp8,fp8-rowwise")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} timed steps each, "
          f"GPT d_model={CONFIG.d_model} n_layer={CONFIG.n_layer} batch={BATCH}x{CONFIG.block_size}")
    print(f"{'precision':<13}{'layers':>7}{'engine ms (q1 / median / q3)':>32}{'recipe ms (q1 / median / q3)':>32}"
          f"{'ratio':>8}")
    for precision in args.precisions.split(","):
        t_engine, t_recipe, layers = bench(precision, args.steps, args.warmup)
        e, r = (" / ".join(f"{v:.2f}" for v in _quartiles(t)) for t in (t_engine, t_recipe))
        ratio = statistics.median(t_engine) / statistics.median(t_recipe)
        print(f"{precision:<13}{layers:>7}{e:>32}{r:>32}{ratio:>8.3f}")


if __name__ == "__main__":
    main()
