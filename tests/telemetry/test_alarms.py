"""Alarms: each fires on its cause, names it, and takes its action; healthy runs stay quiet."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.telemetry import (
    AlarmWarning,
    GradNormSpikeAlarm,
    LossNonFiniteAlarm,
    ScaleCollapseAlarm,
    SkipRateAlarm,
    Telemetry,
    TrainingStopped,
)

K = 10


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _dataset(n: int = 32, nan_sample: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.randn(n, 4), torch.randn(n, 1)
    if nan_sample is not None:
        x[nan_sample, 2] = float("nan")
    return x, y


def _train(mp: ampkit.MixedPrecision, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
           y: torch.Tensor, loss_scale: float = 1.0) -> None:
    with mp.autocast():
        loss = (model(x).float() - y).pow(2).mean() * loss_scale
    mp.backward(loss)
    mp.step(opt)


def _engine(precision: str, model: nn.Module, tel: Telemetry, **kw: object) -> tuple[ampkit.MixedPrecision, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision(precision, device="cpu", telemetry=tel, **kw)  # type: ignore[arg-type]
    mp.prepare(model)
    return mp, opt


def test_telemetry_alarm_scale_collapse_names_the_nan_sample_within_k_steps() -> None:
    # Full-batch training on a dataset with one NaN sample: every step overflows, whatever the scale.
    records: list[dict] = []
    model = _mlp()
    tel = Telemetry(sinks=[records.append], flush_every=5,
                    alarms=[ScaleCollapseAlarm(consecutive_backoffs=K, action="stop")])
    mp, opt = _engine("fp16", model, tel)
    x, y = _dataset(nan_sample=17)
    with pytest.raises(TrainingStopped) as info:
        for _ in range(3 * K):
            _train(mp, model, opt, x, y)
    event = info.value.event
    assert event.alarm == "SCALE_COLLAPSE" and event.code == "SCALE_COLLAPSE"
    assert event.step <= K and mp.optimizer_steps <= K
    assert event.cause == "nonfinite_input"
    assert "inputs held inf/NaN" in str(info.value) and "SCALE_COLLAPSE" in str(info.value)
    assert event.evidence["nonfinite_input_steps"] == list(range(1, K + 1))
    assert event.evidence["consecutive_backoffs"] == K and event.evidence["scale_after"] < event.evidence["scale_before"]
    assert records[event.step - 1]["alarms"][0]["code"] == "SCALE_COLLAPSE"  # the sinks got it before the stop
    finding = event.to_finding()
    assert finding is not None and finding.severity == "error" and finding.step == event.step


def test_telemetry_alarm_scale_collapse_silent_on_healthy_fp16_with_normal_backoffs() -> None:
    # A fast-growing scale overflows now and then and backs off once each time: normal dynamics.
    records: list[dict] = []
    model = _mlp()
    tel = Telemetry(sinks=[records.append], flush_every=10, alarms=[ScaleCollapseAlarm(consecutive_backoffs=K)])
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**14, growth_interval=3, max_scale=None)
    mp, opt = _engine("fp16", model, tel, scaler=scaler)
    x, y = _dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AlarmWarning)
        for _ in range(60):
            _train(mp, model, opt, x, y, loss_scale=8.0)
    tel.close()
    backoffs = [r["step"] for r in records if r["skipped"] and r["next_scale"] < r["scale"]]
    assert len(backoffs) >= 3, f"the run must see several normal backoffs, saw {backoffs}"
    assert not any("alarms" in r for r in records)
    assert sum(r["skipped"] for r in records) < len(records) / 3


def test_telemetry_alarm_scale_collapse_blames_backward_overflow_when_data_and_loss_are_finite() -> None:
    model = _mlp()
    tel = Telemetry(flush_every=K, alarms=[ScaleCollapseAlarm(consecutive_backoffs=K, action="stop")])
    mp, opt = _engine("fp16", model, tel)
    x, y = _dataset()
    with pytest.raises(TrainingStopped) as info:
        for _ in range(2 * K):
            _train(mp, model, opt, x, y, loss_scale=1e9)  # finite fp32 loss; its fp16 gradient overflows
    assert info.value.event.cause == "gradient_overflow"
    assert info.value.event.evidence["nonfinite_loss_steps"] == []


def test_telemetry_alarm_scale_collapse_below_critical_scale_fires_at_once() -> None:
    model = _mlp()
    tel = Telemetry(flush_every=1, alarms=[ScaleCollapseAlarm(consecutive_backoffs=100, critical_scale=2.0**16,
                                                              action="stop")])
    mp, opt = _engine("fp16", model, tel)
    x, _ = _dataset()
    with pytest.raises(TrainingStopped) as info:
        for _ in range(5):
            with mp.autocast():
                loss = torch.sqrt(model(x).float() - 1e6).mean()  # NaN loss and gradient, finite inputs
            mp.backward(loss)
            mp.step(opt)
    assert info.value.event.step == 1 and info.value.event.cause == "nonfinite_loss"
    assert "below critical_scale=65536" in info.value.event.message


def test_telemetry_alarm_scale_collapse_rejects_min_scale_the_scalers_floor_keyword() -> None:
    # critical_scale is the alarm's threshold; min_scale is DynamicLossScaler's floor, another thing.
    with pytest.raises(TypeError, match="min_scale"):
        ScaleCollapseAlarm(min_scale=4.0)  # type: ignore[call-arg]


def _nan_steps(mp: ampkit.MixedPrecision, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    x, y = _dataset(nan_sample=5)
    for _ in range(steps):
        _train(mp, model, opt, x, y)


def test_telemetry_alarm_scale_collapse_fires_after_50_steps_at_the_scaler_floor_with_the_cause() -> None:
    # From 2**16 to the floor 2**10 takes 6 backoffs (steps 1-6); steps 7.. run at the floor, where a
    # skip backs nothing off, so only the floor rule can see the collapse (no backoff streak of 100).
    model = _mlp()
    tel = Telemetry(flush_every=1, alarms=[ScaleCollapseAlarm(consecutive_backoffs=100, action="stop")])
    mp, opt = _engine("fp16", model, tel, scaler=ampkit.DynamicLossScaler(min_scale=2.0**10))
    with pytest.raises(TrainingStopped) as info:
        _nan_steps(mp, model, opt, 80)
    event = info.value.event
    assert (event.code, event.step, event.cause) == ("SCALE_COLLAPSE", 6 + 50, "nonfinite_input")
    assert event.evidence["steps_at_floor"] == 50 and event.evidence["floor"] == 2.0**10
    assert event.evidence["backoffs_before"] == 6 and event.evidence["first_step"] == 7
    assert "at its floor min_scale=1024 for 50 steps in a row" in event.message
    assert "inputs held inf/NaN" in event.message


def test_telemetry_alarm_scale_collapse_fires_at_the_default_floor_after_a_long_nan_burst() -> None:
    # 165 backoffs take 2**16 to the default floor 2**-149; 50 steps later the floor rule fires (the
    # other two rules are set out of reach).
    model = _mlp()
    tel = Telemetry(flush_every=25, alarms=[ScaleCollapseAlarm(consecutive_backoffs=1000, critical_scale=0.0,
                                                               action="stop")])
    mp, opt = _engine("fp16", model, tel)
    with pytest.raises(TrainingStopped) as info:
        _nan_steps(mp, model, opt, 250)
    event = info.value.event
    assert (event.step, event.cause, event.evidence["floor"]) == (165 + 50, "nonfinite_input", 2.0**-149)
    assert "1/scale overflows fp32, so every step is skipped" in event.message


def test_telemetry_alarm_loss_nonfinite_names_the_input() -> None:
    records: list[dict] = []
    model = _mlp()
    tel = Telemetry(sinks=[records.append], flush_every=4, alarms=[LossNonFiniteAlarm()])
    mp, opt = _engine("bf16", model, tel)
    x, y = _dataset()
    bad = x.clone()
    bad[3, 0] = float("nan")
    with pytest.warns(AlarmWarning, match=r"LOSS_NONFINITE at step 3: .*inputs held inf/NaN"):
        for step in range(1, 9):
            _train(mp, model, opt, bad if step == 3 else x, y)
    fired = [r for r in records if "alarms" in r]
    assert [r["step"] for r in fired] == [3]
    assert fired[0]["alarms"][0]["code"] == "NONFINITE_INPUT" and fired[0]["skipped"] is True
    assert [r["input_nonfinite"] for r in records] == [s == 3 for s in range(1, 9)]


def test_telemetry_alarm_skip_rate_over_window() -> None:
    records: list[dict] = []
    model = _mlp()
    tel = Telemetry(sinks=[records.append], flush_every=5,
                    alarms=[SkipRateAlarm(window=10, max_rate=0.2, action="stop")])
    mp, opt = _engine("bf16", model, tel)
    x, y = _dataset()
    with pytest.raises(TrainingStopped) as info:
        for step in range(1, 41):
            # every third step from step 4 on has an inf loss (and is skipped: skip_nonfinite)
            _train(mp, model, opt, x, y, loss_scale=math.inf if step >= 4 and step % 3 == 0 else 1.0)
    event = info.value.event
    assert event.alarm == "SKIP_RATE" and event.evidence["rate"] > 0.2 and event.cause == "nonfinite_data"
    assert event.step <= 20


def test_telemetry_alarm_skip_rate_ignores_dynamic_scale_calibration() -> None:
    records: list[dict] = []
    model = _mlp()
    tel = Telemetry(sinks=[records.append], flush_every=10,
                    alarms=[SkipRateAlarm(window=10, max_rate=0.1, action="stop")])
    mp, opt = _engine("fp16", model, tel, scaler=ampkit.DynamicLossScaler(init_scale=2.0**24))
    x, y = _dataset()
    for _ in range(30):  # the first steps overflow and back off: calibration, not a skip problem
        _train(mp, model, opt, x, y)
    calibration = [r["step"] for r in records if r["skipped"]]
    assert len(calibration) >= 3 and calibration == list(range(1, len(calibration) + 1))


def test_telemetry_alarm_grad_norm_spike_vs_running_median() -> None:
    records: list[dict] = []
    model = _mlp()
    tel = Telemetry(sinks=[records.append], flush_every=8,
                    alarms=[GradNormSpikeAlarm(window=20, factor=10.0, min_history=10)])
    mp, opt = _engine("bf16", model, tel)
    x, y = _dataset()
    with pytest.warns(AlarmWarning, match="GRAD_NORM_SPIKE at step 30"):
        for step in range(1, 41):
            _train(mp, model, opt, x, y, loss_scale=1000.0 if step == 30 else 1.0)
    tel.close()
    fired = [(r["step"], a["evidence"]["ratio"]) for r in records for a in r.get("alarms", [])]
    assert len(fired) == 1 and fired[0][0] == 30 and fired[0][1] > 10


def test_telemetry_alarm_doctor_action_warns_when_the_doctor_is_off() -> None:
    model = _mlp()
    tel = Telemetry(flush_every=2, alarms=[LossNonFiniteAlarm(action="doctor")])
    mp, opt = _engine("bf16", model, tel)
    x, y = _dataset(nan_sample=0)
    with pytest.warns(AlarmWarning, match=r"LOSS_NONFINITE at step 1: .*the doctor, but it is off"):
        _train(mp, model, opt, x, y)
        _train(mp, model, opt, x, y)


def test_telemetry_alarm_doctor_action_replays_the_collapse() -> None:
    model = _mlp()
    tel = Telemetry(flush_every=K, alarms=[ScaleCollapseAlarm(consecutive_backoffs=K, action="doctor")])
    mp, opt = _engine("fp16", model, tel, doctor=True)
    mp.doctor.max_replays = 0  # only the alarm's replay, not the doctor's own ones
    x, y = _dataset(nan_sample=17)
    for _ in range(K):
        _train(mp, model, opt, x, y)
    collapse = [f for f in mp.doctor.findings if f.code == "SCALE_COLLAPSE"]
    assert len(collapse) == 1, [f.code for f in mp.doctor.findings]
    assert collapse[0].evidence["cause"] == "nonfinite_data_or_loss"
    assert any(f.code == "NONFINITE_INPUT" for f in mp.doctor.findings)


def test_telemetry_alarm_state_dict_round_trip() -> None:
    model = _mlp()
    tel = Telemetry(flush_every=5, alarms=[GradNormSpikeAlarm(min_history=3), SkipRateAlarm(window=4)])
    mp, opt = _engine("bf16", model, tel)
    x, y = _dataset()
    for _ in range(5):
        _train(mp, model, opt, x, y)
    state = tel.state_dict()
    fresh = Telemetry(alarms=[GradNormSpikeAlarm(min_history=3), SkipRateAlarm(window=4)])
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and len(state["alarms"][0]["state"]["history"]) == 5


@pytest.mark.parametrize("build, message", [
    (lambda: ScaleCollapseAlarm(consecutive_backoffs=0), "consecutive_backoffs=0"),
    (lambda: ScaleCollapseAlarm(action="explode"), "action='explode'"),  # type: ignore[arg-type]
    (lambda: SkipRateAlarm(max_rate=1.5), "max_rate=1.5"),
    (lambda: GradNormSpikeAlarm(factor=0.5), "factor=0.5"),
    (lambda: GradNormSpikeAlarm(window=5, min_history=10), "min_history=10"),
    (lambda: Telemetry(alarms=["SCALE_COLLAPSE"]), "each alarm must be"),  # type: ignore[list-item]
])
def test_telemetry_alarm_bad_config_is_named(build, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace("[", r"\[")):
        build()
