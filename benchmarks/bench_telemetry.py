"""Step-time overhead of ampkit telemetry (bf16 autocast, CPU), measured side by side, on two step lengths.

Workloads (each a GPT from ``ampkit.tasks.gpt``, batch 8, fused AdamW, ``MixedPrecision("bf16")``):

* ``gpt30``: 3 layers, d_model 192, 6 heads, context 64 (about 30 ms a step on a 2-core CPU with
  bf16 units), where a fixed per-step cost shows;
* ``tinygpt``: 4 layers, d_model 256, 4 heads, context 128 (about 117 ms a step there).

Every variant trains its own copy of the same model (same init, same batches).  The variants take
turns step by step, the order rotating every step, so machine load drifts hit all of them alike.
After the warm-up, each step's time is divided by the baseline's time of the same round (the
paired ratio); the figures are the median and quartiles of those ratios, and the time the
telemetry adds per step (median of the paired differences, in µs).  ``--rounds R`` repeats the
measurement R times in the process and also prints each round's median, which shows how far one
run's median can be trusted on a shared machine.

A control variant is the bare engine again, on its own copy: its paired ratio against the baseline
is what two identical variants read on this machine (memory placement, turn order), so it is the
resolution of the telemetry's ratio.  Another variant runs the same telemetry with its hooks wrapped in a timer (CPU time of the calling
thread): on CPU the hooks' kernels run inside the calls, so that is the telemetry's own cost,
split by hook; it is free of the step-to-step noise of a loaded machine (though a loaded machine
still slows it through the caches).  The ratio is taken on the unwrapped variant.

``--compare`` adds, on ``tinygpt`` only, module absmax sampling, and when installed
MixedPrecisionNanny and transformers' ``DebugUnderflowOverflow``.

Run (natively, then under an emulated AVX2 CPU, where bf16 is slow and fewer steps suffice)::

    python benchmarks/bench_telemetry.py --rounds 3
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_telemetry.py --steps 40 --warmup 3

Compare two source trees (for example ``git worktree add /tmp/base HEAD``) by running it with
``PYTHONPATH=/tmp/base/src`` and without; the script itself only uses the public API.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import platform
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

WORKLOADS = {
    "gpt30": GPTConfig(n_layer=3, d_model=192, n_head=6, block_size=64),
    "tinygpt": GPTConfig(n_layer=4, d_model=256, n_head=4, block_size=128),
}
BATCH = 8
BASELINE, CONTROL, TELEMETRY, TIMED = range(4)
"""Positions in ``build_variants``'s list."""
HOOKS = ("on_backward", "after_unscale", "before_optimizer_step", "after_step", "_check_inputs")


@dataclass
class Variant:
    name: str
    step: Callable[[int, torch.Tensor], None] | None
    note: str = ""
    times: list[float] = field(default_factory=list)
    close: Callable[[], None] = lambda: None
    hook_time: dict[str, list[float]] = field(default_factory=dict)
    """CPU seconds inside each telemetry hook, per step (flushes included)."""


def _time_hooks(tel: ampkit.Telemetry) -> dict[str, list[float]]:
    """Wrap the hooks of ``tel`` to add their thread CPU time to the last entry of each hook's list."""
    per_step: dict[str, list[float]] = {name: [] for name in HOOKS}
    for name in HOOKS:
        inner, acc = getattr(tel, name), per_step[name]

        def timed(*args: object, _inner: Callable[..., None] = inner, _acc: list[float] = acc) -> None:
            t0 = time.thread_time()
            _inner(*args)
            if _acc:
                _acc[-1] += time.thread_time() - t0

        setattr(tel, name, timed)
    return per_step


def _engine_step(model: GPT, telemetry: object = None) -> Callable[[int, torch.Tensor], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=telemetry)
    mp.prepare(model)

    def step(i: int, batch: torch.Tensor) -> None:
        with mp.autocast():
            loss = GPT.loss(model(batch[:, :-1]), batch[:, 1:])
        mp.backward(loss)
        mp.step(opt)

    return step


def build_variants(base: GPT, tmp: Path, *, compare: bool) -> list[Variant]:
    variants = [Variant("engine alone (baseline)", _engine_step(copy.deepcopy(base))),
                # The same engine again: its paired ratio against the baseline is what two identical
                # variants read on this machine (memory placement, turn order), the resolution of the others.
                Variant("engine alone again (control)", _engine_step(copy.deepcopy(base)))]
    tel = ampkit.Telemetry(sinks=[ampkit.JsonlSink(tmp / "telemetry.jsonl")], flush_every=50)
    variants.append(Variant("ampkit Telemetry (flush_every=50, default alarms, JSONL)",
                            _engine_step(copy.deepcopy(base), tel), close=tel.close))
    timed_tel = ampkit.Telemetry(sinks=[ampkit.JsonlSink(tmp / "timed.jsonl")], flush_every=50)
    hook_time = _time_hooks(timed_tel)
    inner = _engine_step(copy.deepcopy(base), timed_tel)

    def timed_step(i: int, batch: torch.Tensor) -> None:
        for acc in hook_time.values():
            acc.append(0.0)
        inner(i, batch)

    variants.append(Variant("the same, hooks timed", timed_step, close=timed_tel.close, hook_time=hook_time))
    if compare:
        variants.extend(_compared(base, tmp))
    return variants


