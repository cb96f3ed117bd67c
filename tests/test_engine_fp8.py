"""The fp8 engine against the hand-written torchao float8 recipe, bit for bit.

The recipe is torchao's own: ``convert_to_float8_training`` with the recipe's config (CPU:
``emulate=False``, torch's CPU ``_scaled_mm``), bf16 autocast, backward, clip, optimizer step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit
from tests.helpers.models import make_batches

pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear

pytestmark = pytest.mark.filterwarnings("ignore:precision='fp8.*no fp8 GEMM:UserWarning")

STEPS = 6
D_IN, CLASSES = 32, 16


class Fp8Net(nn.Module):
    """Two fp8-sized Linear layers around a norm, and a head (all dims multiples of 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 64)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(self.norm(self.fc1(x)))))


def run_recipe(model: nn.Module, recipe: str, batches, *, accumulation: int = 1, clip: float | None = None,
               module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """torchao's float8 training loop written out by hand (the optimizer is built after converting)."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    assert config.emulate is False  # CPU: torch's CPU _scaled_mm, the setting the engine uses
    model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y) / accumulation
        loss.backward()
        if (i + 1) % accumulation == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, opt


def run_engine(model: nn.Module, precision: str, batches, **engine) -> tuple[nn.Module, torch.optim.Optimizer, ampkit.MixedPrecision]:
    mp = ampkit.MixedPrecision(precision, device="cpu", **engine)
    model = mp.prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for x, y in batches:
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        mp.step(opt)
    return model, opt, mp


def assert_same_training(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    (model_a, opt_a), (model_b, opt_b) = a, b
    for (name, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs from the torchao recipe"
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for field, value in state_a[key].items():
            assert torch.equal(value, state_b[key][field]), f"optimizer state {key}.{field} differs"


def _pair(seed: int, steps: int = STEPS):
    reference = Fp8Net()
    return reference, copy.deepcopy(reference), copy.deepcopy(reference), make_batches(
        steps, batch=16, d_in=D_IN, classes=CLASSES, seed=seed)


@pytest.mark.parametrize(("precision", "recipe"), [("fp8", "tensorwise"), ("fp8-tensorwise", "tensorwise"),
                                                   ("fp8-rowwise", "rowwise")])
def test_engine_fp8_bitexact_with_torchao_recipe(precision: str, recipe: str, seed: int) -> None:
    reference, model_a, model_b, batches = _pair(seed)
    recipe_run = run_recipe(model_a, recipe, batches, clip=1.0)
    model, opt, mp = run_engine(model_b, precision, batches, clip_grad_norm=1.0)
    assert_same_training(recipe_run, (model, opt))
    assert mp.fp8.layers == ["fc1", "fc2", "head"]
    assert all(isinstance(m, Float8Linear) for m in (model.fc1, model.fc2, model.head))
    assert not torch.equal(reference.fc1.weight, model.fc1.weight), "training must change the weights"


def test_engine_fp8_accumulation_3_with_clipping_bitexact_with_torchao_recipe(seed: int) -> None:
    _, model_a, model_b, batches = _pair(seed, steps=3 * STEPS)
    recipe_run = run_recipe(model_a, "tensorwise", batches, accumulation=3, clip=0.5)
    model, opt, mp = run_engine(model_b, "fp8", batches, grad_accumulation=3, clip_grad_norm=0.5)
    assert_same_training(recipe_run, (model, opt))
    assert mp.optimizer_steps == STEPS


def test_engine_fp8_keep_fp32_module_stays_linear_in_fp32_and_bitexact(seed: int) -> None:
    _, model_a, model_b, batches = _pair(seed)
    ampkit.keep_fp32(model_a.head)  # the recipe keeps the head out of fp8 and out of autocast by hand
    recipe_run = run_recipe(model_a, "tensorwise", batches, module_filter_fn=lambda _m, fqn: fqn != "head")
    model, opt, mp = run_engine(model_b, "fp8", batches, keep_fp32=["head"])
    assert_same_training(recipe_run, (model, opt))
    assert type(model.head) is nn.Linear and mp.fp8.layers == ["fc1", "fc2"]
    with mp.autocast():
        assert model.head(torch.randn(2, 32)).dtype == torch.float32


def test_engine_fp8_prepare_returns_the_converted_root_linear() -> None:
    mp = ampkit.MixedPrecision("fp8", device="cpu")
    linear = nn.Linear(32, 32)
    model = mp.prepare(linear)
    assert isinstance(model, Float8Linear) and model is not linear
    assert model.weight is linear.weight, "the parameters stay the same objects (optimizers built before stay valid)"
    assert mp.models == [model] and mp.fp8.layers == [""]
    assert mp.prepare(model) is model and mp.fp8.layers == [""], "preparing twice converts nothing more"


def test_engine_fp8_prepare_converts_only_layers_with_dims_multiple_of_16() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 24), nn.Linear(24, 16), nn.Linear(16, 16))
    mp = ampkit.MixedPrecision("fp8", device="cpu")
    model = mp.prepare(model)
    assert mp.fp8.layers == ["0", "3"]
    assert [type(m) is nn.Linear for m in model] == [False, True, True, False]


def test_engine_fp8_prepare_without_a_qualifying_layer_warns_with_the_count() -> None:
    mp = ampkit.MixedPrecision("fp8", device="cpu")
    with pytest.warns(UserWarning, match=r"no Linear layer was converted to fp8 \(the model has 2 nn.Linear"):
        mp.prepare(nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2)))
    assert mp.fp8.layers == []


def test_engine_fp8_state_dict_round_trip_across_the_alias_is_bit_identical(seed: int) -> None:
    _, model_a, model_b, batches = _pair(seed, steps=2 * STEPS)
    uninterrupted = run_engine(model_a, "fp8", batches, grad_accumulation=2)
    model, opt, mp = run_engine(model_b, "fp8", batches[:6], grad_accumulation=2)
    saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()), "mp": mp.state_dict()}
    resumed_mp = ampkit.MixedPrecision("fp8-tensorwise", device="cpu", grad_accumulation=2)
    resumed = resumed_mp.prepare(Fp8Net())
    resumed.load_state_dict(saved["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, fused=True)
    resumed_opt.load_state_dict(saved["opt"])
    resumed_mp.load_state_dict(saved["mp"])
    assert resumed_mp.optimizer_steps == 3
    for x, y in batches[6:]:
        with resumed_mp.autocast():
            loss = F.cross_entropy(resumed(x), y)
        resumed_mp.backward(loss)
        resumed_mp.step(resumed_opt)
    assert_same_training(uninterrupted[:2], (resumed, resumed_opt))
