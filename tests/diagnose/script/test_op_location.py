"""Where a replayed op-level finding points: the user's line that runs the op, else the line that called the model."""

from __future__ import annotations

import textwrap
from pathlib import Path

from ampkit.diagnose.script.runner import run_script

_SEQUENTIAL_OVERFLOW = """\
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(3):
        x = torch.randn(4, 16)
        if step == 1:  # the first Linear overflows in fp16, GELU turns its -inf into NaN
            with torch.no_grad():
                model[0].weight.copy_(torch.sign(torch.randn(8, 16)) * 600.0)
            x = x.sign() * 200.0
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = out.float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""


def test_replayed_forward_findings_of_builtin_modules_name_the_forward_line_not_the_scaler_step(
        tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SEQUENTIAL_OVERFLOW))
    report = run_script(script, checkup=False, measure_speed=False)
    (f,) = [f for f in report.findings if f.code == "FORWARD_OVERFLOW"]
    assert f.module == "0" and f.op == "aten::addmm"
    assert f.location is not None and f.location.endswith("train.py:15")  # out = model(x), not scaler.step (:18)
    birth = f.evidence["nan_birth"]
    assert birth["op"] == "aten::gelu" and birth["location"].endswith("train.py:15")
