"""The checkpoint watcher (torch.save / torch.load)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ampkit.diagnose.script.watchers.io import checkpoint_contents
from diagnose.script.observe import observe


def test_doctor_observers_checkpoint_contents_recognises_states() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert checkpoint_contents(model.state_dict()) == {"model"}
    assert checkpoint_contents({"m": model.state_dict(), "o": opt.state_dict()}) == {"model", "optimizer"}
    assert checkpoint_contents({"ckpt": {"o": opt.state_dict(), "s": scaler.state_dict()}}) == {"optimizer", "scaler"}
    assert checkpoint_contents([model, opt, scaler]) == {"model", "optimizer", "scaler"}
    assert checkpoint_contents({"step": 3, "lr": 0.1}) == set()


def test_doctor_observers_resume_without_scaler_state_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

    def resume() -> None:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(1, 2)).float().sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    [finding] = [f for f in observe(resume).ledger.findings() if f.code == "CHECKPOINT_MISSING_SCALER"]
    assert "no GradScaler state" in finding.message
    assert finding.location is not None and finding.location.endswith(f":{resume.__code__.co_firstlineno + 1}")
