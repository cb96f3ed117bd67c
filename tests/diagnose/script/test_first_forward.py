"""The first bad value decides, across models: when a frozen teacher's forward (no gradients) goes
non-finite before the student's, the teacher's forward is replayed and its op is the finding, an
error, not a NaN "between the model and the loss"."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = """
    import torch
    from torch import nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).requires_grad_(False)
    with torch.no_grad():
        teacher[2].weight.mul_(1e5)  # 1e5 * |tanh| <= 1e5 * 16: beyond fp16 (65504)
    student = nn.Linear(8, 4)
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(4):
        x = torch.randn(16, 8)
        with torch.autocast("cpu", dtype=torch.float16):
            with torch.no_grad():
                soft = teacher(x)  # TEACHER
            logits = student(x)
            loss = F.kl_div(F.log_softmax(logits.float(), -1), F.softmax(soft.float(), -1), reduction="batchmean")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""


def test_a_frozen_teachers_overflow_is_found_in_the_teacher(tmp_path: Path) -> None:
    script = tmp_path / "distill.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "ampkit.cli.main", "doctor", "--json", str(out), str(script)],
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout + proc.stderr
    findings = [f for f in json.loads(out.read_text())["findings"] if f["code"].startswith("FORWARD_")]
    overflow = [f for f in findings if f["code"] == "FORWARD_OVERFLOW"]
    assert overflow and overflow[0]["module"] == "teacher.2" and overflow[0]["severity"] == "error", findings
    assert "keep_fp32=['2']" in overflow[0]["fix"] and "relative to teacher" in overflow[0]["fix"]
    assert not any("between the model and the loss" in f["message"] for f in findings)
