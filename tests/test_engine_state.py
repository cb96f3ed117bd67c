"""Engine state: loading checks every key, type and range first; a bad state changes nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from ampkit import DynamicLossScaler


def _engine_mid_window() -> ampkit.MixedPrecision:
    """An fp16 engine after 3 micro-batches with accumulation 2: micro_step 1, optimizer_steps 1."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2)
    for _ in range(3):
        with mp.autocast():
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        mp.backward(loss)
        mp.step(opt)
    return mp


def _position(mp: ampkit.MixedPrecision) -> tuple[int, int, float]:
    return mp.micro_step, mp.optimizer_steps, float(mp.scale)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_engine_load_state_dict_rejects_a_scale_that_is_not_finite_and_positive(bad) -> None:
    mp = _engine_mid_window()
    state = mp.state_dict()
    state["scaler"]["scale"] = bad
    before = _position(mp)
    with pytest.raises(ValueError, match=r"scale=.* must be a finite number > 0"):
        ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2).load_state_dict(state)
    with pytest.raises(ValueError):
        mp.load_state_dict(state)
    assert _position(mp) == before


@pytest.mark.parametrize("micro", [2, 5, -1])
def test_engine_load_state_dict_rejects_micro_step_outside_the_accumulation_window(micro) -> None:
    mp = _engine_mid_window()
    before = _position(mp)
    with pytest.raises(ValueError, match=rf"micro_step={micro} must be an int in \[0, grad_accumulation=2\)"):
        mp.load_state_dict({**mp.state_dict(), "micro_step": micro})
    assert _position(mp) == before


def test_engine_load_state_dict_rejects_a_missing_required_key() -> None:
    mp = _engine_mid_window()
    state = mp.state_dict()
    del state["optimizer_steps"]
    with pytest.raises(ValueError, match="required key 'optimizer_steps' is missing"):
        mp.load_state_dict(state)
    assert mp.optimizer_steps == 1


def test_engine_load_state_dict_warns_on_unknown_keys_and_loads_the_rest() -> None:
    saved = _engine_mid_window().state_dict()
    mp = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2)
    with pytest.warns(UserWarning, match=r"engine state: ignoring unknown keys \['added_later'\]"):
        mp.load_state_dict({**saved, "added_later": 3})
    assert (mp.micro_step, mp.optimizer_steps) == (1, 1)


def test_engine_load_state_dict_rejects_a_whole_checkpoint_with_a_load_checkpoint_hint(tmp_path) -> None:
    model = nn.Linear(4, 2)
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    ampkit.save_checkpoint(tmp_path / "ck.pt", model=model, engine=mp)
    whole = torch.load(tmp_path / "ck.pt", weights_only=True)
    with pytest.raises(ValueError, match=r"whole checkpoint.*ampkit\.load_checkpoint\(path, model=.*ckpt\['engine'\]"):
        mp.load_state_dict(whole)


def test_engine_load_state_dict_maps_a_gradscaler_state_and_keeps_the_position() -> None:
    mp = _engine_mid_window()
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    mp.load_state_dict(theirs.state_dict())
    assert _position(mp) == (1, 1, 1024.0)
    assert isinstance(mp.scaler, DynamicLossScaler) and mp.scaler.growth_interval == 7


def test_engine_load_state_dict_rejects_a_gradscaler_state_without_a_loss_scaler() -> None:
    mp = ampkit.MixedPrecision("bf16", device="cpu")
    with pytest.raises(ValueError, match=r"holds a loss scale \(65536.0\) but this scaler is NoLossScaler"):
        mp.load_state_dict(torch.amp.GradScaler("cpu").state_dict())


def test_engine_never_applies_a_step_at_zero_scale_after_200_nonfinite_steps() -> None:
    # ~166 overflows in a row take GradScaler's scale to exactly 0.0; the next clean step is then
    # unscaled by 1/0 = inf and applied, and every weight becomes NaN.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    x = torch.randn(8, 4)
    for step in range(205):
        with mp.autocast():
            loss = model(x).float().pow(2).mean() * (float("nan") if step < 200 else 1.0)
        mp.backward(loss)
        mp.step(sgd)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert float(mp.scale) == 2.0**-149  # at the floor, never 0
