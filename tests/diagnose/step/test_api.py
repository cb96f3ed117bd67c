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


class PaddedAttention(nn.Module):
    """Key-padding and query-padding masks of finfo(dtype).min, added: -inf wherever both apply."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = self.qk(x) @ x.transpose(-2, -1)
        lowest = torch.finfo(scores.dtype).min
        mask = pad[:, None, :].to(scores.dtype) * lowest + pad[:, :, None].to(scores.dtype) * lowest
        return (torch.softmax(scores + mask, dim=-1) @ x).sum(-1)


def test_nan_birth_that_fp32_shares_is_reported_past_the_earlier_overflow() -> None:
    pad = torch.tensor([[0, 0, 1], [1, 1, 1]], dtype=torch.bool)  # the second sequence is empty

    def run(model: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(2, 3, 4), pad)
        return out.float().mean()

    result = diagnose_step(PaddedAttention(), run, precision="fp16", bisect=False)
    codes = [f.code for f in result.findings if f.severity == "error"]
    assert codes == ["FORWARD_OVERFLOW", "FORWARD_NAN"]
    nan = result.findings[1]
    assert nan.op == "aten::_softmax" and nan.evidence["cause"] == "masked_row"
    assert nan.evidence["nan_in_fp32"] is True
    assert nan.evidence["inf_source"]["how"] == "overflow" and nan.evidence["inf_source"]["op"] == "aten::add"
    assert "keep_fp32" not in nan.fix and "torch.finfo" in nan.fix


def test_nan_echo_of_a_low_precision_overflow_is_named_by_the_overflow() -> None:
    from diagnose import doctor_models as dm

    model = dm.AttnNet(d=8)
    with torch.no_grad():
        model.attn.q.weight.fill_(20.0)
        model.attn.k.weight.fill_(20.0)
    result = diagnose_step(model, dm.fp16_run(torch.rand(2, 3, 8) + 1.0), precision="fp16", bisect=False)
    assert "FORWARD_NAN" not in {f.code for f in result.findings}  # fp32 has no NaN: the overflow's fix cures it
    (overflow,) = [f for f in result.findings if f.code == "FORWARD_OVERFLOW"]
    assert overflow.evidence["nan_birth"]["op"] == "aten::_softmax"
    assert "turns into NaN at aten::_softmax" in overflow.message
