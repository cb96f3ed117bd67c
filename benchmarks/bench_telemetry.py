"""Step-time overhead of ampkit telemetry on tinygpt (bf16 autocast, CPU), measured side by side.

Every variant trains its own copy of the same model (same init, same batches, fused AdamW)
under ``MixedPrecision("bf16")``.  The variants take turns step by step (the order rotates
every round), so machine load drifts hit all of them alike.  After the warm-up, each variant's
median step time is compared with the baseline's (ratio of medians) and, round by round, the
median of the paired ratios.  The mean ratio includes the rare expensive steps (a telemetry
flush every 50 steps; a monitor's sampled trace steps).

Compared, when installed: MixedPrecisionNanny (``pip install mixed-precision-nanny``, default
settings, logs to a temp dir) and transformers' ``DebugUnderflowOverflow`` (default settings).

    python benchmarks/bench_telemetry.py [--steps 60] [--warmup 5] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ampkit
from ampkit.tasks.gpt import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=4, d_model=256, n_head=4, block_size=128)
BATCH = 8


@dataclass
class Variant:
    name: str
    step: Callable[[int, torch.Tensor], None] | None
    note: str = ""
    times: list[float] = field(default_factory=list)
    close: Callable[[], None] = lambda: None
    hook_time: list[float] = field(default_factory=list)
    """Seconds spent inside the telemetry hooks, per step (flushes included)."""


def _time_hooks(tel: ampkit.Telemetry) -> list[float]:
    """Wrap the hooks of ``tel`` to add their wall time to the last entry of the returned list.

    On CPU every kernel runs inside the call, so this is the telemetry's whole cost, free of the
    step-to-step noise that the side-by-side ratio has on a shared machine.
    """
    per_step: list[float] = []
    for name in ("on_backward", "after_unscale", "before_optimizer_step", "after_step", "_check_inputs"):
        inner = getattr(tel, name)

        def timed(*args: object, _inner: Callable[..., None] = inner) -> None:
            t0 = time.perf_counter()
            _inner(*args)
            if per_step:
                per_step[-1] += time.perf_counter() - t0

        setattr(tel, name, timed)
    return per_step


def _engine_step(model: GPT, telemetry: object = None) -> tuple[Callable[[int, torch.Tensor], None], ampkit.MixedPrecision]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=telemetry)
    mp.prepare(model)

    def step(i: int, batch: torch.Tensor) -> None:
        with mp.autocast():
            loss = GPT.loss(model(batch[:, :-1]), batch[:, 1:])
        mp.backward(loss)
        mp.step(opt)

    return step, mp


def build_variants(base: GPT, tmp: Path) -> list[Variant]:
    variants: list[Variant] = []
    step, _ = _engine_step(copy.deepcopy(base))
    variants.append(Variant("engine alone (baseline)", step))

    tel = ampkit.Telemetry(sinks=[ampkit.JsonlSink(tmp / "telemetry.jsonl")], flush_every=50)
    hook_time = _time_hooks(tel)
    tel_step, _ = _engine_step(copy.deepcopy(base), tel)

    def timed_step(i: int, batch: torch.Tensor) -> None:
        hook_time.append(0.0)
        tel_step(i, batch)

    variants.append(Variant("ampkit Telemetry (flush_every=50, default alarms, JSONL)", timed_step, close=tel.close))
    variants[-1].hook_time = hook_time

    tel2 = ampkit.Telemetry(sinks=[], flush_every=50, module_absmax_every=10)
    step, _ = _engine_step(copy.deepcopy(base), tel2)
    variants.append(Variant("ampkit Telemetry + module absmax every 10 steps", step, close=tel2.close))

    try:
        from mixed_precision_nanny import MixedPrecisionNanny
    except ImportError as e:
        variants.append(Variant("MixedPrecisionNanny", None, note=f"not installed ({e}); pip install mixed-precision-nanny"))
    else:
        model = copy.deepcopy(base)
        with contextlib.redirect_stdout(io.StringIO()):
            nanny = MixedPrecisionNanny(model, output_dir=str(tmp / "nanny"))
        inner, _ = _engine_step(model)
        sink = io.StringIO()

        def nanny_step(i: int, batch: torch.Tensor) -> None:
            with contextlib.redirect_stdout(sink), nanny.step(i):
                inner(i, batch)

        def nanny_close() -> None:
            with contextlib.redirect_stdout(sink):
                nanny.close()

        variants.append(Variant("MixedPrecisionNanny (defaults: trace_interval=100)", nanny_step,
                                note="traces steps 0, 100, ...: step 0 falls in the warm-up", close=nanny_close))
    try:
        from transformers.debug_utils import DebugUnderflowOverflow
    except ImportError as e:
        variants.append(Variant("transformers DebugUnderflowOverflow", None, note=f"not installed ({e})"))
    else:
        model = copy.deepcopy(base)
        DebugUnderflowOverflow(model)
        step, _ = _engine_step(model)
        variants.append(Variant("transformers DebugUnderflowOverflow (defaults)", step))
    return variants


def run(steps: int, warmup: int, seed: int = 0) -> list[Variant]:
    torch.manual_seed(seed)
    base = GPT(CONFIG)
    data = torch.randint(0, CONFIG.vocab_size, (warmup + steps, BATCH, CONFIG.block_size + 1))
    with tempfile.TemporaryDirectory() as tmp:
        variants = build_variants(base, Path(tmp))
        live = [v for v in variants if v.step is not None]
        for i in range(warmup + steps):
            k = i % len(live)
            for v in live[k:] + live[:k]:
                assert v.step is not None
                t0 = time.perf_counter()
                v.step(i, data[i])
                elapsed = time.perf_counter() - t0
                if i >= warmup:
                    v.times.append(elapsed)
        for v in variants:
            v.close()
    return variants


def paired_quartiles(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """Quartiles of the step-by-step ratios to the baseline: the spread says how far the median can be trusted."""
    q1, q2, q3 = statistics.quantiles([t / b for t, b in zip(times, base)], n=4)
    return q1, q2, q3


def table(variants: list[Variant]) -> str:
    base = variants[0].times
    base_median = statistics.median(base)
    lines = [
        "| variant | median step ms | ratio of medians | paired ratio q1 / median / q3 | mean ratio | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for v in variants:
        if not v.times:
            lines.append(f"| {v.name} | - | - | - | - | {v.note} |")
            continue
        med = statistics.median(v.times)
        q1, paired, q3 = paired_quartiles(v.times, base)
        mean_ratio = statistics.fmean(v.times) / statistics.fmean(base)
        lines.append(f"| {v.name} | {med * 1e3:.1f} | {med / base_median:.3f} | {q1:.3f} / {paired:.3f} / {q3:.3f} "
                     f"| {mean_ratio:.3f} | {v.note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="measured steps per variant (>= 30)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.steps < 30:
        parser.error("--steps must be >= 30 for a stable median")
    # MixedPrecisionNanny's full backward hooks warn on modules whose inputs need no grad (the embeddings).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    variants = run(args.steps, args.warmup)
    print(f"tinygpt {CONFIG}, batch {BATCH}, bf16 autocast on CPU, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.steps} steps after {args.warmup} warm-up, interleaved")
    print(table(variants))
    telemetry = variants[1]
    base_median = statistics.median(variants[0].times)
    q1, paired, q3 = paired_quartiles(telemetry.times, variants[0].times)
    hooks = telemetry.hook_time[args.warmup:]
    print(f"telemetry overhead (median paired ratio): {paired - 1:+.2%}, quartiles {q1:.3f}-{q3:.3f} (target <= 1%)")
    print(f"time inside the telemetry hooks: median {statistics.median(hooks) * 1e3:.2f} ms/step "
          f"= {statistics.median(hooks) / base_median:.2%} of the baseline median step; "
          f"mean with flushes {statistics.fmean(hooks) * 1e3:.2f} ms/step = {statistics.fmean(hooks) / base_median:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
