"""Explanations of the exceptions a script raised."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampkit._util.frames import UserFrames
from ampkit.diagnose.script.errors import _dtype_pair, explain_exception


def _raise(fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except Exception as exc:
        return exc
    raise AssertionError("expected an exception")


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda: torch.zeros(2, dtype=torch.float16).masked_fill(torch.ones(2, dtype=torch.bool), -1e9),
         "CAST_OVERFLOW"),
        (lambda: torch.zeros(2, dtype=torch.bfloat16).fill_(1e39), "CAST_OVERFLOW"),
        (lambda: nn.Linear(4, 4)(torch.ones(2, 4, dtype=torch.float16)), "DTYPE_MISMATCH"),
        (lambda: torch.ones(2, 4, dtype=torch.float16) @ torch.ones(4, 2), "DTYPE_MISMATCH"),
        (lambda: torch.bmm(torch.ones(1, 2, 2, dtype=torch.float16), torch.ones(1, 2, 2)), "DTYPE_MISMATCH"),
        (lambda: nn.Conv1d(2, 2, 1)(torch.ones(1, 2, 3, dtype=torch.bfloat16)), "DTYPE_MISMATCH"),
        (lambda: F.scaled_dot_product_attention(*(torch.ones(1, 2, 4, dtype=d) for d in
                                                   (torch.float16, torch.float32, torch.float32))),
         "DTYPE_MISMATCH"),
        (lambda: nn.LSTM(4, 4)(torch.ones(1, 1, 4, dtype=torch.float16)), "DTYPE_MISMATCH"),
        (lambda: torch.multinomial(torch.tensor([float("nan"), 1.0]), 1), "FORWARD_NAN"),
        # wordings no pattern lists: two floating dtypes named in a type error are a mismatch
        (lambda: F.huber_loss(torch.ones(3, requires_grad=True), torch.ones(3, dtype=torch.float16)).backward(),
         "DTYPE_MISMATCH"),
        (lambda: torch.zeros(3).index_add_(0, torch.tensor([0]), torch.ones(1, dtype=torch.float16)),
         "DTYPE_MISMATCH"),
        (lambda: F.embedding_bag(torch.tensor([[0]]), torch.ones(3, 2), mode="sum",
                                 per_sample_weights=torch.ones(1, 1, dtype=torch.float16)), "DTYPE_MISMATCH"),
    ],
)
def test_doctor_observers_explain_real_torch_errors(make: object, code: str) -> None:
    exc = _raise(make)
    finding = explain_exception(exc, UserFrames([Path(__file__).parent]), {})
    assert finding is not None, str(exc)
    assert finding.code == code and finding.severity == "error"
    assert finding.location is not None and finding.location.startswith(os.path.relpath(__file__))
    assert finding.evidence["exception"].startswith(type(exc).__name__)


def test_doctor_observers_explain_fp16_gradients_and_scaler_order() -> None:
    model = nn.Linear(2, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    code = UserFrames([Path(__file__).parent])
    finding = explain_exception(_raise(lambda: scaler.step(opt)), code, {})
    assert finding is not None and finding.code == "LOW_PRECISION_PARAMS"
    other = nn.Linear(2, 1)
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1)
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.scale(other(torch.ones(1, 2)).sum()).backward()
    scaler2.unscale_(opt2)
    finding = explain_exception(_raise(lambda: scaler2.unscale_(opt2)), code, {})
    assert finding is not None and finding.code == "UNSCALE_ORDER_ERROR"
    assert explain_exception(KeyError("x"), code, {}) is None


def test_doctor_observers_a_type_error_naming_no_low_precision_dtype_is_not_a_mismatch() -> None:
    index = _raise(lambda: torch.zeros(3).index_select(0, torch.tensor([0.0])))  # an index dtype
    assert explain_exception(index, UserFrames([Path(__file__).parent]), {}) is None
    wide = _raise(lambda: torch.zeros(2, dtype=torch.float64) @ torch.zeros(2, dtype=torch.float32))
    assert "Double" in str(wide) and _dtype_pair(str(wide)) is None  # fp64 against fp32: not mixed precision
