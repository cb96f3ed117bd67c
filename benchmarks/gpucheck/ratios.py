"""Section ``ratios``: what ampkit costs per step on the device, side by side in one process.

Four copies of one GPT (12 x 768, 16 x 512 tokens a step, fp16, fused AdamW, clipping at 1.0)
train on the same batches, one step each per round in a rotating order, each step timed from a
synchronised device to a synchronised device; medians after warm-up:

* ``recipe``: the hand-written torch.amp recipe;
* ``bare``: ``MixedPrecision("fp16")``;
* ``telemetry``: the engine with ``Telemetry`` (flush every 50 steps, a list sink, default alarms);
* ``doctor``: the engine with ``doctor=True`` (the always-on capture).

Ratios: bare / recipe, telemetry / bare, doctor / bare.  Then the doctor's engine replays its last
step fully instrumented (``mp.doctor.replay()``), timed once, against the median bare step: reported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_engine import engine_step, recipe_step

import ampkit
from gpucheck.checks import Check, check, median_ratio, timed
from gpucheck.models import gpt, gpt_batches

__all__ = ["run"]

STEPS, WARMUP = 60, 10


def _arms(device: torch.device, tiny: bool, batches: list[Any]) -> tuple[dict[str, Callable[[], None]], dict[str, Any]]:
    base = gpt(tiny).to(device)
    models = {name: copy.deepcopy(base) for name in ("recipe", "bare", "telemetry", "doctor")}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for name, m in models.items()}
    records: list[dict[str, Any]] = []
    engines = {
        "bare": ampkit.MixedPrecision("fp16", device=device, clip_grad_norm=1.0),
        "telemetry": ampkit.MixedPrecision("fp16", device=device, clip_grad_norm=1.0,
                                           telemetry=ampkit.Telemetry(sinks=[records.append], flush_every=50)),
        "doctor": ampkit.MixedPrecision("fp16", device=device, clip_grad_norm=1.0, doctor=True),
    }
    for name, mp in engines.items():
        mp.prepare(models[name])
    scaler = torch.amp.GradScaler(device.type)
    cursor = dict.fromkeys(models, 0)

    def arm(name: str) -> Callable[[], None]:
        def step() -> None:
            x, y = batches[cursor[name] % len(batches)]
            cursor[name] += 1
            if name == "recipe":
                recipe_step(models[name], opts[name], scaler, torch.float16, x, y, 1.0)
            else:
                engine_step(models[name], opts[name], engines[name], x, y)
        return step

    return {name: arm(name) for name in ("bare", "recipe", "telemetry", "doctor")}, engines


def run(device: torch.device, *, tiny: bool) -> Iterator[Check]:
    batches = gpt_batches(tiny, 16, device)
    arms, engines = _arms(device, tiny, batches)
    m = median_ratio(device, arms, STEPS, WARMUP)
    ms = m["median_ms"]
    for key, arm, base in (("engine_vs_recipe", "bare", "recipe"), ("telemetry_vs_bare", "telemetry", "bare"),
                           ("doctor_vs_bare", "doctor", "bare")):
        ratio = ms[arm] / ms[base]
        yield check(f"ratios.{key}", f"{arm} / {base}", round(ratio, 4),
                    f"median {ms[arm]:.3f} ms vs {ms[base]:.3f} ms over {STEPS} steps after {WARMUP} warm-up",
                    median_ms={arm: ms[arm], base: ms[base]}, steps=STEPS, warmup=WARMUP)
    doctor = engines["doctor"].doctor
    seconds = timed(device, lambda: doctor.replay("manual"))
    yield check("ratios.replay_vs_step", "one full replay / one bare step", round(seconds * 1e3 / ms["bare"], 2),
                f"replay {seconds:.2f} s vs a bare step of {ms['bare']:.3f} ms",
                replay_s=seconds, step_ms=ms["bare"], findings=[f.code for f in doctor.findings])
