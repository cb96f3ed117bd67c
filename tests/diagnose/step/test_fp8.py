"""The step doctor on fp8 layers: out-of-fp8 trials, the fp8 shadow, the operand statistics, FP8_FLUSH."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.fp8 import filter_layers, out_of_fp8, strip_fp8
from ampkit.fp8 import fp8_layer_names, is_float8_linear
from ampkit.mixed_precision import MixedPrecision


def _fp8_model() -> tuple[nn.Module, MixedPrecision]:
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="no fp8 GEMM"):  # the CPU runs fp8 on torch's _scaled_mm
        mp = MixedPrecision("fp8", device="cpu")
    model = mp.prepare(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    return model, mp


def test_out_of_fp8_runs_the_named_layers_as_linear_and_restores_them() -> None:
    model, _ = _fp8_model()
    with out_of_fp8(model, ["2"]) as layers:
        assert [type(m) for m in layers] == [nn.Linear] and is_float8_linear(model[0])
    assert fp8_layer_names(model) == ["0", "2"]
    assert fp8_layer_names(strip_fp8(model)) == []


def test_filter_layers_resolves_patterns_as_fp8_filter_does() -> None:
    model, _ = _fp8_model()
    assert filter_layers(model, ["*"]) == ["0", "2"]
    with pytest.raises(ValueError, match="fp8_filter"):
        filter_layers(model, ["head"])


def test_diagnose_step_fp8_outlier_names_the_flushed_input_and_verifies_the_filter() -> None:
    model, mp = _fp8_model()
    with torch.no_grad():
        model[0].weight[:, 0] = 0.0
    x = torch.randn(64, 32)
    x[:, 0] = 1e6  # sets the tensorwise scale: the rest of the input flushes in e4m3

    def run(m: nn.Module) -> torch.Tensor:
        with mp.autocast():
            return m(x).float().pow(2).mean()

    result = diagnose_step(model, run, precision="fp8")
    flush = [f for f in result.findings if f.code == "FP8_FLUSH"]
    assert [(f.module, f.evidence["operand"]) for f in flush] == [("0", "input")]
    assert result.precision == "fp8" and result.fp8_filter == ["0"] and result.keep_fp32 is None
    assert result.comparison["fp8_operands"]["2"]["input"]["flush_fraction"] == 0.0


def test_diagnose_step_fp8_healthy_model_has_no_precision_finding() -> None:
    model, mp = _fp8_model()
    x = torch.randn(64, 32)

    def run(m: nn.Module) -> torch.Tensor:
        with mp.autocast():
            return m(x).float().pow(2).mean()

    result = diagnose_step(model, run, precision="fp8")
    assert not [f for f in result.findings if f.severity != "info"]
    assert result.comparison["output_sqnr_db"][""] > 15.0  # the shadow is fp32, not fp8: a finite, real gap
    assert result.comparison["output_sqnr_db"][""] < 60.0
