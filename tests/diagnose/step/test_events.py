"""The producer of the first non-finite value, and the NaN's birth past an earlier overflow."""

from __future__ import annotations

import torch

from ampkit.diagnose.step.events import find_producer, producer_finding
from diagnose.doctor_models import trace_fn


def _overflow_then_nan(x: torch.Tensor) -> torch.Tensor:
    big = x.half() * 1e4          # +inf: an overflow
    return torch.layer_norm(big, (3,))   # the norm turns the inf into NaN


def test_find_producer_nan_only_skips_an_earlier_overflow() -> None:
    log = trace_fn(_overflow_then_nan, torch.full((2, 3), 100.0))
    first = find_producer(log, "forward")
    birth = find_producer(log, "forward", nan_only=True)
    assert first is not None and first.kind == "overflow" and first.record.op == "aten::mul"
    assert birth is not None and birth.kind == "nan_from_inf" and birth.record.op == "aten::native_layer_norm"


def test_producer_finding_nan_birth_is_forward_nan_even_at_a_norm_op() -> None:
    log = trace_fn(_overflow_then_nan, torch.full((2, 3), 100.0))
    birth = find_producer(log, "forward", nan_only=True)
    assert birth is not None
    plain = producer_finding(birth, step_nonfinite=True, step=3, module_type=None, reference_absmax=None)
    f = producer_finding(birth, step_nonfinite=True, step=3, module_type=None, reference_absmax=None, log=log,
                         fp32_nan=False, nan_birth=True)
    assert plain.code == "NORM_STATS_NONFINITE"  # a norm op that is the first producer keeps its own code
    assert f.code == "FORWARD_NAN" and f.op == "aten::native_layer_norm"
    assert f.evidence["inf_source"]["op"] == "aten::mul"
    assert f.evidence["nan_in_fp32"] is False
    assert "aten::mul" in f.message and "fp32" in f.fix


def test_producer_finding_nan_also_in_fp32_does_not_propose_keep_fp32() -> None:
    pad = torch.tensor([[False, True], [True, True]])
    log = trace_fn(lambda x: x.masked_fill(pad, float("-inf")).softmax(-1), torch.randn(2, 2))
    p = find_producer(log, "forward")
    assert p is not None
    f = producer_finding(p, step_nonfinite=True, step=0, module_type=None, reference_absmax=None, log=log,
                         fp32_nan=True)
    assert f.code == "FORWARD_NAN" and f.evidence["cause"] == "masked_row"
    assert "not a precision problem" in f.message
    assert "keep_fp32" not in f.fix and "torch.finfo" in f.fix
