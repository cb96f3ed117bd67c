"""The fp8 engine against the hand-written torchao float8 recipe, bit for bit.

The recipe is torchao's own: ``convert_to_float8_training`` with the recipe's config (CPU:
``emulate=False``, torch's CPU ``_scaled_mm``), bf16 autocast, backward, clip, optimizer step.
It lives in ``benchmarks/gpucheck/fp8recipe.py``, which the GPU check's ``fp8`` section runs on
the device: one copy of the recipe for both.  torchao's ``rowwise_with_gw_hp`` recipe raises under
CPU autocast (docs/fp8.md, "Recipes"), so ``fp8-rowwise-gw-hp`` is compared without autocast, where
the recipe runs, and trains under the engine's autocast in a test of its own.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit
from ampkit.precision import FP8_RECIPES
from gpucheck.fp8recipe import loss_of, torchao_config, train_engine, train_recipe, training_difference
from tests.helpers.models import make_batches

pytest.importorskip("torchao")
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


def run_recipe(model: nn.Module, precision: str, batches, **kw) -> tuple[nn.Module, torch.optim.Optimizer]:
    assert torchao_config(precision).emulate is False  # CPU: torch's CPU _scaled_mm, the setting the engine uses
    return train_recipe(model, precision, batches, **kw)


def assert_same_training(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    problem = training_difference(a, b)
    assert problem is None, f"differs from the torchao recipe at {problem}"


def _pair(seed: int, steps: int = STEPS):
    reference = Fp8Net()
    return reference, copy.deepcopy(reference), copy.deepcopy(reference), make_batches(
        steps, batch=16, d_in=D_IN, classes=CLASSES, seed=seed)


@pytest.mark.parametrize(("precision", "autocast"), [
    ("fp8", True), ("fp8-tensorwise", True), ("fp8-rowwise", True),
    ("fp8-rowwise-gw-hp", False),  # torchao's recipe raises under CPU autocast; without it, it runs
])
def test_engine_fp8_bitexact_with_torchao_recipe(precision: str, autocast: bool, seed: int) -> None:
    reference, model_a, model_b, batches = _pair(seed)
    recipe_run = run_recipe(model_a, precision, batches, clip=1.0, autocast=autocast)
    model, opt, mp = train_engine(model_b, precision, batches, clip_grad_norm=1.0, autocast=autocast)
    assert_same_training(recipe_run, (model, opt))
    assert mp.fp8.layers == ["fc1", "fc2", "head"]
    assert all(isinstance(m, Float8Linear) for m in (model.fc1, model.fc2, model.head))
    assert not torch.equal(reference.fc1.weight, model.fc1.weight), "training must change the weights"


def test_engine_fp8_accumulation_3_with_clipping_bitexact_with_torchao_recipe(seed: int) -> None:
    _, model_a, model_b, batches = _pair(seed, steps=3 * STEPS)
    recipe_run = run_recipe(model_a, "fp8", batches, accumulation=3, clip=0.5)
    model, opt, mp = train_engine(model_b, "fp8", batches, grad_accumulation=3, clip_grad_norm=0.5)
    assert_same_training(recipe_run, (model, opt))
    assert mp.optimizer_steps == STEPS


def test_engine_fp8_rowwise_gw_hp_trains_under_autocast_with_accumulation_and_clipping(seed: int) -> None:
    reference, _, model, batches = _pair(seed, steps=2 * STEPS)
    mp = ampkit.MixedPrecision("fp8-rowwise-gw-hp", device="cpu", grad_accumulation=2, clip_grad_norm=0.5)
    model = mp.prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses, skipped = [], []
    for x, y in batches:
        with mp.autocast():
            loss = loss_of(model(x), y)
        mp.backward(loss)
        result = mp.step(opt)
        losses.append(loss.detach())
        if result.boundary:
            skipped.append(result.skipped)
    assert torch.isfinite(torch.stack(losses)).all(), losses
    assert skipped == [False] * STEPS and mp.optimizer_steps == STEPS
    assert mp.fp8.layers == ["fc1", "fc2", "head"]
    for name, p in model.named_parameters():
        assert not torch.equal(p, reference.get_parameter(name)), f"{name} did not change"


def test_engine_fp8_keep_fp32_module_stays_linear_in_fp32_and_bitexact(seed: int) -> None:
    _, model_a, model_b, batches = _pair(seed)
    ampkit.keep_fp32(model_a.head)  # the recipe keeps the head out of fp8 and out of autocast by hand
    recipe_run = run_recipe(model_a, "fp8", batches, module_filter_fn=lambda _m, fqn: fqn != "head")
    model, opt, mp = train_engine(model_b, "fp8", batches, keep_fp32=["head"])
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
    uninterrupted = train_engine(model_a, "fp8", batches, grad_accumulation=2)
    model, opt, mp = train_engine(model_b, "fp8", batches[:6], grad_accumulation=2)
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
            loss = loss_of(resumed(x), y)
        resumed_mp.backward(loss)
        resumed_mp.step(resumed_opt)
    assert_same_training(uninterrupted[:2], (resumed, resumed_opt))


def _converted_by_hand(recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(Fp8Net(), config=Float8LinearConfig.from_recipe_name(recipe))


@pytest.mark.parametrize(("recipe", "precision", "fix"), [
    ("rowwise", "fp8", r"MixedPrecision\('fp8-rowwise'\)"),
    ("tensorwise", "fp8-rowwise", r"MixedPrecision\('fp8'\)"),
    ("rowwise_with_gw_hp", "fp8", r"MixedPrecision\('fp8-rowwise-gw-hp'\)"),
    ("rowwise_with_gw_hp", "fp8-rowwise", r"MixedPrecision\('fp8-rowwise-gw-hp'\)"),
    ("rowwise", "fp8-rowwise-gw-hp", r"MixedPrecision\('fp8-rowwise'\)"),
])
def test_engine_fp8_prepare_refuses_a_model_converted_with_another_recipe(recipe: str, precision: str, fix: str) -> None:
    mp = ampkit.MixedPrecision(precision, device="cpu")
    model = _converted_by_hand(recipe)
    with pytest.raises(ValueError, match=rf"(?s)precision={precision!r} trains torchao's .* recipe.*converted with "
                                         rf"torchao's {recipe!r} recipe.*{fix}"):
        mp.prepare(model)
    assert mp.models == [], "nothing was prepared"


def test_engine_fp8_prepare_refuses_a_config_of_its_own_naming_every_precision() -> None:
    from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training

    mp = ampkit.MixedPrecision("fp8", device="cpu")
    config = Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn))  # e4m3 grads
    model = convert_to_float8_training(Fp8Net(), config=config)
    listed = re.escape(", ".join(f"{precision!r} ({recipe})" for precision, recipe in FP8_RECIPES.items()))
    with pytest.raises(ValueError, match=rf"none of torchao's named recipes.*no precision for it \(it trains {listed}\)"):
        mp.prepare(model)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_engine_fp8_prepare_accepts_a_model_converted_by_hand_with_its_recipe(recipe: str) -> None:
    precision = next(p for p, r in FP8_RECIPES.items() if r == recipe)
    mp = ampkit.MixedPrecision(precision, device="cpu")
    model = _converted_by_hand(recipe)
    assert mp.prepare(model) is model and mp.fp8.layers == ["fc1", "fc2", "head"]
    assert mp.state_dict()["precision"] == precision
    with mp.autocast():  # the gw-hp layers converted by hand get the engine's input cast too
        loss = loss_of(model(torch.randn(16, D_IN)), torch.randint(0, CLASSES, (16,)))
    mp.backward(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
