"""Step-time overhead of the framework integrations, measured side by side in one process.

(a) Hugging Face ``Trainer`` with ``ampkit.integrations.hf.AmpkitCallback()`` (defaults: setup
checks, telemetry with its default alarms, flush every 50 steps) against the same ``Trainer``
without it.  fp32: on CPU ``TrainingArguments(fp16=True)`` trains in fp32 anyway (Accelerate makes
no fp16 autocast and no scaler there), so fp32 is what a CPU Trainer run really is, and the
cheapest step is where a fixed per-step cost weighs most.

(b) Lightning with ``AmpkitPrecision(P)`` (the ampkit engine runs the precision) against stock
``Trainer(precision=P)``.  P is ``"bf16-mixed"`` when ``ampkit env`` reports fast bf16 on this CPU
(AVX512-BF16 or AMX): both then do the same bf16 autocast.  On a CPU without fast bf16, bf16 is
about 20x slower and its kernels would swamp both; P is then ``"32-true"`` on both sides, which
measures the plugin's own bookkeeping (no autocast, no scaler).  Stock ``"16-mixed"`` is not a
fair reference on CPU: Lightning runs it as bf16 without a scaler, while ``AmpkitPrecision("16-mixed")``
runs real fp16 with loss scaling.  A third variant, ``AmpkitPrecision(P, skip_nonfinite=False)``,
separates the plugin's bookkeeping from the default's extra safety (a step whose gradients hold
inf/NaN is skipped also without a scaler: one fused check and one host read per step).  Step-time
differences of a few percent drown in run-to-run noise at this step size, so (b) also times the
plugins themselves: the time inside each plugin's ``optimizer_step`` outside the closure (forward,
backward) and outside the optimizer's own ``step``, stock plugin and ampkit's alike; the
difference of the medians, over the stock median step, is what the plugin adds.

Model: a 2-layer GPT-2 config (d=128, 4 heads, sequence 128, vocabulary 512, batch 8, ~0.4M
parameters), built from the config, nothing downloaded.  Each variant trains its own copy (same
init, same batches).  A framework cannot interleave steps of two runs, so the variants alternate in
chunks (``--chunk`` steps; the order flips every round): each chunk is one ``train()`` / ``fit()``
of a fresh Trainer on the same model, and its first ``--warmup`` steps are not timed (setup, first
allocations).  A timing callback, registered after ampkit's, records ``perf_counter`` at the step's
begin and end (``on_step_begin``/``on_step_end``, ``on_train_batch_start``/``on_train_batch_end``),
so the Trainers' setup and the final flush at the end of ``train()`` are outside the timed steps;
the flushes every 50 steps are inside.  Reported: the ratio of the median step times (target: at
most 1.03) and, chunk by chunk, the median of the ratios of the chunks' medians.

    python benchmarks/bench_integrations.py [--steps 200] [--chunk 25] [--warmup 2] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampkit.precision import cpu_has_fast_bf16

SEQ, BATCH, VOCAB = 128, 8, 512
CONFIG = {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_positions": SEQ, "vocab_size": VOCAB,
          "bos_token_id": 0, "eos_token_id": 0}


@dataclass
class Variant:
    name: str
    run_chunk: Callable[[int], None]
    """Trains ``n`` more steps (one Trainer), appending each step's seconds to ``chunk``."""
    times: list[float] = field(default_factory=list)
    chunks: list[float] = field(default_factory=list)
    """The median step time of each chunk."""
    chunk: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)
    """Lightning only: seconds per step inside the precision plugin's ``optimizer_step``, outside
    the closure (forward and backward) and outside the optimizer's own ``step``."""


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def hf_variants(steps: int, out: str) -> list[Variant]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ampkit.integrations.hf import AmpkitCallback

    data = dataset(BATCH * steps)
    base = gpt2()

    def variant(name: str, with_ampkit: bool) -> Variant:
        model = copy.deepcopy(base)
        v = Variant(name, lambda n: None)

        class Timer(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                self.t0 = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                v.chunk.append(time.perf_counter() - self.t0)

        def run_chunk(n: int) -> None:
            args = TrainingArguments(out, use_cpu=True, report_to=[], max_steps=n, per_device_train_batch_size=BATCH,
                                     disable_tqdm=True, logging_strategy="no", save_strategy="no", seed=0)
            callbacks = [AmpkitCallback(), Timer()] if with_ampkit else [Timer()]
            Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()

        v.run_chunk = run_chunk
        return v

    return [variant("Trainer, fp32 (baseline)", False), variant("Trainer + ampkit AmpkitCallback", True)]


def lightning_variants(steps: int, precision: str) -> list[Variant]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from torch.utils.data import DataLoader

    from ampkit.integrations.lightning import AmpkitPrecision

    class LitGPT(pl.LightningModule):  # type: ignore[misc]
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    loader = DataLoader(dataset(BATCH * steps), batch_size=BATCH)
    base = gpt2()

    def variant(name: str, plugin: Callable[[], Any]) -> Variant:
        module = LitGPT(copy.deepcopy(base))
        v = Variant(name, lambda n: None)

        class Timer(pl.Callback):  # type: ignore[misc]
            def on_train_batch_start(self, *args: Any) -> None:
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, *args: Any) -> None:
                v.chunk.append(time.perf_counter() - self.t0)

        def run_chunk(n: int) -> None:
            trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=n, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()],
                                 plugins=[timed(plugin(), v)])
            trainer.fit(module, loader)

        v.run_chunk = run_chunk
        return v

    # The default skips a step whose gradients hold inf/NaN also without a scaler (bf16): one fused
    # non-finite check over the gradients and one host read per step that stock Lightning does not
    # make.  The third variant turns it off, which leaves the plugin's own bookkeeping.
    # The stock plugin Lightning builds for Trainer(precision=...) on CPU, built here so that it is timed too.
    stock = (lambda: MixedPrecision(precision, "cpu")) if precision.endswith("-mixed") else Precision
    return [variant(f"Lightning precision={precision!r} (baseline)", stock),
            variant(f"Lightning AmpkitPrecision({precision!r})", lambda: AmpkitPrecision(precision)),
            variant(f"Lightning AmpkitPrecision({precision!r}, skip_nonfinite=False)",
                    lambda: AmpkitPrecision(precision, skip_nonfinite=False))]


