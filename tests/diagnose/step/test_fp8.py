"""The step doctor on fp8 layers: out-of-fp8 trials, the fp8 shadow, the operand statistics, FP8_FLUSH."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.compare import GradComparison, precision_findings
from ampkit.diagnose.step.fp8 import filter_layers, fp8_precision, out_of_fp8, strip_fp8
from ampkit.fp8 import fp8_layer_names, is_float8_linear
from ampkit.mixed_precision import MixedPrecision
from ampkit.precision import FP8_RECIPES, Precision


def _fp8_model(precision: str = "fp8") -> tuple[nn.Module, MixedPrecision]:
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="no fp8 GEMM"):  # the CPU runs fp8 on torch's _scaled_mm
        mp = MixedPrecision(precision, device="cpu")
    model = mp.prepare(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)))
    return model, mp


@pytest.mark.parametrize(("precision", "recipe"), list(FP8_RECIPES.items()))
def test_fp8_precision_reads_the_recipe_from_the_layers_config(precision: str, recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 64)), config=Float8LinearConfig.from_recipe_name(recipe))
    assert fp8_precision(Precision.parse("bf16", "cpu"), model).name == precision  # a script's bf16 autocast


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
    assert flush[0].fix.endswith("`ampkit preflight --precision fp8 TARGET`.")
    assert result.precision == "fp8" and result.fp8_filter == ["0"] and result.keep_fp32 is None
    assert result.comparison["fp8_operands"]["2"]["input"]["flush_fraction"] == 0.0


@pytest.mark.parametrize("precision", list(FP8_RECIPES))
def test_diagnose_step_fp8_healthy_model_has_no_precision_finding(precision: str) -> None:
    model, mp = _fp8_model(precision)
    x = torch.randn(64, 32)

    def run(m: nn.Module) -> torch.Tensor:
        with mp.autocast():
            return m(x).float().pow(2).mean()

    result = diagnose_step(model, run, precision=precision)
    assert result.precision == precision
    assert not [f for f in result.findings if f.severity != "info"]
    assert result.comparison["output_sqnr_db"][""] > 15.0  # the shadow is fp32, not fp8: a finite, real gap
    assert result.comparison["output_sqnr_db"][""] < 60.0


def _loss_findings(fp8_layers: list[str] | None) -> dict[str, str]:
    """The fix of each PRECISION_LOSS (activation at '0', gradient at 'norm') of a model 0 -> norm -> 2."""
    grads = GradComparison(sqnr_db={"0": 30.0, "norm": 3.0, "2": 30.0}, global_sqnr_db=20.0)
    findings = precision_findings(order=["0", "norm", "2", ""], out_sqnr={"0": 2.0, "norm": 2.0, "2": 2.0, "": 2.0},
                                  grads=grads, threshold_db=12.0, underflow_threshold=0.01, precision="fp8",
                                  loss_scale=1.0, step=0, fp8_layers=fp8_layers)
    return {f.evidence["kind"]: f.fix for f in findings if f.code == "PRECISION_LOSS"}


def test_precision_findings_fp8_model_suggests_fp8_filter_for_activations_and_gradients() -> None:
    fixes = _loss_findings(["0", "2"])
    assert fixes["activation"].startswith("Keep '0' out of fp8: MixedPrecision(..., fp8_filter=['0'])")
    # the LayerNorm holds no fp8 layer: its gradient comes back through the fp8 layer after it
    assert "fp8_filter=['2']" in fixes["gradient"]
    assert not any("keep_fp32" in fix for fix in fixes.values())
    assert all("keep_fp32" in fix for fix in _loss_findings(None).values())  # a bf16/fp16 model keeps fp32


def test_diagnose_step_fp8_unverified_precision_loss_suggests_fp8_filter() -> None:
    model, mp = _fp8_model()
    with torch.no_grad():
        model[0].weight[:, 0] = 0.0
    x = torch.randn(64, 32)
    x[:, 0] = 1e6  # the rest of the first layer's input flushes: its output and the gradients lose the signal

    def run(m: nn.Module) -> torch.Tensor:
        with mp.autocast():
            return m(x).float().pow(2).mean()

    result = diagnose_step(model, run, precision="fp8", bisect=False)  # no verified fix replaces the advice
    losses = [f for f in result.findings if f.code == "PRECISION_LOSS"]
    assert {f.evidence["kind"] for f in losses} == {"activation", "gradient"}
    assert all("fp8_filter=" in f.fix and "keep_fp32" not in f.fix for f in losses), [f.fix for f in losses]
