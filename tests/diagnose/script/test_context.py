"""The script doctor's context: sampling and failure classification."""

from __future__ import annotations

import torch
from torch import nn

from ampkit.diagnose.script.state import Sampler
from diagnose.script.observe import observe


def test_doctor_observers_sampler_is_dense_after_an_event() -> None:
    s = Sampler(warmup=1, period=100, after_event=2)
    assert [i for i in range(10) if s.dense(i)] == [0]
    s.boost(5)
    assert [i for i in range(10) if s.dense(i)] == [0, 5, 6, 7]


def test_doctor_observers_count_skips_and_classify_the_cause() -> None:
    def loop() -> None:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(18):
            x = torch.randn(2, 4)
            x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    ctx = observe(loop)
    assert len(ctx.state.skips) == 18 and set(ctx.state.skips.values()) == {"nonfinite_data"}
    collapse = [f for f in ctx.state.ledger.findings() if f.code == "SCALE_COLLAPSE"]
    assert collapse and collapse[0].evidence["cause"] == "nonfinite_data"
    assert collapse[0].evidence["min_scale"] == 2.0**16 / 2**18
    assert any(f.code == "NONFINITE_INPUT" and f.evidence["samples"] == [0] for f in ctx.state.ledger.findings())
