"""The loss-side trace: the first op between a model's output and the loss that turns finite values
into inf/NaN decides the finding (FORWARD_OVERFLOW at the op that made the inf, not FORWARD_NAN at
the op that later made NaN of it), with its op and line although no module runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch.nn import functional as F

from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.losstrace import LossSideTrace, explain_nan

# A contrastive loss: the similarity matrix overflows fp16 (|sim| > 65504), then subtracting the row
# maximum turns inf - inf into NaN, and the loss is NaN; the encoder's outputs stay finite.
SCRIPT = """
    import torch
    from torch import nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
    opt = torch.optim.SGD(enc.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for step in range({steps}):
        x = torch.randn(8, 16) * ({scale_expr})
        with torch.autocast("cpu", dtype=torch.float16):
            z = enc(x)  # MODEL
            sim = z @ z.T  # SIMILARITY
            sim = sim - sim.max(dim=-1, keepdim=True).values  # NAN FROM INF
            loss = F.cross_entropy(sim.float(), torch.arange(8))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
"""


def _line(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if marker in text)


def _all_findings(tmp_path: Path, source: str) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "ampkit.cli.main", "doctor", "--json", str(out), str(script)],
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text())["findings"]


def _doctor(tmp_path: Path, source: str) -> list[dict]:
    return [f for f in _all_findings(tmp_path, source) if f["code"].startswith("FORWARD_")]


def test_losstrace_first_bad_value_decides_the_code_and_names_the_op_and_line(tmp_path: Path) -> None:
    source = textwrap.dedent(SCRIPT.format(steps=6, scale_expr="300"))
    (finding,) = _doctor(tmp_path, source)
    assert finding["code"] == "FORWARD_OVERFLOW" and finding["severity"] == "error"
    assert "matmul" in finding["op"] and finding["module"] is None
    assert finding["location"] == f"{tmp_path / 'train.py'}:{_line(source, 'SIMILARITY')}"
    assert "the first non-finite value" in finding["message"] and finding["step"] == 1


def test_losstrace_names_the_op_of_an_overflow_on_one_batch_only(tmp_path: Path) -> None:
    # Only the third batch overflows: the next step is clean, so the failing step's own loss-side calls
    # (its tape) must name the op, on the failing batch itself.
    source = textwrap.dedent(SCRIPT.format(steps=6, scale_expr="300 if step == 2 else 1"))
    (finding,) = _doctor(tmp_path, source)
    assert finding["code"] == "FORWARD_OVERFLOW" and "matmul" in finding["op"] and finding["step"] == 3
    assert finding["location"] == f"{tmp_path / 'train.py'}:{_line(source, 'SIMILARITY')}"
    assert finding["evidence"]["traced_step"] == 3 and "of that step itself" in finding["message"]


def test_losstrace_names_the_op_of_an_overflow_on_the_last_step(tmp_path: Path) -> None:
    # No step follows to trace: the last step's own calls name the op.
    source = textwrap.dedent(SCRIPT.format(steps=4, scale_expr="300 if step == 3 else 1"))
    (finding,) = _doctor(tmp_path, source)
    assert finding["code"] == "FORWARD_OVERFLOW" and "matmul" in finding["op"]
    assert finding["location"] == f"{tmp_path / 'train.py'}:{_line(source, 'SIMILARITY')}"


def test_losstrace_records_the_inf_maker_not_the_nan_maker() -> None:
    a = torch.full((2, 2), 300.0, dtype=torch.float16)
    trace = LossSideTrace(UserFrames([Path(__file__).parent]), lambda: False)
    with trace:
        sim = a @ a  # 180000: beyond fp16
        _ = sim - sim  # inf - inf = NaN
    assert trace.first is not None and "matmul" in trace.first.op
    assert not trace.first.nan and trace.first.out_dtype == "fp16" and trace.first.in_absmax == 300.0
    assert trace.first.location is not None and trace.first.location.endswith(f":{_line(Path(__file__).read_text(), '180000')}")


def test_losstrace_stops_at_the_backward() -> None:
    # After the loss's backward, non-finite gradients and the step's reads of them are not loss code.
    w = torch.ones(2, requires_grad=True)
    trace = LossSideTrace(UserFrames([Path(__file__).parent]), lambda: False)
    with trace:
        torch.sqrt(w - 1).sum().backward()  # a finite loss (0); d sqrt(x)/dx at 0 is inf
        assert w.grad is not None and torch.isinf(w.grad).all()  # read through Tensor.grad.__get__
        _ = w.grad * 2
    assert trace.stopped and trace.first is None


def test_losstrace_names_the_cause_of_a_nan_from_the_aten_op_inside_the_call() -> None:
    # F.normalize of an all-zero row in fp16: its eps (1e-12) is 0 in fp16, so the division inside is 0/0.
    x = torch.zeros(2, 4, dtype=torch.float16)
    x[1] = 1.0
    trace = LossSideTrace(UserFrames([Path(__file__).parent]), lambda: False)
    with trace:
        _ = F.normalize(x, dim=-1)
    assert trace.first is not None and trace.first.nan and trace.first.op == "torch::nn.functional.normalize"
    assert trace.first.cause == "zero_over_zero" and trace.first.nan_in_fp32 is False


def test_explain_nan_tells_precision_from_a_bug_and_leaves_the_rng_and_arguments_alone() -> None:
    negative = torch.tensor([-1.0, 4.0], dtype=torch.float16)
    assert explain_nan(torch.sqrt, (negative,), {}) == ("negative_domain", True)  # fp32 makes it too
    before = torch.get_rng_state()
    assert explain_nan(F.dropout, (torch.tensor([float("inf"), 0.0]) * 0,), {"p": 0.5})[0] != "zero_over_zero"
    assert torch.equal(torch.get_rng_state(), before)
    target = torch.zeros(2)
    assert explain_nan(torch.Tensor.div_, (target, torch.zeros(2)), {}) == ("other", None)  # writes: not re-run
    assert torch.equal(target, torch.zeros(2))


# bf16 without a scaler: 1 - 1e-6 is 1.0 in bf16, so the clamp lets a saturated probability through and
# log1p(-1) = -inf; a where discards it (the loss is finite) but its backward is 0 * inf = NaN, and the
# unguarded step writes NaN into both models, so every later step's second model gets NaN inputs.
HIDDEN = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    enc = nn.Linear(8, 8)
    scorer = nn.Linear(8, 1)
    with torch.no_grad():
        scorer.weight.fill_(3.0)
    opt = torch.optim.SGD([*enc.parameters(), *scorer.parameters()], lr=0.01)
    for step in range(4):
        x = torch.randn(16, 8) + 2.0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p = torch.sigmoid(scorer(enc(x))).squeeze(-1)
            log_rest = torch.log1p(-p.clamp(max=1.0 - 1e-6))  # CLAMP BOUND
            loss = torch.where(p > 0.5, -torch.log(p), -log_rest).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


def test_losstrace_names_a_hidden_forward_inf_as_the_root_of_a_gradient_overflow(tmp_path: Path) -> None:
    source = textwrap.dedent(HIDDEN)
    findings = _all_findings(tmp_path, source)
    errors = [f for f in findings if f["severity"] == "error"]
    (root,) = errors
    assert root["code"] == "FORWARD_OVERFLOW" and root["op"] == "torch::log1p" and root["step"] == 1
    assert root["location"] == f"{tmp_path / 'train.py'}:{_line(source, 'CLAMP BOUND')}"
    assert "0 × inf" in root["message"] and root["evidence"]["loss_finite"] is True
    assert [c["code"] for c in root["evidence"]["consequences"]] == ["NONFINITE_INPUT"] * 3
