"""The emulated MXFP8/NVFP4 formats: the operand statistics against torchao's own tensors, the emulated
Linear's three GEMMs, its place in the step doctor (shadow, out-of-fp8 trials), eligibility."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from ampkit.diagnose.core.blockcast import (
    BlockFormatLinear,
    ineligible_layers,
    is_quantized_linear,
    operand_stats,
    quantized_layer_names,
    to_block_format,
)
from ampkit.diagnose.core.blockformats import BLOCK_FORMATS, BlockFormatName, quantize_dequantize
from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.programs import LossProgram
from ampkit.diagnose.step.session import Session
from ampkit.fp8 import import_torchao
from ampkit.precision import Precision

pytestmark = pytest.mark.numerics

FORMATS: list[BlockFormatName] = ["mxfp8", "nvfp4"]


def _operand() -> torch.Tensor:
    """64 x 64 values with an outlier row and tiny values: some flush, some blocks span 20 binades."""
    x = torch.randn(64, 64)
    x[3] *= 1e3
    x[5, ::7] = 1e-5
    assert bool((x != 0).all())  # every value is non-zero: an fp4 zero code is an underflow
    return x


def _te_statistics(x: torch.Tensor, zero: torch.Tensor, deq: torch.Tensor, scales: torch.Tensor,
                   range_end: float, block: int) -> dict[str, float]:
    """Transformer Engine's statistics from a torchao tensor's parts: the zero codes, the dequantized values,
    the block scales that dequantize (rows x blocks) and where the element range ends."""
    per_value = scales.repeat_interleave(block, dim=-1)
    ax = x.abs()
    return {
        "underflows%": 100.0 * float((zero & (x != 0)).sum()) / float((x != 0).sum()),
        "overflows%": 100.0 * float((~torch.isfinite(deq) | (ax > range_end * per_value)).sum()) / x.numel(),
        "mse": float((deq.double() - x.double()).square().mean()),
        "scale_inv_min": float(scales.min()), "scale_inv_max": float(scales.max()),
        "dynamic_range": math.log2(float(ax.max())) - math.log2(float(ax[ax != 0].min())),
    }


def test_operand_stats_mxfp8_equals_the_statistics_of_torchaos_mxtensor() -> None:
    mx = import_torchao("torchao.prototype.mx_formats.mx_tensor")
    rceil = import_torchao("torchao.prototype.mx_formats.config").ScaleCalculationMode.RCEIL
    x = _operand()
    t = mx.MXTensor.to_mx(x, torch.float8_e4m3fn, 32, rceil)
    zero = (t.qdata.view(torch.uint8) & 0x7F) == 0  # e4m3: +0 and -0
    want = _te_statistics(x, zero, t.dequantize(torch.float32), t.scale.to(torch.float32), 448.0 + 16.0, 32)
    got = operand_stats(x, "mxfp8", dim=-1)
    assert got == pytest.approx(want, rel=1e-9, abs=0.0)
    assert got["underflows%"] > 0 and got["overflows%"] == 0.0  # RCEIL: no value beyond e4m3's range


def test_operand_stats_nvfp4_equals_the_statistics_of_torchaos_nvfp4tensor() -> None:
    nv = import_torchao("torchao.prototype.mx_formats.nvfp4_tensor")
    x = _operand()
    t = nv.NVFP4Tensor.to_nvfp4(x, 16, per_tensor_scale=x.abs().max() / (448.0 * 6.0))
    codes = torch.stack([t.qdata & 0xF, t.qdata >> 4], dim=-1).reshape(x.shape)  # two e2m1 codes per byte
    zero = (codes & 0x7) == 0  # e2m1: +0 and -0
    scales = t.per_tensor_scale * t.scale.to(torch.float32)
    want = _te_statistics(x, zero, t.dequantize(torch.float32), scales, 6.0 + 1.0, 16)
    got = operand_stats(x, "nvfp4", dim=-1)
    assert got == pytest.approx(want, rel=1e-6, abs=0.0)
    assert got["underflows%"] > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_dequantize_pads_a_short_block_with_zeros(fmt: BlockFormatName) -> None:
    x = torch.randn(40, 48)  # 40 rows: not a multiple of 32 (or 16) along dim 0
    padded = torch.cat([x, torch.zeros(24, 48)])
    assert torch.equal(quantize_dequantize(x, fmt, dim=0), quantize_dequantize(padded, fmt, dim=0)[:40])


def test_operand_stats_fp8_recipes_cast_as_torchaos_recipes() -> None:
    x = torch.randn(32, 64)
    x[0, 0] = 100.0
    amax = float(x.abs().max())
    tensorwise = {op: operand_stats(x, "fp8", dim=-1, operand=op) for op in ("input", "grad_output")}
    assert tensorwise["input"]["scale_inv_max"] == pytest.approx(amax / 448.0, rel=1e-6)  # e4m3
    assert tensorwise["grad_output"]["scale_inv_max"] == pytest.approx(amax / 57344.0, rel=1e-6)  # e5m2
    rowwise = operand_stats(x, "fp8-rowwise", dim=-1)  # e4m3, one power-of-2 scale per row
    row_scales = [2.0 ** math.ceil(math.log2(float(a) / 448.0)) for a in x.abs().amax(dim=-1)]
    assert (rowwise["scale_inv_min"], rowwise["scale_inv_max"]) == (min(row_scales), max(row_scales))


def _emulated(fmt: BlockFormatName) -> tuple[nn.Module, nn.Module]:
    """A 64 -> 64 -> 32 model in ``fmt`` and its plain twin (the same weights)."""
    plain = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    model.load_state_dict(plain.state_dict())
    assert to_block_format(model, fmt) == ["0", "2"]
    return model, plain


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_format_linear_three_gemms_equal_round_trips_of_their_operands(fmt: BlockFormatName) -> None:
    layer = BlockFormatLinear(64, 96, block_format=fmt)
    x = torch.randn(2, 24, 64)  # M = 48 tokens: the weight-gradient blocks are padded
    dy = torch.randn(2, 24, 96)
    with torch.no_grad():  # an outlier in each operand flushes its block-mates: each GEMM's blocking shows
        for t in (x, dy, layer.weight):
            t.view(-1)[0] = 1e4
    x.requires_grad_()
    y = layer(x)
    y.backward(dy)

    def q(t: torch.Tensor, dim: int) -> torch.Tensor:
        return quantize_dequantize(t.detach(), fmt, dim=dim)

    rows, dy_rows, w = x.detach().reshape(48, 64), dy.reshape(48, 96), layer.weight.detach()
    assert torch.equal(y.detach(), (q(rows, -1) @ q(w, -1).t()).reshape(2, 24, 96) + layer.bias.detach())
    assert torch.equal(x.grad, (q(dy_rows, -1) @ q(w, 0)).reshape(2, 24, 64))  # blocks along N
    assert torch.equal(layer.weight.grad, q(dy_rows, 0).t() @ q(rows, 0))  # blocks along M


def test_block_format_linear_mxfp8_is_bit_identical_to_torchaos_emulated_mxfp8linear() -> None:
    mxl = import_torchao("torchao.prototype.moe_training.mxfp8_linear")
    emulated = import_torchao("torchao.quantization.quantize_.common.kernel_preference").KernelPreference.EMULATED
    ref = mxl.MXFP8Linear(64, 96, kernel_preference=emulated)
    ours = nn.Linear(64, 96)
    ours.load_state_dict(ref.state_dict())
    to_block_format(ours, "mxfp8")
    x, dy = torch.randn(2, 32, 64), torch.randn(2, 32, 96)
    with torch.no_grad():  # outliers flush their block-mates: blocks along the wrong dimension would show
        for t in (x, dy, ref.weight, ours.weight):
            t.view(-1)[0] = 1e4
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    out = [ref(xs[0]), ours(xs[1])]
    for o in out:
        o.backward(dy)
    assert torch.equal(out[0], out[1]) and torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(ref.weight.grad, ours.weight.grad) and torch.equal(ref.bias.grad, ours.bias.grad)


@pytest.mark.parametrize("fmt", FORMATS)
def test_session_strips_block_layers_from_the_shadow_and_out_of_fp8_runs_fp32(fmt: BlockFormatName) -> None:
    model, _ = _emulated(fmt)
    x = torch.randn(48, 64)

    def run(m: nn.Module) -> torch.Tensor:
        return m(x).pow(2).mean()

    sqnr = diagnose_step(model, run, precision="fp32", bisect=False).comparison["output_sqnr_db"][""]
    assert math.isfinite(sqnr) and 5.0 < sqnr < 60.0  # the shadow is fp32: a real, finite gap (fp32's is inf)
    with Session(model, LossProgram(run), Precision.parse("fp32", "cpu")) as s:
        assert s.exclusion == "fp8_filter"
        shadow = s.shadow_model()
        assert quantized_layer_names(shadow) == [] and quantized_layer_names(s.work) == ["0", "2"]
        reference = s.run(shadow, mode="unit", fp32=True, stats=False)
        emulated = s.run(s.work, mode="unit", stats=False)
        with s.kept_fp32(["0", "2"]):  # out_of_fp8 on every layer
            kept = s.run(s.work, mode="unit", stats=False)
        assert quantized_layer_names(s.work) == ["0", "2"]  # turned back after the trial
    assert emulated.loss != reference.loss and kept.loss == reference.loss
    assert all(torch.equal(kept.grads[n], reference.grads[n]) for n in reference.grads)


def test_diagnose_step_emulated_mxfp8_with_all_zero_blocks_reports_no_overflow() -> None:
    model, _ = _emulated("mxfp8")
    x = torch.randn(48, 64)
    x[:16] = 0.0  # RCEIL takes log2 of a zero block's amax inside the cast: -inf that is not the model's

    result = diagnose_step(model, lambda m: m(x).pow(2).mean(), precision="fp32", bisect=False)
    assert [f.code for f in result.findings if f.severity != "info"] == []


def test_to_block_format_leaves_ineligible_and_excluded_layers_as_linear() -> None:
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 32))
    assert ineligible_layers(model, "mxfp8") == {"0": "in_features 40 not a multiple of mxfp8's block of 32"}
    assert to_block_format(model, "mxfp8", exclude=["3"]) == ["2"]
    assert [is_quantized_linear(m) for m in model] == [False, False, True, False]
    assert type(model[0]) is nn.Linear and model[2].block_format == "mxfp8"
    assert BLOCK_FORMATS["nvfp4"].block_size == 16 and "0" in ineligible_layers(model, "nvfp4")  # 40 % 16 != 0
