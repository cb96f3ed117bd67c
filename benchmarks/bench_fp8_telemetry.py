"""Step time of an fp8 engine with the fp8 operand statistics on a sampled step, on a step that is not
sampled, and without telemetry, side by side, on CPU.

Three copies of the same small GPT (every Linear converted to torchao's ``Float8Linear``) train on
the same batches, interleaved step by step: without telemetry; with ``Telemetry(fp8_stats_every=0)`` (the
rest of the telemetry, no fp8 hook); with ``Telemetry(fp8_stats_every=10**9)``
(the hooks are attached but no timed step is sampled: the cost of every step that is not sampled); and
with ``fp8_stats_every=1`` (every step sampled: the cost of a sampled step).  All telemetry arms flush
every 50 steps.  Printed: the median and quartiles of each and the ratio of medians to the arm
without telemetry.  Median ratios, not single steps, because the machine is shared.

    python benchmarks/bench_fp8_telemetry.py [--steps 60] [--warmup 5] [--precisions fp8,fp8-rowwise] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings

import torch
from bench_engine import engine_step, interleaved_times
from bench_fp8 import BATCH, CONFIG, _quartiles

import ampkit
from ampkit.tasks.gpt import GPT

ARMS = {"no telemetry": None, "fp8 stats off": 0, "not sampled": 10**9, "sampled": 1}


def bench(precision: str, steps: int, warmup: int) -> tuple[dict[str, list[float]], int]:
    torch.manual_seed(0)
    base = GPT(CONFIG)
    data = torch.randint(0, CONFIG.vocab_size, (steps + warmup, BATCH, CONFIG.block_size + 1))
    runs = {}
    for name, every in ARMS.items():
        tel = None if every is None else ampkit.Telemetry(flush_every=50, fp8_stats_every=every)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the "no fp8 GEMM on the CPU" warning: known here
            mp = ampkit.MixedPrecision(precision, device="cpu", clip_grad_norm=1.0, telemetry=tel)
        model = mp.prepare(copy.deepcopy(base))
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), mp)

    def arm(name: str):
        model, opt, mp = runs[name]
        return lambda i: engine_step(model, opt, mp, data[i, :, :-1], data[i, :, 1:])

    times = interleaved_times({name: arm(name) for name in ARMS}, steps, warmup)
    layers = len(runs["sampled"][2].fp8.layers)
    for _, _, mp in runs.values():
        mp.close()
    return times, layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per arm (after warm-up)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precisions", default="fp8,fp8-rowwise")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} timed steps each, "
          f"GPT d_model={CONFIG.d_model} n_layer={CONFIG.n_layer} batch={BATCH}x{CONFIG.block_size}")
    print(f"{'precision':<13}{'layers':>7}  {'arm':<14}{'ms (q1 / median / q3)':>26}{'ratio':>8}")
    for precision in args.precisions.split(","):
        times, layers = bench(precision, args.steps, args.warmup)
        base = statistics.median(times["no telemetry"])
        for name, t in times.items():
            q = " / ".join(f"{v:.2f}" for v in _quartiles(t))
            print(f"{precision:<13}{layers:>7}  {name:<14}{q:>26}{statistics.median(t) / base:>8.3f}")


if __name__ == "__main__":
    main()
