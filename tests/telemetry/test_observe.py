"""ampkit.telemetry.observe: telemetry of a plain fp16 loop that the user drives with torch's own
GradScaler("cpu"), autocast and AdamW (plain and fused), with no ampkit engine in the loop."""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import ampkit
from ampkit.telemetry import AlarmWarning, LossNonFiniteAlarm, SchedulerOnSkipAlarm, Telemetry, observe

from .telemetry_helpers import FORBIDDEN, ForbiddenSync, count_as_on_an_accelerator


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _loop(*, fused: bool = False, steps: int = 6, accum: int = 1, watch: bool = True, bad_steps: tuple[int, ...] = (),
          schedule: str = "held_back", nan_loss_at: int = 0, grads_ready: bool = False, stop_early: bool = False,
          **tel_kw: Any) -> tuple[list[dict], list[torch.Tensor], Any]:
    """A user's fp16 loop: autocast, GradScaler("cpu"), AdamW, LambdaLR; ``bad_steps`` get an inf gradient."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], **{"flush_every": 4, **tel_kw})
    obs = observe(opt, scaler=scaler, telemetry=tel, model=model, scheduler=sched) if watch else None
    for i, (x, y) in enumerate(_data(steps * accum)):
        step = i // accum + 1
        if obs is not None and stop_early and obs.should_stop:
            break
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out.float() - y).pow(2).mean()
        if step == nan_loss_at:
            loss = loss * math.nan
        if obs is not None:
            obs.record_loss(loss)
        scaler.scale(loss / accum).backward()
        if (i + 1) % accum:
            continue
        if step in bad_steps:
            model.fc1.weight.grad[0, 0] = math.inf
        if grads_ready and obs is not None:
            scaler.unscale_(opt)
            obs.grads_ready()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if schedule == "always" or scaler.get_scale() >= scale:
            sched.step()
        opt.zero_grad()
    if obs is not None:
        obs.close()
    return records, [p.detach().clone() for p in model.parameters()], obs


def test_observe_records_have_the_engine_record_keys() -> None:
    records, _, _ = _loop(steps=2)
    engine_records: list[dict] = []
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = ampkit.MixedPrecision("fp16", device="cpu", telemetry=[engine_records.append])
    mp.prepare(model)
    for x, y in _data(2):
        with mp.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        mp.backward(loss)
        mp.step(opt)
    mp.close()
    assert [set(r) for r in records] == [set(r) for r in engine_records]
    assert all(isinstance(r["nonfinite_grads"], int) and r["input_nonfinite"] is False for r in records)


@pytest.mark.parametrize("scaled", [True, False])
def test_observe_one_record_per_optimizer_step_with_accumulation_2(scaled: bool) -> None:
    if scaled:
        records, _, _ = _loop(steps=5, accum=2)
    else:  # bf16-style: no scaler, the optimizer is stepped directly
        torch.manual_seed(0)
        model, records = Net(), []
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with observe(opt, telemetry=[records.append], model=model) as obs:
            for i, (x, y) in enumerate(_data(10)):
                loss = (model(x) - y).pow(2).mean()
                obs.record_loss(loss)
                (loss / 2).backward()
                if i % 2:
                    opt.step()
                    opt.zero_grad()
        assert {r["scale"] for r in records} == {1.0}
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert not any(r["skipped"] for r in records)


@pytest.mark.parametrize("fused", [False, True])
def test_observe_injected_overflow_gives_a_skipped_record_and_a_scale_backoff(fused: bool) -> None:
    records, _, _ = _loop(fused=fused, steps=5, bad_steps=(3,))
    assert [r["skipped"] for r in records] == [False, False, True, False, False]
    skip = records[2]
    assert skip["scale"] == 2.0**10 and skip["next_scale"] == 2.0**9
    assert records[3]["scale"] == 2.0**9
    if fused:  # the fused step runs with found_inf passed in: its hooks saw the gradients
        assert skip["nonfinite_grads"] == 1 and skip["grad_norm"] == math.inf
    else:  # GradScaler.step never called optimizer.step(): no hook saw the gradients
        assert skip["nonfinite_grads"] is None and math.isnan(skip["grad_norm"])


def test_observe_grads_ready_counts_the_gradients_of_a_step_skipped_without_any_optimizer_hook() -> None:
    records, _, _ = _loop(steps=4, bad_steps=(2,), grads_ready=True)
    assert records[1]["skipped"] and records[1]["nonfinite_grads"] == 1 and records[1]["grad_norm"] == math.inf
    assert records[0]["nonfinite_grads"] == 0 and math.isfinite(records[0]["grad_norm"])


@pytest.mark.parametrize("schedule, fires", [("always", True), ("held_back", False)])
def test_observe_scheduler_finding_fires_only_when_the_schedule_advanced_on_a_skipped_step(
        schedule: str, fires: bool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records, _, _ = _loop(steps=6, bad_steps=(3,), schedule=schedule)
    fired = [(r["step"], a) for r in records for a in r.get("alarms", []) if a["alarm"] == SchedulerOnSkipAlarm.name]
    warned = [w for w in caught if issubclass(w.category, AlarmWarning) and "SCHEDULER_STEPPED_ON_SKIP" in str(w.message)]
    assert records[2]["skipped"]
    if fires:
        assert [(s, a["code"]) for s, a in fired] == [(3, "SCHEDULER_STEPPED_ON_SKIP")] and len(warned) == 1
        assert fired[0][1]["evidence"]["steps"] == [3]
    else:
        assert fired == [] and warned == []


@pytest.mark.parametrize("fused", [False, True])
def test_observe_parameters_equal_the_same_loop_without_the_observer(fused: bool) -> None:
    _, observed, _ = _loop(fused=fused, steps=5, accum=2, bad_steps=(2,))
    _, plain, _ = _loop(fused=fused, steps=5, accum=2, bad_steps=(2,), watch=False)
    assert all(torch.equal(a, b) for a, b in zip(observed, plain))


def test_observe_stop_alarm_sets_should_stop() -> None:
    records, _, obs = _loop(steps=8, nan_loss_at=2, stop_early=True, flush_every=1,
                            alarms=[LossNonFiniteAlarm(action="stop")])
    assert obs.should_stop and obs.stop_event.alarm == "LOSS_NONFINITE" and obs.stop_event.step == 2
    assert records[1]["alarms"][0]["action"] == "stop"
    assert len(records) == 3  # the loop saw the flag before its 4th step


def _telemetry_caller(frame: FrameType | None) -> str | None:
    """"flush" inside a telemetry flush, "hook" inside other ampkit.telemetry code, else None."""
    inside = False
    while frame is not None:
        if "/ampkit/telemetry/" in frame.f_code.co_filename.replace("\\", "/"):
            if frame.f_code.co_name == "flush":
                return "flush"
            inside = True
        frame = frame.f_back
    return "hook" if inside else None


def _forbid_in_hooks(monkeypatch: pytest.MonkeyPatch, flush_reads: list[str]) -> None:
    """The sync methods raise when called from the observer's hooks; the user's loop may still sync."""
    for name in FORBIDDEN:
        original: Callable[..., Any] = getattr(torch.Tensor, name)

        def guarded(self: torch.Tensor, *args: Any, _name: str = name, _orig: Callable[..., Any] = original,
                    **kwargs: Any) -> Any:
            where = _telemetry_caller(sys._getframe(1))
            if where == "hook":
                raise ForbiddenSync(f"Tensor.{_name} was called in an observer hook")
            if where == "flush":
                flush_reads.append(_name)
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)


@pytest.mark.parametrize("fused", [False, True])
def test_observe_hooks_make_no_host_sync_between_flushes(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 6
    reads: list[str] = []
    count_as_on_an_accelerator(monkeypatch)
    with monkeypatch.context() as patch:
        _forbid_in_hooks(patch, reads)
        records, _, _ = _loop(fused=fused, steps=n - 1, accum=2, bad_steps=(2,), flush_every=n, module_absmax_every=2)
        assert reads == ["tolist"], f"only close() may read the device, once: {reads}"
    assert [r["step"] for r in records] == list(range(1, n))
    assert records[1]["skipped"] and "module_grad_absmax" in records[0]


def test_observe_rejects_what_is_not_a_grad_scaler() -> None:
    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="torch.amp.GradScaler"):
        observe(opt, scaler=ampkit.MixedPrecision("fp16", device="cpu").scaler)
    with pytest.raises(ValueError, match=r"observe\(telemetry='run.txt'\)"):
        observe(opt, telemetry="run.txt")


def test_observe_docs_example_runs_and_prints_the_skipped_step() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "telemetry.md").read_text()
    section = text.split("## Observing a loop ampkit does not drive", 1)[1]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    namespace: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, "docs/telemetry.md", "exec"), namespace)  # our own documentation
    expected = code.rsplit("# ", 1)[1].strip()
    records = namespace["records"]
    assert repr([(r["step"], r["skipped"], r["scale"], r["next_scale"]) for r in records][3]) == expected
    assert len(records) == 8 and any("SCHEDULER_STEPPED_ON_SKIP" in str(w.message) for w in caught)


class LossNet(Net):
    """Returns its loss as Hugging Face models do: ``{"loss": ..., "logits": ...}``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x)
        return {"loss": (out - y).pow(2).mean(), "logits": out} if y is not None else {"logits": out}


