"""The tracer names the producer: module, aten op and the user's line, and the right code."""

from __future__ import annotations

import os

import torch
from torch import nn

from ampkit.diagnose.step.api import diagnose_step
from ampkit.findings import loss_in_low_precision
from diagnose import doctor_models as dm

MODELS = os.path.abspath(dm.__file__)


def _errors(result):
    return [f for f in result.findings if f.severity == "error"]


def _loc(tag: str) -> str:
    return f"{os.path.relpath(MODELS)}:{dm.line_of(MODELS, tag)}"


def test_trace_rmsnorm_without_upcast_names_the_norm_not_the_block() -> None:
    model = dm.NormNet(hot=(1,))
    result = diagnose_step(model, dm.fp16_run(torch.randn(4, 16) * 3), precision="fp16", bisect=False)
    (f,) = _errors(result)
    assert f.code == "FORWARD_OVERFLOW"
    assert f.module == "blocks.1.norm"  # the producer, not "blocks.1" that contains it
    assert f.op == "aten::mul"
    assert f.location == _loc("rmsnorm-square")
    assert f.evidence["module_type"] == "RMSNorm"
    # rsqrt(inf) = 0 absorbs the overflow: finite, but wrong, and said so.
    assert f.evidence["module_output_sqnr_db"] < 20


def test_trace_attention_logits_overflow_before_scaling() -> None:
    model = dm.AttnNet(d=8)
    with torch.no_grad():
        model.attn.q.weight.fill_(20.0)
        model.attn.k.weight.fill_(20.0)
    x = torch.rand(2, 3, 8) + 1.0
    result = diagnose_step(model, dm.fp16_run(x), precision="fp16", bisect=False)
    f = _errors(result)[0]
    assert f.code == "FORWARD_OVERFLOW"
    assert f.module == "attn"
    assert f.op in ("aten::bmm", "aten::matmul", "aten::mm")
    assert f.location == _loc("attention-logits")
    assert result.loss is not None and result.loss != result.loss  # NaN loss: the step is non-finite


def test_trace_attention_scaled_first_is_clean() -> None:
    model = dm.AttnNet(d=8, scale_first=True)
    with torch.no_grad():
        model.attn.q.weight.fill_(2.0)
        model.attn.k.weight.fill_(2.0)
    result = diagnose_step(model, dm.fp16_run(torch.rand(2, 3, 8) + 1.0), precision="fp16", bisect=False)
    assert _errors(result) == []


def test_trace_additive_masks_summing_to_neg_inf_are_named() -> None:
    model = dm.MaskedAttnNet(d=8)
    pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    result = diagnose_step(model, dm.fp16_run(torch.randn(2, 4, 8), pad), precision="fp16", bisect=False)
    overflow = [f for f in result.findings if f.code == "FORWARD_OVERFLOW"]
    assert len(overflow) == 1
    assert overflow[0].module == "attn"
    assert overflow[0].op == "aten::add"
    assert overflow[0].location == _loc("mask-sum")
    assert overflow[0].evidence["input_dtypes"] == ["fp16", "fp16"]


def test_trace_intended_neg_inf_mask_is_not_a_producer() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = self.lin(x)
            causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
            return torch.softmax(s.masked_fill(causal, float("-inf")), dim=-1)

    result = diagnose_step(Masked(), dm.bf16_run(torch.randn(4, 4)), precision="bf16", bisect=False)
    assert [f.code for f in result.findings] == []


def test_trace_fully_masked_row_is_forward_nan_from_inf() -> None:
    class AllMasked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = self.lin(x).masked_fill(torch.ones(4, 4, dtype=torch.bool), float("-inf"))
            return torch.softmax(s, dim=-1)

    result = diagnose_step(AllMasked(), dm.bf16_run(torch.randn(4, 4)), precision="bf16", bisect=False)
    f = _errors(result)[0]
    assert (f.code, f.module) == ("FORWARD_NAN", "")
    assert f.op == "aten::_softmax"
    assert f.evidence["kind"] == "nan_from_inf"


def test_trace_nan_sample_in_data_is_nonfinite_input() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(5, 6)
    x[3, 2] = float("nan")
    result = diagnose_step(model, dm.bf16_run(x), precision="bf16")
    (f,) = _errors(result)
    assert f.code == "NONFINITE_INPUT"
    assert f.module == "0"
    assert f.evidence["nan_rows"] == [3]
    assert f.evidence["nan"] == 1
    assert result.keep_fp32 is None  # not a precision problem: nothing to keep in fp32


