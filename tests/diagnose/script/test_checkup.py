"""The end-of-run fp32 checkup: it runs after an inference-mode pass, and a checkup that could not
run says so in the terminal summary, the JSON (``checkup``) and the HTML page."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import jsonschema
import pytest

from ampkit.cli.main import main
from ampkit.diagnose.script.runner import run_script

SCHEMA = json.loads((Path(__file__).parents[3] / "src/ampkit/schemas/doctor.schema.json").read_text())

# bf16 training, then an eval pass under torch.inference_mode: its batch is an inference tensor,
# and the LayerNorm (fp32 under autocast) would save it for backward in the replay.
TRAIN_THEN_INFER = """
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 8))
"""

# The script changes its model after the last step: a replay of that step on the model as it is now raises.
CHANGED_AFTER_TRAINING = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)
            self.gain = 1.0

        def forward(self, x):
            return self.lin(x) * self.gain

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.gain = None
"""

# An explicit bf16 cast in the forward: the fp32 copy multiplies bf16 by fp32 and raises.
EXPLICIT_CAST = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 1))

        def forward(self, x):
            return x.to(torch.bfloat16) @ self.w.to(torch.bfloat16) if torch.is_autocast_enabled("cpu") \\
                else x.to(torch.bfloat16) @ self.w

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def _write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def test_checkup_runs_on_a_step_captured_under_inference_mode(tmp_path: Path) -> None:
    report = run_script(_write(tmp_path / "train.py", TRAIN_THEN_INFER))
    assert [r.get("error") for r in report.replays] == [None]
    # the eval forward after 6 optimizer steps belongs to the step in progress, the 7th
    assert report.checkup == {"ran": True, "status": "ran", "step": 7, "precision": "bf16", "reason": None}
    assert report.diagnoses[-1].comparison.get("output_sqnr_db")  # compared with fp32, module by module


def test_checkup_that_could_not_run_shows_in_terminal_json_and_html(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    script = _write(tmp_path / "train.py", CHANGED_AFTER_TRAINING)
    rc = main(["doctor", "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"), str(script)])
    assert rc == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "the fp32 checkup of step" in summary and "could not run (TypeError:" in summary
    assert "this run was not compared with fp32" in summary
    doc = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    assert doc["checkup"]["ran"] is False and doc["checkup"]["status"] == "failed"
    assert doc["checkup"]["reason"].startswith("TypeError:")
    assert "fp32 checkup did not run" in (tmp_path / "r.html").read_text()


def test_checkup_whose_fp32_copy_cannot_run_is_not_reported_as_ran(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    script = _write(tmp_path / "train.py", EXPLICIT_CAST)
    assert main(["doctor", "--json", str(tmp_path / "r.json"), str(script)]) == 0
    assert "this run was not compared with fp32" in capsys.readouterr().out
    doc = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    assert (doc["checkup"]["ran"], doc["checkup"]["status"], doc["checkup"]["precision"]) == (False, "no_fp32", "bf16")
    assert "fp32 copy could not run the step" in doc["checkup"]["reason"]


def test_checkup_that_ran_is_recorded_with_its_step(tmp_path: Path) -> None:
    script = _write(tmp_path / "train.py", TRAIN_THEN_INFER.replace("model.eval()", "raise SystemExit(0)"))
    assert main(["doctor", "--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "r.html"), str(script)]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    jsonschema.validate(doc, SCHEMA)
    assert doc["checkup"] == {"ran": True, "status": "ran", "step": 6, "precision": "bf16", "reason": None}
    assert "fp32 checkup: step 6 replayed in bf16" in (tmp_path / "r.html").read_text()


def test_checkup_turned_off_is_recorded_as_skipped(tmp_path: Path) -> None:
    report = run_script(_write(tmp_path / "train.py", TRAIN_THEN_INFER), checkup=False)
    assert (report.checkup["ran"], report.checkup["status"]) == (False, "skipped")
    assert report.checkup["reason"] == "turned off (--no-checkup or --no-replay)"
