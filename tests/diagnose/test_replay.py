"""``diagnose.replay.replay``: one replay of a captured forward, with the same care for every doctor."""

from __future__ import annotations

import torch
from torch import nn

import ampkit
from ampkit.diagnose.capture import CaptureHooks
from ampkit.diagnose.replay import replay
from ampkit.precision import Precision


def _train_live(model: nn.Module, batches: list[torch.Tensor]) -> ampkit.MixedPrecision:
    mp = ampkit.MixedPrecision("bf16", device="cpu", doctor=True)
    mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        mp.backward(loss)
        mp.step(opt)
    return mp


def test_replay_live_starts_from_the_running_stats_before_the_step() -> None:
    """The failing step's own forward wrote NaN into the BatchNorm statistics: the replay says this step
    made them non-finite, not that an earlier step did."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    batches = [torch.randn(4, 8) for _ in range(3)]
    batches[1][1, 3] = float("nan")
    mp = _train_live(model, batches)
    norm = [f for f in mp.doctor.findings if f.code == "NORM_STATS_NONFINITE"]
    assert [(f.step, f.module, f.evidence.get("buffers")) for f in norm] == [(2, "1", ["1.running_mean", "1.running_var"])]


def test_replay_live_inference_mode_input_keeps_the_fp32_shadow() -> None:
    """A batch made under ``torch.inference_mode`` (a loader's) trains fine under autocast, whose cast makes
    a normal tensor; the fp32 shadow uses the batch itself and must get a normal copy of it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.inference_mode():
        batches = [torch.randn(4, 8) for _ in range(3)]
        batches[1][1, 3] = float("nan")
    mp = _train_live(model, batches)
    assert len(mp.doctor.results) == 1
    assert "shadow_unavailable" not in mp.doctor.results[0].comparison


def test_replay_puts_the_models_running_stats_back() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    hooks = CaptureHooks()
    hooks.add_root(model)
    before = model[1].running_mean.clone()
    model(torch.randn(8, 4)).sum().backward()
    after = model[1].running_mean.clone()
    (cap,) = hooks.new_window()
    replay(cap, Precision.parse("bf16", torch.device("cpu")), shadow=False, bisect=False)
    assert not torch.equal(before, after) and torch.equal(model[1].running_mean, after)


def test_replay_runs_outside_the_callers_inference_mode_and_autocast() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    hooks = CaptureHooks()
    hooks.add_root(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(8, 4))
    out.float().pow(2).mean().backward()
    (cap,) = hooks.new_window()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
        result = replay(cap, Precision.parse("bf16", torch.device("cpu")), bisect=False)
    assert result.precision == "bf16" and result.findings == [] and "shadow_unavailable" not in result.comparison
