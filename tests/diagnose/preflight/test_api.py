"""preflight_model on tiny models: verdicts, verified policies, and the user's model left as it was."""

from __future__ import annotations

import math

import pytest
import torch

from ampkit.diagnose.preflight.api import preflight_model
from ampkit.diagnose.preflight.assess import policy_limit
from ampkit.diagnose.preflight.fp32pass import recommended_scale
from tests.diagnose.preflight.models import OVERFLOW_GAIN, Stack, batches, loss

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def overflowing():
    torch.manual_seed(0)
    model = Stack(OVERFLOW_GAIN)
    return model, preflight_model(model, batches(), loss_fn=loss, formats="fp16,bf16,fp8")


def test_preflight_model_calls_a_healthy_model_safe_in_every_trained_format() -> None:
    torch.manual_seed(0)
    result = preflight_model(Stack(), batches(), loss_fn=loss)
    assert [(f.format, f.verdict) for f in result.formats] == [
        ("fp16", "safe"), ("bf16", "safe"), ("fp8", "safe"), ("fp8-rowwise", "safe"), ("fp8-rowwise-gw-hp", "safe")]
    assert result.ok


def test_preflight_model_keeps_the_overflowing_projection_in_fp32_for_fp16_and_verifies_it(overflowing) -> None:
    _, result = overflowing
    fp16 = result.report("fp16")
    assert fp16.verdict == "policy"
    assert fp16.first_break is not None and fp16.first_break.kind == "error"
    assert fp16.first_break.module == "blocks.2.wo" and fp16.first_break.reason.startswith("FORWARD_OVERFLOW")
    assert fp16.policy.keep_fp32 == ["blocks.2.wo"] and fp16.policy.fp8_filter == []
    assert fp16.policy_sqnr_db["before"] == -math.inf
    after = fp16.policy_sqnr_db["after"]
    assert after is not None and after > 40.0  # the verifying replay with the policy is finite and close to fp32


def test_preflight_model_calls_bf16_safe_where_only_fp16_overflows(overflowing) -> None:
    _, result = overflowing
    assert result.report("bf16").verdict == "safe"
    assert result.report("bf16").first_break is None


def test_preflight_layers_report_negative_fp16_headroom_at_the_overflowing_module(overflowing) -> None:
    _, result = overflowing
    rows = {layer.module: layer for layer in result.report("fp16").layers}
    assert rows["blocks.2.wo"].headroom_bits is not None and rows["blocks.2.wo"].headroom_bits < 0
    assert rows["blocks.2.wo"].broken
    assert rows["blocks.0.wo"].headroom_bits is not None and rows["blocks.0.wo"].headroom_bits > 8
    assert rows["blocks.2.wo"].absmax is not None and rows["blocks.2.wo"].absmax > 65504


def test_preflight_fp8_layers_carry_transformer_engine_operand_statistics(overflowing) -> None:
    _, result = overflowing
    rows = {layer.module: layer for layer in result.report("fp8").layers}
    stats = rows["blocks.0.wi"].operands
    assert set(stats) == {"input", "weight", "grad_output"}
    assert set(stats["input"]) >= {"underflows%", "overflows%", "mse", "scale_inv_min", "scale_inv_max", "dynamic_range"}
    assert rows["blocks.0.ln"].operands == {}  # not a quantized layer


def test_preflight_model_leaves_the_users_model_and_rng_as_they_were() -> None:
    torch.manual_seed(0)
    model = Stack(OVERFLOW_GAIN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    preflight_model(model, batches(), loss_fn=loss, formats="fp16,fp8")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert type(model.blocks[0].wi) is torch.nn.Linear
    assert torch.equal(torch.get_rng_state(), rng)


def test_preflight_model_calls_a_format_unsafe_when_more_than_half_the_linear_layers_would_have_to_stay_out() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(2 * torch.eye(8))
            layer.bias.zero_()
    # Each layer doubles an input that fp16 holds (4e4): every output passes 65504, and a layer kept in
    # fp32 hands the next one a value that overflows its cast, so no policy short of all three fixes it.
    huge = [torch.full((4, 8), 4e4)]
    result = preflight_model(model, huge, loss_fn=lambda m, x: m(x).float().mean(), formats="fp16")
    fp16 = result.report("fp16")
    assert policy_limit(model) == 1
    assert fp16.verdict == "unsafe"
    assert not result.ok


def test_preflight_recommended_scale_keeps_the_largest_gradient_a_bit_under_fp16s_largest_value() -> None:
    scale = recommended_scale(11.8, 65536.0)
    assert 11.8 * scale < 65504 / 2 <= 11.8 * scale * 2
    assert recommended_scale(0.0, 65536.0) == 65536.0


def test_preflight_model_reports_inputs_and_a_weights_digest() -> None:
    torch.manual_seed(0)
    model = Stack()
    result = preflight_model(model, batches(count=2), loss_fn=loss, formats="bf16")
    assert result.inputs["batches"] == 2
    assert result.inputs["shapes"][0] == [[16, 32], [16]]
    assert len(result.inputs["weights_sha256"]) == 64
    with torch.no_grad():
        model.head.weight[0, 0] += 1.0
    assert preflight_model(model, batches(), loss_fn=loss, formats="bf16").inputs["weights_sha256"] != \
        result.inputs["weights_sha256"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"formats": "fp4"}, "'fp4' is not a format"),
    ({"time_budget": 0}, "time_budget=0"),
])
def test_preflight_model_refuses_bad_arguments_naming_them(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        preflight_model(Stack(), batches(), loss_fn=loss, **kwargs)


def test_preflight_model_refuses_an_empty_batch_list() -> None:
    with pytest.raises(ValueError, match="no batch given"):
        preflight_model(Stack(), [], loss_fn=loss)


def test_preflight_model_without_a_loss_function_needs_a_scalar_from_the_model() -> None:
    with pytest.raises(ValueError, match="not a scalar loss: pass loss_fn"):
        preflight_model(Stack(), [torch.randn(4, 32)], formats="bf16")


def test_preflight_time_budget_drops_batches_before_formats() -> None:
    torch.manual_seed(0)
    result = preflight_model(Stack(), batches(count=50), loss_fn=loss, formats="bf16,fp16", time_budget=1.0)
    assert [f.format for f in result.formats] == ["bf16", "fp16"] or result.skipped
    assert 1 <= result.inputs["batches"] < 50
