"""The backward watcher."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from ampkit.diagnose.script.watchers.backward import BackwardWatch
from ampkit.findings import loss_in_low_precision
from diagnose.script.observe import observe
from diagnose.script.watchers.alone import watching

HERE = Path(__file__).relative_to(Path.cwd())


def test_doctor_observers_no_loss_scaling_fix_points_at_the_scaler_the_script_has() -> None:
    def loop(scaler_present: bool) -> None:
        model = nn.Linear(4, 2)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(3, 4)).float().pow(2).mean()
        (scaler.scale(loss) if scaler_present else loss).backward()

    [with_scaler] = [f for f in observe(lambda: loop(True)).state.ledger.findings() if f.code == "NO_LOSS_SCALING"]
    [without] = [f for f in observe(lambda: loop(False)).state.ledger.findings() if f.code == "NO_LOSS_SCALING"]
    assert "that GradScaler is off" in with_scaler.fix and "enabled=True" in with_scaler.fix
    assert without.fix.startswith("scale the loss: `scaler = torch.amp.GradScaler(device)`")
    for f in (with_scaler, without):  # the whole-model view, with the recommended initial scale
        assert f.fix.endswith("`ampkit preflight --precision fp16 TARGET`.") and "init_scale" in f.fix


def test_backward_watch_alone_judges_the_loss_and_fails_a_nonfinite_one() -> None:
    model = nn.Linear(4, 2)
    with watching(BackwardWatch) as w:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(3, 4)).pow(2).mean()  # an fp16 scalar, and no loss scaling
        line = sys._getframe().f_lineno + 1
        loss.backward()
        (model(torch.randn(3, 4)).sum() * float("inf")).backward()  # fp32, non-finite
        codes = w.codes()
    assert sorted(codes) == ["LOSS_IN_LOW_PRECISION", "NO_LOSS_SCALING"]
    for f in w.state.ledger.findings():
        assert f.location == f"{HERE}:{line}" and f.step == 1
    low = w.state.ledger.findings()[codes.index("LOSS_IN_LOW_PRECISION")]
    assert low.evidence["loss_dtype"] == "fp16"
    assert (low.message, low.fix) == loss_in_low_precision(torch.float16)  # the one wording of every emitter
    assert w.state.loss_nonfinite == {1}
    assert [(f.kind, f.step, f.cause) for f in w.failures] == [("nonfinite_loss", 1, "nonfinite_loss")]
    assert w.state.scalers.backwards_since_update == 2