def test_observe_records_the_loss_a_model_returns_and_ignores_evaluation_forwards() -> None:
    torch.manual_seed(0)
    model, records, losses = LossNet(), [], []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with observe(opt, telemetry=[records.append], model=model):
        for x, y in _data(3):
            loss = model(x, y)["loss"]
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model(x, y)  # an evaluation forward: neither a loss nor a new step
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-6)
    assert [r["step"] for r in records] == [1, 2, 3]


def test_observe_two_optimizers_make_one_record_per_step_skipped_when_either_overflowed() -> None:
    torch.manual_seed(0)
    model, records = Net(), []
    opts = [torch.optim.AdamW(model.fc1.parameters(), lr=1e-2), torch.optim.AdamW(model.fc2.parameters(), lr=1e-2)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with observe(opts, scaler=scaler, telemetry=[records.append], model=model):
        for step, (x, y) in enumerate(_data(3), start=1):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (model(x).float() - y).pow(2).mean()
            scaler.scale(loss).backward()
            if step == 2:
                model.fc2.bias.grad.fill_(math.inf)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            for opt in opts:
                opt.zero_grad()
    assert [(r["step"], r["skipped"], r["next_scale"]) for r in records] == [
        (1, False, 2.0**10), (2, True, 2.0**9), (3, False, 2.0**9)]


def test_observe_refuses_a_telemetry_already_attached_to_an_engine() -> None:
    tel = Telemetry()
    ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    with pytest.raises(ValueError, match="one Telemetry per engine"):
        observe(torch.optim.SGD(Net().parameters(), lr=0.1), telemetry=tel)