def timed(plugin: Any, v: Variant) -> Any:
    """``plugin`` whose ``optimizer_step`` appends to ``v.own`` the time it spends outside the closure
    and outside the optimizer's own ``step`` (which may run the closure inside it, as stock
    Lightning's plugins do): what the plugin itself adds to a step."""
    inner = type(plugin).optimizer_step

    def optimizer_step(optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        marks: dict[str, float] = {}

        def timed_closure() -> Any:
            marks["c0"] = time.perf_counter()
            try:
                return closure()
            finally:
                marks["c1"] = time.perf_counter()

        pre = optimizer.register_step_pre_hook(lambda *a: marks.__setitem__("s0", time.perf_counter()))
        post = optimizer.register_step_post_hook(lambda *a: marks.__setitem__("s1", time.perf_counter()))
        t0 = time.perf_counter()
        try:
            return inner(plugin, optimizer, model, timed_closure, **kwargs)
        finally:
            busy = time.perf_counter() - t0
            pre.remove()
            post.remove()
            closure_s = marks.get("c1", 0.0) - marks.get("c0", 0.0)
            step_s = marks.get("s1", 0.0) - marks.get("s0", 0.0)
            nested = "s0" in marks and marks["s0"] <= marks.get("c0", 0.0) <= marks.get("s1", 0.0)
            v.own.append(busy - (step_s if nested else step_s + closure_s))

    plugin.optimizer_step = optimizer_step
    return plugin


def interleave(variants: list[Variant], steps: int, chunk: int, warmup: int) -> None:
    rounds = -(-steps // chunk)
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            v.chunk = []
            v.run_chunk(chunk + warmup)
            kept = v.chunk[warmup:]
            v.times.extend(kept)
            v.chunks.append(statistics.median(kept))


def table(title: str, variants: list[Variant]) -> tuple[str, float]:
    base = variants[0]
    lines = [f"{title}", "| variant | steps | median step ms | ratio of medians | median chunk ratio |",
             "|---|---:|---:|---:|---:|"]
    ratios = []
    for v in variants:
        med = statistics.median(v.times)
        ratios.append(med / statistics.median(base.times))
        chunked = statistics.median(c / b for c, b in zip(v.chunks, base.chunks))
        lines.append(f"| {v.name} | {len(v.times)} | {med * 1e3:.1f} | {ratios[-1]:.3f} | {chunked:.3f} |")
    return "\n".join(lines), ratios[1:]


def plugin_time_table(variants: list[Variant]) -> str:
    """The precision plugins' own time per step (outside forward, backward and the optimizer's step):
    unlike a difference of step times, it does not drown in the step's run-to-run noise."""
    base_step = statistics.median(variants[0].times)
    base_own = statistics.median(variants[0].own)
    lines = ["time inside the precision plugin's optimizer_step, outside the closure and the optimizer's step",
             "| variant | steps | median ms/step | added vs stock, % of the stock step |", "|---|---:|---:|---:|"]
    for v in variants:
        own = statistics.median(v.own)
        lines.append(f"| {v.name} | {len(v.own)} | {own * 1e3:.2f} | {(own - base_own) / base_step * 100:+.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per variant (>= 200 for the report)")
    parser.add_argument("--chunk", type=int, default=25, help="timed steps per Trainer before switching variants")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every chunk")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.steps < 20 or args.chunk < 5:
        parser.error("--steps >= 20 and --chunk >= 5 for a meaningful median")
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(num_workers|LeafSpec|does not have many workers).*")
    precision = "bf16-mixed" if cpu_has_fast_bf16() else "32-true"
    total = args.chunk * -(-args.steps // args.chunk)
    print(f"GPT-2 config {CONFIG}, batch {BATCH}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{total} timed steps per variant in chunks of {args.chunk} (+{args.warmup} untimed), alternating")
    with tempfile.TemporaryDirectory() as out:
        hf = hf_variants(args.chunk + args.warmup, out)
        interleave(hf, args.steps, args.chunk, args.warmup)
    lit = lightning_variants(args.chunk + args.warmup, precision)
    interleave(lit, args.steps, args.chunk, args.warmup)
    hf_table, (hf_ratio,) = table("(a) Hugging Face Trainer, fp32", hf)
    lit_table, (lit_ratio, lit_bare) = table(f"(b) Lightning, {precision}", lit)
    print(hf_table, lit_table, sep="\n\n")
    print(plugin_time_table(lit))
    print(f"median step-time ratio: Trainer + AmpkitCallback {hf_ratio:.3f}, AmpkitPrecision {lit_ratio:.3f} "
          f"({lit_bare:.3f} with skip_nonfinite=False) (target <= 1.03)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
