"""Where a forward NaN is born: its cause, the inf that fed it, and the fix text per cause."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ampkit.diagnose.step.events import find_producer
from ampkit.diagnose.step.nanorigin import inf_source, nan_cause, nan_text
from ampkit.diagnose.step.trace import TraceLog
from diagnose.doctor_models import trace_fn


def _birth(log: TraceLog):
    p = find_producer(log, "forward", nan_only=True)
    assert p is not None
    return p.record


def _masked_softmax(x: torch.Tensor) -> torch.Tensor:
    pad = torch.tensor([[False, False, False], [True, True, True]])
    return x.masked_fill(pad, float("-inf")).softmax(-1)


CASES: list[tuple[str, Callable[..., torch.Tensor], torch.Tensor]] = [
    ("masked_row", _masked_softmax, torch.randn(2, 3)),
    ("softmax_of_inf", lambda x: (x.half() * 1e4).softmax(-1), torch.full((2, 3), 100.0)),
    ("inf_minus_inf", lambda x: (x.half() * 1e4) - (x.half() * 1e4), torch.full((2, 3), 100.0)),
    ("zero_times_inf", lambda x: (x.half() * 1e4) * torch.zeros(2, 3, dtype=torch.float16),
     torch.full((2, 3), 100.0)),
    ("zero_times_inf", lambda x: torch.nn.functional.conv1d(x[None] * 1e38 * 10, torch.tensor([[[1.0, -1.0]]])),
     torch.ones(1, 3)),
    ("negative_domain", lambda x: torch.sqrt(x - 1.0), torch.zeros(2, 3)),
    ("zero_over_zero", lambda x: x / x, torch.zeros(2, 3)),
]


@pytest.mark.parametrize(("cause", "fn", "x"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_nan_cause_tells_the_causes_apart(cause: str, fn: Callable[..., torch.Tensor], x: torch.Tensor) -> None:
    log = trace_fn(fn, x)
    assert nan_cause(log, _birth(log)) == cause


def test_inf_source_follows_the_inf_back_to_the_op_that_overflowed() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        big = x.half() * 1e4                 # overflows: 100 * 1e4 > 65504
        shifted = (big + 1.0).reshape(-1)    # passes the inf on
        return shifted - shifted             # inf - inf: the NaN is born here

    log = trace_fn(fn, torch.full((2, 3), 100.0))
    source = inf_source(log, _birth(log))
    assert source is not None
    assert (source.how, source.op) == ("overflow", "aten::mul")
    assert "overflowed" in source.describe()


def test_inf_source_names_a_non_finite_constant_written_on_purpose() -> None:
    log = trace_fn(_masked_softmax, torch.randn(2, 3))
    source = inf_source(log, _birth(log))
    assert source is not None
    assert (source.how, source.op, source.module) == ("constant", "aten::masked_fill", "")
    assert source.to_json()["location"].endswith(".py:" + str(_masked_softmax.__code__.co_firstlineno + 2))


def test_inf_source_of_an_inf_that_entered_the_step_is_the_input() -> None:
    x = torch.tensor([float("inf"), 1.0])
    log = trace_fn(lambda t: t - t, x)
    source = inf_source(log, _birth(log))
    assert source is not None and source.how == "input"


def test_inf_source_is_none_for_a_nan_from_finite_inputs() -> None:
    log = trace_fn(lambda x: torch.sqrt(x - 1.0), torch.zeros(3))
    assert inf_source(log, _birth(log)) is None


def test_nan_text_gives_each_cause_its_own_fix() -> None:
    fixes = {cause: nan_text(cause, "float16")[1] for cause, _, _ in CASES}
    assert len(fixes) == 6
    assert len(set(fixes.values())) == len(fixes)
    assert "torch.finfo" in fixes["masked_row"] and "clamp" in fixes["masked_row"]
    assert "clamp" in fixes["negative_domain"] and "fp32" in fixes["negative_domain"]
    assert "fp16" in nan_text("negative_domain", "float16")[0]


def test_nan_text_for_a_constant_inf_advises_a_finite_mask_value() -> None:
    log = trace_fn(lambda x: x.masked_fill(x < 10, float("-inf")) - x.masked_fill(x < 10, float("-inf")).amax(-1),
                 torch.randn(4))
    birth = _birth(log)
    source = inf_source(log, birth)
    what, fix = nan_text(nan_cause(log, birth), "float32", source)
    assert what.startswith("inf − inf")
    assert "torch.finfo(x.dtype).min instead of float('-inf')" in fix
