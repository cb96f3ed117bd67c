"""The model watcher: captures each forward and the full gradient that reached its output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ampkit.diagnose.script.runner import run_script

PARTIAL_GRADIENT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
x = torch.randn(2, 4)
for _ in range(2):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = out.float().sum() + 2 * out.sum().float()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_model_watch_seeds_the_replay_with_the_full_output_gradient(
    tmp_path: Path, replay_seeds: list[list[Any]]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(PARTIAL_GRADIENT)
    run_script(script, bisect=False, measure_speed=False)
    assert replay_seeds, "the checkup replay did not run"
    (grad,) = replay_seeds[0]
    # out feeds the loss through a cast (gradient 1.0) and through out.sum() (gradient 2.0)
    assert torch.equal(grad.float(), torch.full((2, 3), 3.0))


DEEPCOPY_AFTER_FORWARD = """
import copy
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(4, 4)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    ema = copy.deepcopy(model)  # after forwards the doctor watched: its hooks come along
    with torch.no_grad():
        ema(torch.randn(2, 4))
"""


def test_model_watch_survives_a_deepcopy_of_a_watched_model(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(DEEPCOPY_AFTER_FORWARD)
    report = run_script(script, bisect=False, measure_speed=False)
    assert report.exit_status == 0 and report.steps == 3
