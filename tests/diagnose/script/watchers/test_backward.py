"""The backward watcher."""

from __future__ import annotations

import torch
from torch import nn

from diagnose.script.observe import observe


def test_doctor_observers_no_loss_scaling_fix_points_at_the_scaler_the_script_has() -> None:
    def loop(scaler_present: bool) -> None:
        model = nn.Linear(4, 2)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(3, 4)).float().pow(2).mean()
        (scaler.scale(loss) if scaler_present else loss).backward()

    [with_scaler] = [f for f in observe(lambda: loop(True)).ledger.findings() if f.code == "NO_LOSS_SCALING"]
    [without] = [f for f in observe(lambda: loop(False)).ledger.findings() if f.code == "NO_LOSS_SCALING"]
    assert "that GradScaler is off" in with_scaler.fix and "enabled=True" in with_scaler.fix
    assert without.fix.startswith("scale the loss: `scaler = torch.amp.GradScaler(device)`")