def _compared(base: GPT, tmp: Path) -> list[Variant]:
    tel = ampkit.Telemetry(sinks=[], flush_every=50, module_absmax_every=10)
    variants = [Variant("ampkit Telemetry + module absmax every 10 steps",
                        _engine_step(copy.deepcopy(base), tel), close=tel.close)]
    try:
        from mixed_precision_nanny import MixedPrecisionNanny
    except ImportError as e:
        variants.append(Variant("MixedPrecisionNanny", None, note=f"not installed ({e}); pip install mixed-precision-nanny"))
    else:
        model = copy.deepcopy(base)
        with contextlib.redirect_stdout(io.StringIO()):
            nanny = MixedPrecisionNanny(model, output_dir=str(tmp / "nanny"))
        inner = _engine_step(model)
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
        variants.append(Variant("transformers DebugUnderflowOverflow (defaults)", _engine_step(model)))
    return variants


def run(config: GPTConfig, steps: int, warmup: int, *, compare: bool = False, seed: int = 0) -> list[Variant]:
    """Train every variant ``warmup + steps`` steps, interleaved; ``times`` holds the measured steps."""
    torch.manual_seed(seed)
    base = GPT(config)
    data = torch.randint(0, config.vocab_size, (warmup + steps, BATCH, config.block_size + 1))
    with tempfile.TemporaryDirectory() as tmp:
        variants = build_variants(base, Path(tmp), compare=compare)
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
        for v in variants:  # the hook times of the warm-up steps are left out too
            v.hook_time = {name: acc[warmup:] for name, acc in v.hook_time.items()}
    return variants


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def table(variants: list[Variant]) -> str:
    base = variants[BASELINE].times
    lines = [
        "| variant | median step ms | paired ratio q1 / median / q3 | added µs/step (median of differences) "
        "| mean ratio | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for v in variants:
        if not v.times:
            lines.append(f"| {v.name} | - | - | - | - | {v.note} |")
            continue
        q1, paired, q3 = quartiles([t / b for t, b in zip(v.times, base)])
        added = statistics.median([t - b for t, b in zip(v.times, base)])
        mean_ratio = statistics.fmean(v.times) / statistics.fmean(base)
        lines.append(f"| {v.name} | {statistics.median(v.times) * 1e3:.1f} | {q1:.3f} / {paired:.3f} / {q3:.3f} "
                     f"| {added * 1e6:+.0f} | {mean_ratio:.3f} | {v.note} |")
    return "\n".join(lines)


def hook_summary(timed: Variant, base_median: float) -> str:
    per = timed.hook_time
    total = [sum(vals) for vals in zip(*per.values())]
    parts = ", ".join(f"{name} {statistics.median(vals) * 1e6:.0f}" for name, vals in per.items())
    return (f"time inside the telemetry hooks (thread CPU time): median {statistics.median(total) * 1e6:.0f} µs/step "
            f"= {statistics.median(total) / base_median:.2%} of the baseline median step, mean with flushes and "
            f"sampled counts {statistics.fmean(total) * 1e6:.0f} µs/step = {statistics.fmean(total) / base_median:.2%}; "
            f"medians by hook (µs): {parts}")


def environment() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    isa = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}
    return (f"torch {torch.__version__}, ampkit from {Path(ampkit.__file__).parent}, {cpu}, "
            f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()} {isa or '(native)'}")


def load() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="gpt30,tinygpt", help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per variant and round (>= 30)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the measurement (fresh models each round)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--compare", action="store_true", help="add module absmax and third-party monitors (tinygpt)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.steps < 30:
        parser.error("--steps must be >= 30 for a stable median")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [w for w in names if w not in WORKLOADS]:
        parser.error(f"--workloads: unknown {unknown}; choose from {', '.join(WORKLOADS)}")
    # MixedPrecisionNanny's full backward hooks warn on modules whose inputs need no grad (the embeddings).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    print(environment())
    for name in names:
        config = WORKLOADS[name]
        ratios: list[float] = []
        control: list[float] = []
        added: list[float] = []
        round_medians: list[float] = []
        for r in range(args.rounds):
            before = load()
            variants = run(config, args.steps, args.warmup, compare=args.compare and name == "tinygpt", seed=r)
            base = variants[BASELINE].times
            pairs = [t / b for t, b in zip(variants[TELEMETRY].times, base)]
            ratios += pairs
            control += [t / b for t, b in zip(variants[CONTROL].times, base)]
            added += [t - b for t, b in zip(variants[TELEMETRY].times, base)]
            round_medians.append(statistics.median(pairs))
            print(f"\n## {name} ({config}), batch {BATCH}, round {r + 1}/{args.rounds}: {args.steps} steps after "
                  f"{args.warmup} warm-up, interleaved; load average before {before}, after {load()}")
            print(table(variants))
            print(hook_summary(variants[TIMED], statistics.median(base)))
        q1, med, q3 = quartiles(ratios)
        print(f"\n{name}: telemetry / engine alone, median of all paired ratios {med:.4f} (quartiles {q1:.4f}-{q3:.4f}, "
              f"target <= 1.01); added {statistics.median(added) * 1e6:+.0f} µs/step; round medians "
              f"{', '.join(f'{m:.4f}' for m in round_medians)}; the control (the engine alone again) reads "
              f"{statistics.median(control):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
