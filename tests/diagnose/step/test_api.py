"""Backward overflow: attributed to the forward module, judged against the loss scale."""

from __future__ import annotations

import torch
from torch import nn

from ampkit.diagnose.step.api import diagnose_step


class Amplifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lin(x))  # LINE: amplifier-forward


def _run(x: torch.Tensor, gain: float):
    def run(model: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        return out.float().mean() * gain

    return run


def test_backward_overflow_at_high_scale_is_ordinary_dynamic_scaling() -> None:
    model = Amplifier()
    result = diagnose_step(model, _run(torch.randn(4, 16), 1.0), precision="fp16", loss_scale=2.0**24, bisect=False)
    (f,) = [f for f in result.findings if f.code == "BACKWARD_OVERFLOW"]
    assert f.severity == "info"
    assert not f.evidence["overflows_at_scale_1"]
    safe = f.evidence["max_safe_scale"]
    assert 1.0 < safe < 2.0**24
    # The safe scale really is safe, and twice the largest unscaled gradient's headroom is not needed.
    again = diagnose_step(model, _run(torch.randn(4, 16), 1.0), precision="fp16", loss_scale=safe, bisect=False)
    assert not [g for g in again.findings if g.code == "BACKWARD_OVERFLOW"]


def test_backward_overflow_at_any_scale_is_an_error_with_forward_attribution() -> None:
    model = Amplifier()
    with torch.no_grad():
        model.head.weight.fill_(30.0)
        model.lin.weight.fill_(30.0)
    # d(loss)/d(out) = 3e4 / 4 per sample: fp16 activations' gradients exceed 65504 even unscaled.
    result = diagnose_step(model, _run(torch.randn(4, 16) * 0.01, 3e4), precision="fp16", loss_scale=4.0,
                           bisect=False)
    errors = [f for f in result.findings if f.severity == "error"]
    assert [f.code for f in errors] == ["BACKWARD_OVERFLOW"]
    f = errors[0]
    assert f.evidence["overflows_at_scale_1"] is True
    assert f.module == "head"  # the backward of head's matmul produces the first inf
    assert f.evidence["forward_op"] == "aten::addmm"
    with open(__file__) as fh:
        line = next(i for i, text in enumerate(fh, 1) if "LINE: amplifier-forward" in text)
    assert f.location is not None and f.location.endswith(f":{line}")


def test_backward_overflow_without_scaling_is_an_error() -> None:
    model = Amplifier()
    with torch.no_grad():
        model.head.weight.fill_(30.0)
        model.lin.weight.fill_(30.0)
    result = diagnose_step(model, _run(torch.randn(4, 16) * 0.01, 3e4), precision="fp16", bisect=False)
    (f,) = [f for f in result.findings if f.code == "BACKWARD_OVERFLOW"]
    assert f.severity == "error" and "no loss scaling" in f.message
