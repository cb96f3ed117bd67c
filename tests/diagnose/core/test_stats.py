"""Range statistics and headroom against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ampkit.diagnose.core.stats import FORMATS, finalize_ranges, pending_range, tensor_stats

INF, NAN = float("inf"), float("nan")


def test_stats_hand_computed_values() -> None:
    t = torch.tensor([0.0, 1e-6, -2.0, 70000.0, NAN, INF, -INF, 0.5])
    s = tensor_stats(t)
    assert s.numel == 8
    assert s.absmax == 70000.0  # largest finite magnitude
    assert s.min_nonzero_abs == pytest.approx(1e-6)
    assert (s.nan, s.posinf, s.neginf) == (1, 1, 1)
    assert s.zero_frac == pytest.approx(1 / 8)
    assert not s.finite
    # 1e-6 is below fp16's and e5m2's smallest normal (2^-14) and e4m3's (2^-6); bf16 reaches 1e-38.
    assert s.subnormal_frac == {"fp16": 1 / 8, "bf16": 0.0, "fp8_e4m3": 1 / 8, "fp8_e5m2": 1 / 8}
    ovf, unf = s.headroom_bits["fp16"]
    assert ovf == pytest.approx(math.log2(65504 / 70000))
    assert ovf < 0
    assert unf == pytest.approx(math.log2(1e-6 / 2**-14))
    ovf8, unf8 = s.headroom_bits["fp8_e4m3"]
    assert ovf8 == pytest.approx(math.log2(448 / 70000))
    assert unf8 == pytest.approx(math.log2(1e-6 / 2**-6))
    assert s.headroom_bits["bf16"][0] == pytest.approx(math.log2(torch.finfo(torch.bfloat16).max / 70000))


def test_stats_format_ranges_match_torch() -> None:
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn),
                        ("fp8_e5m2", torch.float8_e5m2)):
        assert FORMATS[name].max == torch.finfo(dtype).max
        assert FORMATS[name].min_normal == torch.finfo(dtype).smallest_normal


def test_stats_low_precision_input_is_reduced_exactly() -> None:
    values = [0.0, 3.0e-5, -1.5, 60000.0]  # 3e-5 is an fp16 subnormal
    half = torch.tensor(values, dtype=torch.float16)
    s = tensor_stats(half)
    assert s.dtype == "torch.float16"
    assert s.absmax == 60000.0
    assert s.min_nonzero_abs == float(half[1])  # the stored fp16 value, not a rounded copy of it
    assert s.subnormal_frac["fp16"] == 0.25


def test_stats_float64_keeps_values_below_float32_range() -> None:
    s = tensor_stats(torch.tensor([1e-300, 1.0], dtype=torch.float64))
    assert s.min_nonzero_abs == pytest.approx(1e-300)
    assert s.subnormal_frac["bf16"] == 0.5


def test_stats_match_numpy_on_random_tensor() -> None:
    x = torch.randn(64, 33) * 1e-3
    x[0, :5] = 0.0
    s = tensor_stats(x)
    a = np.abs(x.numpy().astype(np.float64))
    assert s.absmax == pytest.approx(a.max())
    assert s.min_nonzero_abs == pytest.approx(a[a > 0].min())
    assert s.zero_frac == pytest.approx((a == 0).mean())
    assert s.subnormal_frac["fp16"] == pytest.approx(((a > 0) & (a < 2**-14)).mean())


def test_stats_empty_tensor_has_no_range() -> None:
    s = tensor_stats(torch.empty(0))
    assert s.numel == 0 and s.absmax == 0.0 and s.min_nonzero_abs == math.inf
    assert s.headroom_bits["fp16"] == (math.inf, math.inf)


def test_stats_to_dict_is_strict_json() -> None:
    import json

    d = tensor_stats(torch.tensor([0.0, 0.0])).to_dict()
    json.dumps(d, allow_nan=False)
    assert d["min_nonzero_abs"] == "inf"


def test_stats_pending_range_ignores_nonfinite() -> None:
    r = finalize_ranges([pending_range(torch.tensor([NAN, -INF, 3.0, -0.25, 0.0]))])
    assert r == [(3.0, 0.25)]
