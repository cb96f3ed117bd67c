"""Compiled vs eager, module by module: the descent names the innermost differing module, eager
inputs feed every module, and a backend that changes nothing reports nothing.  A graph-rewriting
backend stands in for inductor here (no C++ compile); tests/cli/test_doctor.py runs inductor."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ampkit.diagnose.step.compiled import compare_compiled, tensor_delta


class Cancel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stream = x * 1024.0
        return (stream + x) - stream


def _skewing_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Scales the outputs of every graph that holds the constant 1024 (the Cancel module's ops)."""
    if "1024" not in gm.code:
        return gm.forward

    def run(*args: Any) -> Any:
        return [o * 1.5 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in gm(*args)]
    return run


class Stack(nn.Module):
    """Its layers sit in a ModuleList, a container that is never called itself."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), Cancel(), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _model() -> nn.Module:
    return Stack()


def _compare(model: nn.Module, backend: Any) -> Any:
    x = torch.randn(4, 8)
    return compare_compiled(model, (x,), {}, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                            dtype=torch.bfloat16, grads=[None], options={"backend": backend})


def test_compare_compiled_reports_only_the_module_where_the_difference_is_born() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = _compare(model, _skewing_backend)
    assert [(m.module, m.diverges) for m in result.modules] == [
        ("", True), ("layers.0", False), ("layers.1", True), ("layers.2", False)]
    assert [m.module for m in result.culprits()] == ["layers.1"]
    worst = result.culprits()[0].worst
    assert worst is not None and worst.sqnr_db < result.culprits()[0].tolerance_db
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_compare_compiled_backend_that_changes_nothing_compiles_only_the_model() -> None:
    result = _compare(_model(), "eager")
    assert [(m.module, m.diverges, m.error) for m in result.modules] == [("", False, None)]
    assert result.culprits() == [] and result.to_dict()["culprits"] == []
    assert {t.what for t in result.modules[0].tensors} >= {"output", "grad of layers.0.weight", "grad of layers.2.bias"}


def test_tensor_delta_inf_against_finite_is_minus_infinity() -> None:
    delta = tensor_delta("output", torch.tensor([1.0, float("inf")]), torch.tensor([1.0, 3.0]))
    assert delta.sqnr_db == -math.inf and delta.max_abs_diff == math.inf and delta.nonfinite == "eager"
