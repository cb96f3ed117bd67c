"""The GradScaler watcher."""

from __future__ import annotations

import pytest
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


def test_doctor_observers_scaler_records_how_it_was_built_and_why_it_is_off() -> None:
    def build() -> None:
        torch.amp.GradScaler("cpu")
        torch.amp.GradScaler("cpu", enabled=False)
        with pytest.warns(FutureWarning):
            torch.cuda.amp.GradScaler()

    infos = observe(build).scalers.infos
    assert [i.built_as for i in infos] == ["torch.amp.GradScaler", "torch.amp.GradScaler", "torch.cuda.amp.GradScaler"]
    cuda_off = None if torch.cuda.is_available() else "no_cuda"
    assert [i.off_reason() for i in infos] == [None, "enabled_false", cuda_off]
