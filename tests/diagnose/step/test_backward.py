"""BACKWARD_OVERFLOW: derivative singularities that overflow at any scale, told apart from real overflows."""

from __future__ import annotations

import torch
from torch import nn

from ampkit.diagnose.step.api import diagnose_step
from diagnose import doctor_models as dm


class Turn(nn.Module):
    """The angle between consecutive unit vectors; nearly parallel ones give a cosine of 1.0 in fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.direction = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.direction(x)
        v = v / (v * v).sum(-1, keepdim=True).sqrt()
        return torch.acos((v[1:] * v[:-1]).sum(-1).clamp(-1.0, 1.0))


def _fp16_mean(x: torch.Tensor):
    def run(model: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        return out.float().mean()

    return run


def _only_error(result):
    errors = [f for f in result.findings if f.severity == "error"]
    assert [f.code for f in errors] == ["BACKWARD_OVERFLOW"], [(f.code, f.message) for f in result.findings]
    return errors[0]


def test_backward_finding_sqrt_at_an_underflowed_zero_overflows_at_any_scale() -> None:
    result = diagnose_step(dm.PairDistance(), _fp16_mean(torch.randn(5, 4)), precision="fp16", loss_scale=2.0**16,
                           bisect=False)
    f = _only_error(result)
    assert f.module == ""  # the sqrt runs in the model's own forward, not in its Linear
    assert f.evidence["singularity"] == {"function": "sqrt", "at": "0", "confirmed": True}
    assert f.evidence["overflows_at_any_scale"] is True and f.evidence["overflows_at_scale_1"] is True
    assert f.evidence["forward_op"] == "aten::sqrt" and f.evidence["node"] == "SqrtBackward0"
    assert f.evidence["fp32_gradients_finite"] is True  # fp32 keeps the 1e-8
    assert "overflows at any scale" in f.message and "underflowed to exactly 0 in fp16" in f.message
    assert f.location is not None and f.location.endswith(f":{dm.line_of(dm.__file__, 'pair-sqrt')}")
    assert "epsilon inside the sqrt" in f.fix and "fp32" in f.fix
    assert "init_scale" not in f.fix and "not the remedy" in f.fix


def test_backward_finding_acos_of_a_cosine_rounded_to_one_is_a_singularity() -> None:
    model = Turn()
    x = torch.randn(1, 4).repeat(6, 1) + 1e-2 * torch.randn(6, 4)  # 1 - cos is 4e-7 to 3e-5 in fp32
    result = diagnose_step(model, _fp16_mean(x), precision="fp16", bisect=False)
    f = _only_error(result)
    assert f.evidence["singularity"]["function"] == "acos" and f.evidence["node"] == "AcosBackward0"
    assert "rounded to exactly ±1 in fp16" in f.message
    assert "clamp" in f.fix and "An epsilon below" not in f.fix


def test_backward_finding_a_real_gradient_overflow_is_no_singularity() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    with torch.no_grad():
        for layer in model:
            layer.weight.fill_(30.0)

    def run(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(torch.randn(4, 16) * 0.01)
        return out.float().mean() * 3e4

    f = _only_error(diagnose_step(model, run, precision="fp16", loss_scale=4.0, bisect=False))
    assert "singularity" not in f.evidence
    assert "exceeds the format's range" in f.message