def test_trace_cast_overflow_into_fp16() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.full((2, 4), 1e5)  # fp32 data beyond fp16's range, cast by autocast for the matmul
    result = diagnose_step(model, dm.fp16_run(x), precision="fp16", bisect=False)
    f = _errors(result)[0]
    assert f.code == "CAST_OVERFLOW"
    assert (f.module, f.op) == ("0", "aten::_to_copy")
    assert f.evidence["input_absmax"] == 1e5


def test_trace_dtype_mismatch_names_module_and_op() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x.half() @ self.w)  # no autocast: Half @ Float raises

    result = diagnose_step(Mixed(), lambda m: m(torch.randn(2, 4)).float().sum(), precision="fp16")
    (f,) = result.findings
    assert f.code == "DTYPE_MISMATCH"
    assert f.module == "" and f.op == "aten::mm"
    assert sorted(f.evidence["input_dtypes"]) == ["fp16", "fp32"]
    assert "Half" in result.comparison["shadow_unavailable"]  # the explicit .half() breaks the fp32 copy too
    assert f.location is not None and f.location.endswith(f":{_line_of_mixed()}")


def _line_of_mixed() -> int:
    with open(__file__) as fh:
        return next(i for i, line in enumerate(fh, 1) if "no autocast: Half @ Float" in line)


def test_trace_loss_in_low_precision_is_reported_with_its_line() -> None:
    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)

    def run(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).pow(2).mean()  # LINE: bf16-loss

    result = diagnose_step(model, run, precision="bf16")
    (f,) = [f for f in result.findings if f.code == "LOSS_IN_LOW_PRECISION"]
    assert f.evidence["loss_dtype"] == "bf16"
    assert (f.message, f.fix) == loss_in_low_precision(torch.bfloat16, scale=1.0)  # the one wording of every emitter
    assert f.location is not None and f.location.split(":")[-1] == str(dm.line_of(__file__, "bf16-loss"))


def test_trace_batchnorm_running_stats_become_nonfinite() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(3e4)  # the fp16 matmul overflows; BatchNorm's running mean absorbs the inf
    result = diagnose_step(model, dm.fp16_run(torch.ones(6, 4)), precision="fp16", bisect=False)
    codes = [f.code for f in _errors(result)]
    assert codes[0] == "FORWARD_OVERFLOW"
    norm = [f for f in result.findings if f.code == "NORM_STATS_NONFINITE"]
    assert len(norm) == 1 and norm[0].module == "1"
    assert "1.running_mean" in norm[0].evidence["buffers"]


def test_trace_nonfinite_running_stats_before_the_step() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_var.fill_(float("nan"))
    result = diagnose_step(model, dm.bf16_run(torch.randn(6, 4)), precision="bf16", bisect=False)
    (f,) = [f for f in result.findings if f.code == "NORM_STATS_NONFINITE"]
    assert f.module == "1" and f.evidence["name"] == "1.running_var"


def test_trace_leaves_model_grads_buffers_and_rng_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = dm.bf16_run(torch.randn(6, 4))
    rng = torch.get_rng_state()
    diagnose_step(model, run, precision="bf16")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0))
    assert model[3].weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


def test_trace_headroom_counts_intermediates_inside_a_module() -> None:
    model = dm.NormNet(hot=(1,))
    result = diagnose_step(model, dm.fp16_run(torch.randn(4, 16) * 3), precision="fp16", bisect=False)
    room = result.module_headroom
    # x*x inside blocks.1.norm exceeds fp16 (fp32 reference values), though its output is normalised.
    assert room["blocks.1.norm"]["fp16"][0] < 0 < room["blocks.0.norm"]["fp16"][0]
    assert room["blocks.1"]["fp16"][0] == room["blocks.1.norm"]["fp16"][0]  # the block contains the peak
    assert room["blocks.1.norm"]["bf16"][0] > 100
    assert set(result.grad_headroom["blocks.1.fc"]) == {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2"}


def test_trace_constant_that_does_not_fit_fp16_is_cast_overflow() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scores = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
            return self.scores(x).masked_fill(mask, -1e9)  # LINE: fp32-constant

    result = diagnose_step(Masked(), dm.fp16_run(torch.randn(4, 4)), precision="fp16")
    (f,) = result.findings
    assert (f.code, f.module, f.op) == ("CAST_OVERFLOW", "", "aten::masked_fill")
    assert f.location is not None and f.location.endswith(f":{dm.line_of(__file__, 'fp32-constant')}")
    assert "finfo" in f.fix
