"""The checkpoint watcher (torch.save / torch.load)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampkit.diagnose.script.runner import run_script
from ampkit.diagnose.script.watchers.io import CheckpointWatch, checkpoint_contents
from diagnose.script.observe import observe
from diagnose.script.watchers.alone import watching

HERE = Path(__file__).relative_to(Path.cwd())
CASES = Path(__file__).resolve().parents[3] / "cases"


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

    [finding] = [f for f in observe(resume).state.ledger.findings() if f.code == "CHECKPOINT_MISSING_SCALER"]
    assert "no GradScaler state" in finding.message
    assert finding.location is not None and finding.location.endswith(f":{resume.__code__.co_firstlineno + 1}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the 'cuda' GradScaler is off only without CUDA")
def test_doctor_observers_checkpoint_without_the_state_of_a_scaler_off_here_is_latent_info(tmp_path: Path) -> None:
    def train(with_scaler_state: bool) -> None:
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")   # torch turns it off on this machine
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if with_scaler_state:
            state["scaler"] = scaler.state_dict()
        torch.save(state, tmp_path / "ckpt.pt")

    [latent] = [f for f in observe(lambda: train(False)).state.ledger.findings() if f.code == "CHECKPOINT_MISSING_SCALER"]
    assert latent.severity == "info" and latent.evidence["latent"] is True
    assert "disabled on this machine (no CUDA device)" in latent.message
    kept = observe(lambda: train(True)).state.ledger.findings()
    assert "CHECKPOINT_MISSING_SCALER" not in {f.code for f in kept}


def test_checkpoint_watch_alone_reports_a_resumable_checkpoint_without_the_scaler_at_the_end(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watching(CheckpointWatch) as w:
        w.state.scalers.info(torch.amp.GradScaler("cpu"))  # as the scaler watcher registers one
        torch.save({"model": model.state_dict()}, tmp_path / "weights.pt")  # not resumable: fine
        line = sys._getframe().f_lineno + 1
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
        torch.load(tmp_path / "ckpt.pt")
    assert w.codes() == []  # judged over the whole run, at finish
    w.watcher.finish()
    found = {f.location: f for f in w.state.ledger.findings()}
    assert set(found) == {f"{HERE}:{line}", f"{HERE}:{line + 1}"}
    assert all(f.code == "CHECKPOINT_MISSING_SCALER" for f in found.values())
    assert found[f"{HERE}:{line}"].evidence["contents"] == ["model", "optimizer"]


def test_doctor_observers_checkpoint_without_scaler_state_is_a_warning_so_a_run_that_succeeded_exits_0() -> None:
    # A resumed fp16 run restarts its loss scale at init_scale: a few skipped steps, not a wrong result.
    report = run_script(CASES / "checkpoint_without_scaler.py", checkup=False, measure_speed=False)
    [finding] = [f for f in report.findings if f.code == "CHECKPOINT_MISSING_SCALER"]
    assert finding.severity == "warning"
    assert report.exit_status == 0 and report.doctor_exit_status() == 0
