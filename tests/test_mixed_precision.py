"""The public class (ampkit.mixed_precision): the telemetry= and doctor= shorthands become hooks."""

from __future__ import annotations

import copy
import inspect
import typing
from pathlib import Path

import pytest
import torch

import ampkit
from ampkit.diagnose.live import ReplayDoctor
from ampkit.engine import Engine
from ampkit.hooks import HookEvent
from ampkit.mixed_precision import MixedPrecision


def test_mixed_precision_is_the_public_engine() -> None:
    assert ampkit.MixedPrecision is MixedPrecision and issubclass(MixedPrecision, Engine)
    mp = MixedPrecision("bf16", device="cpu")
    assert mp.telemetry is None and mp.doctor is None and mp.hooks == ()
    assert repr(mp).startswith("MixedPrecision('bf16', device='cpu', scaler=NoLossScaler, grad_accumulation=1")


def test_mixed_precision_engine_takes_only_hooks() -> None:
    with pytest.raises(TypeError):
        Engine("bf16", device="cpu", telemetry=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Engine("bf16", device="cpu", doctor=True)  # type: ignore[call-arg]


def test_mixed_precision_shorthands_attach_after_the_given_hooks() -> None:
    first = ampkit.EngineHook()
    mp = MixedPrecision("fp16", device="cpu", hooks=[first], telemetry=True, doctor=True)
    assert isinstance(mp.telemetry, ampkit.Telemetry) and isinstance(mp.doctor, ReplayDoctor)
    assert mp.hooks[:3] == (first, mp.telemetry, mp.doctor)
    assert mp.telemetry.engine is mp


def test_mixed_precision_replay_event_reaches_the_doctor() -> None:
    mp = MixedPrecision("fp16", device="cpu", doctor=True)
    assert mp.emit(HookEvent(kind="replay", reason="manual")) is True  # nothing captured: logged, no findings
    assert mp.doctor is not None and mp.doctor.findings == []
    assert MixedPrecision("fp16", device="cpu").emit(HookEvent(kind="replay")) is False


def test_mixed_precision_signature_lists_every_engine_argument_and_the_shorthands() -> None:
    shown = inspect.signature(MixedPrecision.__init__).parameters
    engine = inspect.signature(Engine.__init__).parameters
    assert list(shown) == [*engine, "telemetry", "doctor"]
    shown_types, engine_types = typing.get_type_hints(MixedPrecision.__init__), typing.get_type_hints(Engine.__init__)
    for name, param in engine.items():  # spelled out in the source: the same kinds, defaults and types
        assert (shown[name].kind, shown[name].default, shown_types.get(name)) == \
            (param.kind, param.default, engine_types.get(name)), name


def test_mixed_precision_with_telemetry_and_doctor_leaves_the_model_deep_copyable(tmp_path: Path) -> None:
    # An EMA or best-model copy taken after training started: the watchers' hooks must not drag their
    # open files and locks into the copy, and must not watch the copy.
    mp = ampkit.MixedPrecision("bf16", telemetry=str(tmp_path / "t.jsonl"), doctor=True)
    model = mp.prepare(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with mp.autocast():
            loss = model(torch.randn(2, 4)).float().sum()
        mp.backward(loss)
        mp.step(opt)
    twin = copy.deepcopy(model)
    with mp.autocast():
        twin(torch.randn(2, 4))
    assert mp.doctor is not None and mp.doctor.hooks.captures == []  # the copy's forward was not captured
    mp.close()


def test_mixed_precision_none_keep_fp32_and_hooks_mean_none() -> None:
    mp = MixedPrecision("bf16", device="cpu", keep_fp32=None, hooks=None)
    assert mp.config.keep_fp32 == () and mp.hooks == ()
    model = torch.nn.Linear(4, 2)
    mp.prepare(model)
    with mp.autocast():
        assert model(torch.randn(2, 4)).dtype == torch.bfloat16  # nothing kept in fp32
