"""The GradScaler watcher."""

from __future__ import annotations

import torch
from torch import nn

from diagnose.script.observe import observe


def test_doctor_observers_clip_after_unscale_is_clean_and_before_is_not() -> None:
    def loop(unscale_first: bool) -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(3, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if unscale_first:
                scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    bad = observe(lambda: loop(False))
    good = observe(lambda: loop(True))
    assert [f.code for f in bad.ledger.findings()] == ["CLIP_BEFORE_UNSCALE"]
    assert good.ledger.findings() == []
    assert bad.iteration == good.iteration == 2
