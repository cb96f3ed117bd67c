from __future__ import annotations

import warnings

import pytest
import torch

import ampkit
from ampkit import DynamicLossScaler, StaticLossScaler

OVERFLOW, CLEAN = torch.ones(()), torch.zeros(())


def scale_of(s: DynamicLossScaler) -> float:
    return float(s.scale_tensor())


def test_scaler_defaults_match_torch_gradscaler() -> None:
    ours, theirs = DynamicLossScaler(), torch.amp.GradScaler("cpu")
    assert ours.state_dict()["scale"] == theirs.get_scale() == 2.0**16
    assert (ours.growth_factor, ours.backoff_factor, ours.growth_interval) == (
        theirs.get_growth_factor(), theirs.get_backoff_factor(), theirs.get_growth_interval())
    assert ours.max_scale == 2.0**24 and ours.min_scale == 2.0**-149 and ours.hysteresis == 1


def _drive_gradscaler(scaler: torch.amp.GradScaler, pattern: list[bool]) -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    for overflow in pattern:
        p.grad = torch.full((2,), float("inf") if overflow else 1.0)
        scaler.scale(torch.ones(()))  # initialises the scale on first use
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()


def test_scaler_state_dict_loads_into_torch_gradscaler() -> None:
    ours = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    for f in (OVERFLOW, CLEAN, CLEAN):
        ours.update(f)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == 512.0
    assert theirs.state_dict()["_growth_tracker"] == 2
    _drive_gradscaler(theirs, [False])  # third clean step: grows
    ours.update(CLEAN)
    assert theirs.get_scale() == scale_of(ours) == 1024.0


def test_scaler_loads_torch_gradscaler_state_dict() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=2)
    _drive_gradscaler(theirs, [True, False])
    ours = DynamicLossScaler()
    ours.load_state_dict(theirs.state_dict())
    assert scale_of(ours) == theirs.get_scale() == 2048.0
    assert ours.growth_interval == 2 and ours.state_dict()["_growth_tracker"] == 1
    ours.update(CLEAN)
    _drive_gradscaler(theirs, [False])
    assert scale_of(ours) == theirs.get_scale() == 4096.0


def test_scaler_load_empty_state_from_disabled_gradscaler_explains() -> None:
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(RuntimeError, match="disabled torch.amp.GradScaler"):
        DynamicLossScaler().load_state_dict(disabled.state_dict())


def test_scaler_max_scale_caps_growth() -> None:
    s = DynamicLossScaler(init_scale=2.0**23, growth_interval=1, max_scale=2.0**24)
    for _ in range(5):
        s.update(CLEAN)
    assert scale_of(s) == 2.0**24


def test_scaler_init_above_max_scale_only_backs_off() -> None:
    s = DynamicLossScaler(init_scale=2.0**30, growth_interval=1)
    s.update(CLEAN)
    assert scale_of(s) == 2.0**30
    s.update(OVERFLOW)
    assert scale_of(s) == 2.0**29


def test_scaler_min_scale_floors_backoff() -> None:
    s = DynamicLossScaler(init_scale=4.0, min_scale=1.0)
    for _ in range(6):
        s.update(OVERFLOW)
    assert scale_of(s) == 1.0


def test_scaler_hysteresis_consecutive_forgives_after_a_clean_step() -> None:
    s = DynamicLossScaler(init_scale=1024.0, hysteresis=2, hysteresis_mode="consecutive")
    for f in (OVERFLOW, CLEAN, OVERFLOW, CLEAN, OVERFLOW):
        s.update(f)
    assert scale_of(s) == 1024.0  # never two overflows in a row
    s.update(OVERFLOW)
    assert scale_of(s) == 512.0  # the second consecutive one backs off


def test_scaler_hysteresis_windowed_counts_overflows_until_growth() -> None:
    s = DynamicLossScaler(init_scale=1024.0, hysteresis=2, hysteresis_mode="windowed")
    for f in (OVERFLOW, CLEAN, OVERFLOW):
        s.update(f)
    assert scale_of(s) == 512.0  # the same pattern that "consecutive" forgives


def test_scaler_hysteresis_windowed_resets_when_scale_grows() -> None:
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=2, hysteresis=2, hysteresis_mode="windowed")
    for f in (OVERFLOW, CLEAN, CLEAN):  # the two clean steps grow the scale and forgive
        s.update(f)
    assert scale_of(s) == 2048.0
    s.update(OVERFLOW)
    assert scale_of(s) == 2048.0


def test_scaler_hysteresis_one_overflow_resets_growth_tracker() -> None:
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2, hysteresis=3)
    for f in (CLEAN, OVERFLOW, CLEAN):
        s.update(f)
    assert scale_of(s) == 8.0  # tolerated overflow still restarts the growth window
    s.update(CLEAN)
    assert scale_of(s) == 16.0


def test_scaler_state_dict_round_trips_hysteresis() -> None:
    s = DynamicLossScaler(init_scale=64.0, hysteresis=3, hysteresis_mode="windowed")
    s.update(OVERFLOW)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_scaler_static_never_moves_and_still_skips() -> None:
    s = StaticLossScaler(256.0)
    grads = [torch.tensor([512.0, float("nan")])]
    found = s.unscale_(grads, torch.zeros(()))
    assert float(found) == 1.0 and grads[0][0] == 2.0
    s.update(found)
    assert float(s.scale_tensor()) == 256.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"growth_factor": 1.0}, "growth_factor"), ({"backoff_factor": 1.5}, "backoff_factor"),
     ({"growth_interval": 0}, "growth_interval"), ({"hysteresis": 0}, "hysteresis"),
     ({"hysteresis_mode": "sometimes"}, "consecutive' or 'windowed"),
     ({"min_scale": 8.0, "max_scale": 4.0}, "above max_scale")],
)
def test_scaler_rejects_bad_settings(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)


