"""How long ``ampkit preflight --formats all`` takes on a ~20M-parameter GPT, phase by phase.

The model of the acceptance figure: ``ampkit.tasks.gpt.GPT`` with d_model 384, 6 layers, 6 heads, a
vocabulary of 8192 and a context of 128, at random initialisation; 2 batches of 4 × 128 tokens.  The
script prints each phase's seconds (the fp32 pass, then one per format, policy rounds included) and the
total, and the verdicts.  ``--gpt2`` runs the 124M GPT-2 shape instead (d_model 768, 12 layers, vocabulary
50257, context 1024 with batches of 1 × 1024 tokens).

Run natively and under the emulated AVX2 CPU (where bf16 and the fp8 GEMMs are slow)::

    .venv/bin/python benchmarks/bench_preflight.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/bench_preflight.py --time-budget 600
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from ampkit.diagnose.preflight.api import preflight_model
from ampkit.tasks.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="all")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds")
    parser.add_argument("--gpt2", action="store_true", help="the 124M GPT-2 shape instead of the 20M GPT")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.gpt2:
        cfg = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, d_model=768, n_head=12, dropout=0.0)
        rows, length = 1, 1024
    else:
        cfg = GPTConfig(vocab_size=8192, block_size=128, n_layer=6, d_model=384, n_head=6, dropout=0.0)
        rows, length = 4, 128
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    batches = [torch.randint(0, cfg.vocab_size, (rows, length + 1)) for _ in range(2)]

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        logits = m(b[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))

    print(f"GPT: {params / 1e6:.1f}M parameters; 2 batches of {rows} x {length} tokens; "
          f"{torch.get_num_threads()} threads", flush=True)
    start = time.perf_counter()
    result = preflight_model(model, batches, loss_fn=loss, formats=args.formats, time_budget=args.time_budget)
    total = time.perf_counter() - start
    for phase, seconds in result.phases.items():
        print(f"  {phase:20} {seconds:7.1f} s")
    print(f"  {'total':20} {total:7.1f} s  ({result.inputs['batches']} batch(es) replayed)")
    for report in result.formats:
        print(f"  {report.format:20} {report.verdict}")
    for skipped in result.skipped:
        print(f"  {skipped['format']:20} not judged: {skipped['reason']}")


if __name__ == "__main__":
    main()
