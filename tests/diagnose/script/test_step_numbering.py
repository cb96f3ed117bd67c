"""The doctor and telemetry number optimizer steps the same way: step N is the N-th optimizer step,
counted from 1."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from ampkit.diagnose.script.runner import run_script

# fp16 through ampkit's engine with a telemetry JSONL; the 4th optimizer step gets a batch holding inf.
SCRIPT = """
    import sys
    import torch
    from torch import nn
    import ampkit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mp = ampkit.MixedPrecision("fp16", device="cpu", telemetry=sys.argv[1])
    mp.prepare(model)
    for i in range(6):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        if i == 3:
            x[1, 2] = float("inf")
        with mp.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        mp.step(opt)
    mp.close()
"""


def test_doctor_step_numbering_matches_telemetry_for_the_failing_step(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    jsonl = tmp_path / "telemetry.jsonl"
    report = run_script(script, [str(jsonl)], measure_speed=False)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    failing = [r["step"] for r in records if r["loss_nonfinite"]]
    assert failing == [4]
    found = {f.code: f for f in report.findings}
    assert found["NONFINITE_INPUT"].step == failing[0]
    assert f"at step {failing[0]}," in found["NONFINITE_INPUT"].message
    assert report.steps == 6
