"""FP8_FLUSH: a rising flush fraction of an fp8 operand fires; a flat one does not."""

from __future__ import annotations

import warnings

import pytest
import torch

import ampkit
from ampkit.telemetry import AlarmWarning, Fp8FlushAlarm, Telemetry, default_alarms

pytest.importorskip("torchao")


def _records(fractions: list[float], layer: str = "blocks.0.fc", op: str = "input") -> list[dict]:
    return [{"step": 1 + 100 * i, "rank": 0, "fp8_flush_fraction": {layer: {op: f, "weight": 0.0}},
             "fp8_amax": {layer: {op: 10.0 * (i + 1), "weight": 1.0}}} for i, f in enumerate(fractions)]


def _fire(fractions: list[float], **kw: float) -> list[int]:
    monitor = Fp8FlushAlarm(**kw).monitor()  # type: ignore[arg-type]
    return [r["step"] for r in _records(fractions) if monitor.observe(r) is not None]


def test_fp8_flush_alarm_fires_once_on_a_rising_fraction() -> None:
    # 0.3 % twice, then 1.5 % (above 1 % and 5x the low): fires at the third sample, not again while high.
    assert _fire([0.003, 0.003, 0.015, 0.03, 0.05]) == [201]


def test_fp8_flush_alarm_stays_quiet_on_a_flat_low_fraction() -> None:
    assert _fire([0.004] * 20) == []


def test_fp8_flush_alarm_needs_a_rise_not_only_a_level() -> None:
    # A layer that flushes 3 % from the start has not got worse: the rule is a rise.
    assert _fire([0.03] * 10) == []
    assert _fire([0.03, 0.03, 0.07]) == [201]  # more than doubled from its low


def test_fp8_flush_alarm_rearms_when_the_fraction_falls_back() -> None:
    assert _fire([0.002, 0.002, 0.02, 0.005, 0.002, 0.02]) == [201, 501]


def test_fp8_flush_alarm_event_names_layer_operand_and_numbers() -> None:
    monitor = Fp8FlushAlarm().monitor()
    events = [monitor.observe(r) for r in _records([0.002, 0.004, 0.05])]
    event = events[-1]
    assert event is not None and event.alarm == "FP8_FLUSH" and event.code is None
    assert event.evidence == {"layer": "blocks.0.fc", "operand": "input", "flush_fraction": 0.05,
                              "baseline": 0.002, "samples": 2, "amax": 30.0, "also": []}
    assert "fp8_filter=['blocks.0.fc']" in event.fix and "5.00%" in event.message


def test_fp8_flush_alarm_state_round_trip_keeps_the_baseline() -> None:
    monitor = Fp8FlushAlarm().monitor()
    records = _records([0.002, 0.002, 0.02])
    for r in records[:2]:
        monitor.observe(r)
    fresh = Fp8FlushAlarm().monitor()
    fresh.load_state_dict(monitor.state_dict())
    assert fresh.observe(records[2]) is not None


def test_fp8_flush_alarm_rejects_bad_thresholds() -> None:
    with pytest.raises(ValueError, match=r"Fp8FlushAlarm\(factor=1\): must be > 1"):
        Fp8FlushAlarm(factor=1)
    with pytest.raises(ValueError, match=r"min_history=6\): must be an int in \[1, window\]"):
        Fp8FlushAlarm(min_history=6)


def test_fp8_flush_alarm_is_a_default_alarm() -> None:
    assert any(isinstance(a, Fp8FlushAlarm) for a in default_alarms())


def _input_with_tiny(n_tiny: int) -> torch.Tensor:
    """16x32 of 1.0 with an outlier of 1000 and ``n_tiny`` values of 1e-3 (which flush in e4m3 under its scale)."""
    x = torch.ones(16, 32)
    x.view(-1)[1:1 + n_tiny] = 1e-3
    x[0, 0] = 1000.0
    return x


@pytest.mark.parametrize(("tiny", "fires"), [((2, 2, 2, 2, 2), False), ((2, 2, 40, 60, 80), True)])
def test_fp8_flush_alarm_in_training_fires_on_rising_input_flush(tiny: tuple[int, ...], fires: bool) -> None:
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=5, fp8_stats_every=1, alarms=[Fp8FlushAlarm()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the CPU has no fp8 GEMM: known
        mp = ampkit.MixedPrecision("fp8", device="cpu", telemetry=tel)
        model = mp.prepare(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0, fused=True)  # constant weights: only the input changes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AlarmWarning)
        for n in tiny:
            with mp.autocast():
                loss = model(_input_with_tiny(n)).float().pow(2).mean()
            mp.backward(loss)
            mp.step(opt)
    fractions = [r["fp8_flush_fraction"]["0"]["input"] for r in records]
    assert fractions == [n / 512 for n in tiny]
    fired = [(r["step"], a["evidence"]["layer"], a["evidence"]["operand"]) for r in records for a in r.get("alarms", [])]
    assert fired == ([(3, "0", "input")] if fires else [])
    assert len([w for w in caught if issubclass(w.category, AlarmWarning)]) == len(fired)
    mp.close()