def test_scaler_with_bf16_warns_once() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp = ampkit.MixedPrecision("bf16", device="cpu", scaler="dynamic")
    assert [str(w.message) for w in caught if "SCALER_WITH_BF16" in str(w.message)]
    assert len(caught) == 1
    assert mp.scaler.enabled


def test_scaler_off_by_default_for_bf16_and_fp32() -> None:
    assert not ampkit.MixedPrecision("bf16", device="cpu").scaler.enabled
    assert not ampkit.MixedPrecision("fp32", device="cpu").scaler.enabled
    assert isinstance(ampkit.MixedPrecision("fp16", device="cpu").scaler, DynamicLossScaler)


def test_scaler_to_places_the_live_state_on_the_device() -> None:
    s = ampkit.DynamicLossScaler(init_scale=8.0, growth_interval=1)
    assert s.to("cpu") is s
    s.update(torch.zeros(()))
    moved = s.to(torch.device("cpu"))
    assert float(moved.scale_tensor("cpu")) == 16.0 and s.state_dict()["scale"] == 16.0


@pytest.mark.parametrize("init_scale", [-1.0, 0.0, float("nan"), float("inf")])
def test_scaler_dynamic_rejects_bad_init_scale_by_its_own_name(init_scale: float) -> None:
    with pytest.raises(ValueError) as err:
        DynamicLossScaler(init_scale=init_scale)
    assert str(err.value).startswith(f"DynamicLossScaler(init_scale={init_scale!r}): must be a finite number > 0")
    assert "StaticLossScaler" not in str(err.value) and "scale=" not in str(err.value).replace("init_scale=", "")
def test_scaler_default_min_scale_never_binds_while_gradscaler_scale_is_positive() -> None:
    # GradScaler's update is torch._amp_update_scale_ on its scale tensor; drive both with overflows.
    ours = DynamicLossScaler()
    theirs, tracker = torch.full((), 2.0**16), torch.zeros((), dtype=torch.int32)
    for _ in range(200):
        ours.update(OVERFLOW)
        torch._amp_update_scale_(theirs, tracker, OVERFLOW, 2.0, 0.5, 2000)
        if float(theirs) > 0:
            assert torch.equal(ours.scale_tensor(), theirs)
    assert float(theirs) == 0.0, "GradScaler's scale reaches exactly 0 after ~166 overflows"
    assert scale_of(ours) == 2.0**-149 == ampkit.scaler.DEFAULT_MIN_SCALE


def test_scaler_skips_a_clean_step_whose_inverse_scale_overflows_fp32() -> None:
    # 1/2**-140 is not an fp32 number: unscaling would turn these finite gradients into inf/NaN.
    grads = [torch.tensor([0.0, 1e-30])]
    found = DynamicLossScaler(init_scale=2.0**-140).unscale_(grads, torch.zeros(()))
    assert float(found) == 1.0
    normal = DynamicLossScaler(init_scale=2.0**-120).unscale_([torch.tensor([0.0, 1e-30])], torch.zeros(()))
    assert float(normal) == 0.0


@pytest.mark.parametrize("scaler", [DynamicLossScaler, StaticLossScaler])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -2.0, "1024"])
def test_scaler_load_state_dict_rejects_a_scale_that_is_not_finite_and_positive(scaler, bad) -> None:
    s = scaler(init_scale=8.0) if scaler is DynamicLossScaler else scaler(8.0)
    state = {**s.state_dict(), "scale": bad}
    with pytest.raises(ValueError, match=r"scale=.* must be a finite number > 0"):
        s.load_state_dict(state)
    assert scale_of(s) == 8.0  # nothing was loaded


@pytest.mark.parametrize(("key", "value"), [
    ("growth_factor", 1.0), ("growth_factor", True), ("backoff_factor", 1.5), ("growth_interval", 0),
    ("growth_interval", True), ("hysteresis", 0), ("hysteresis", True), ("hysteresis_mode", "sometimes"),
    ("max_scale", 0.0), ("min_scale", float("inf")), ("min_scale", 0.0),
])
def test_scaler_dynamic_constructor_and_state_check_reject_the_same_settings(key, value) -> None:
    # One rule per setting serves both: a scaler that could be built but not resumed (or the reverse)
    # would break a checkpoint round trip.
    with pytest.raises(ValueError, match=rf"{key}={value!r} must be"):
        DynamicLossScaler(**{key: value})
    with pytest.raises(ValueError, match=rf"{key}={value!r} must be"):
        DynamicLossScaler().load_state_dict({**DynamicLossScaler().state_dict(), key: value})


@pytest.mark.parametrize(("key", "value", "message"), [
    ("_growth_tracker", -1, "_growth_tracker=-1 must be an int >= 0"),
    ("growth_factor", 0.5, "growth_factor=0.5 must be a number > 1"),
    ("hysteresis_mode", "sometimes", "'consecutive' or 'windowed'"),
    ("min_scale", 0.0, "min_scale=0.0 must be None or a finite number > 0"),
])
def test_scaler_load_state_dict_rejects_bad_fields_and_changes_nothing(key, value, message) -> None:
    s = DynamicLossScaler(init_scale=8.0)
    before = s.state_dict()
    with pytest.raises(ValueError, match=message):
        s.load_state_dict({**before, key: value})
    assert s.state_dict() == before


def test_scaler_load_state_dict_warns_on_unknown_keys_and_loads_the_rest() -> None:
    s = DynamicLossScaler()
    with pytest.warns(UserWarning, match=r"ignoring unknown keys \['from_the_future'\]"):
        s.load_state_dict({**DynamicLossScaler(init_scale=4.0).state_dict(), "from_the_future": 1})
    assert scale_of(s) == 4.0
