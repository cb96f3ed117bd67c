"""The hook protocol (ampkit.hooks): every subclass marks its overrides, and the engine calls each
method at its documented point."""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
import warnings
from collections.abc import Sequence
from typing import get_args

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from typing_extensions import override

import ampkit
from ampkit._util.overrides import overrides
from ampkit.engine import Engine
from ampkit.findings import CODES
from ampkit.hooks import EngineHook, HookEvent, ReplayReason, StepResult
from ampkit.telemetry.alarm_base import Alarm, AlarmName
from tests.helpers.models import TinyNet, make_batches

PROTOCOL = [name for name, _ in inspect.getmembers(EngineHook, inspect.isfunction) if not name.startswith("_")]


def _all_modules() -> list[str]:
    names = ["ampkit"]
    for info in pkgutil.walk_packages(ampkit.__path__, "ampkit."):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # an optional extra (tensorboard, rich, ...) is missing
            if (exc.name or "").startswith("ampkit"):
                raise
            continue
        names.append(info.name)
    return names


def _hook_classes() -> list[type[EngineHook]]:
    _all_modules()
    found: list[type[EngineHook]] = []
    todo = list(EngineHook.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("ampkit.") and cls not in found:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_hooks_every_engine_hook_subclass_marks_its_overrides() -> None:
    classes = _hook_classes()
    names = {c.__name__ for c in classes}
    assert {"Telemetry", "DistributedContext", "ReplayDoctor"} <= names, names
    missing = []
    for cls in classes:
        for name in PROTOCOL:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "__override__", False):
                missing.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    assert missing == [], f"put @override (typing_extensions) on: {missing}"


class Recorder(EngineHook):
    """Records every protocol call in order."""

    def __init__(self, log: list[str] | None = None, tag: str = "") -> None:
        self.log = [] if log is None else log
        self.tag = tag
        self.events: list[HookEvent] = []

    def _add(self, what: str) -> None:
        self.log.append(f"{self.tag}{what}")

    @override
    def on_attach(self, engine: Engine) -> None:
        self._add("on_attach")

    @override
    def on_prepare(self, engine: Engine, model: nn.Module) -> None:
        self._add("on_prepare")

    @override
    def on_backward(self, engine: Engine, loss: torch.Tensor) -> None:
        self._add("on_backward")

    @override
    def after_unscale(self, engine: Engine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._add("after_unscale")

    @override
    def wait_found_inf(self, engine: Engine) -> None:
        self._add("wait_found_inf")

    @override
    def before_optimizer_step(self, engine: Engine, optimizers: Sequence[torch.optim.Optimizer],
                              found_inf: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self._add("before_optimizer_step")

    @override
    def after_step(self, engine: Engine, result: StepResult, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._add("after_step")

    @override
    def on_event(self, engine: Engine, event: HookEvent) -> bool | None:
        self.events.append(event)
        return event.kind == self.tag

    @override
    def close(self) -> None:
        self._add("close")


class ForceSkip(EngineHook):
    """A reducer that decides for every rank: found_inf = 1 (skip)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.clipped_norms: list[float] = []
        self.engine: Engine | None = None

    @override
    def on_attach(self, engine: Engine) -> None:
        self.engine = engine

    @override
    def reduce_found_inf(self, engine: Engine, found_inf: torch.Tensor) -> torch.Tensor:
        self.calls.append("reduce_found_inf")
        return torch.ones_like(found_inf)

    @override
    def wait_found_inf(self, engine: Engine) -> None:
        self.calls.append("wait_found_inf")
        grads = [p.grad for m in engine.models for p in m.parameters() if p.grad is not None]
        self.clipped_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def _train_step(mp: Engine, model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> StepResult:
    x, y = make_batches(1, seed=seed)[0]
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)
    return mp.step(opt)


def test_hooks_on_attach_runs_once_per_hook_added() -> None:
    log: list[str] = []
    first, second = Recorder(log, "a:"), Recorder(log, "b:")
    mp = Engine("bf16", device="cpu", hooks=[first])
    mp.add_hook(second)
    assert log == ["a:on_attach", "b:on_attach"] and mp.hooks == (first, second)
    with pytest.raises(ValueError, match="already attached"):
        mp.add_hook(first)
    assert log.count("a:on_attach") == 1


def test_hooks_emit_delivers_to_every_hook_and_says_whether_one_acted() -> None:
    a, b = Recorder(tag="replay"), Recorder(tag="other")
    mp = Engine("bf16", device="cpu", hooks=[a, b])
    event = HookEvent(kind="replay", reason="SCALE_COLLAPSE", step=3)
    assert mp.emit(event) is True
    assert a.events == [event] and b.events == [event]
    assert mp.emit(HookEvent(kind="unknown")) is False


def test_hooks_close_is_idempotent() -> None:
    log: list[str] = []
    mp = Engine("bf16", device="cpu", hooks=[Recorder(log, "a:"), Recorder(log, "b:")])
    mp.close()
    mp.close()
    assert [e for e in log if e.endswith("close")] == ["a:close", "b:close"]


def test_hooks_engine_calls_the_protocol_in_the_documented_order(seed: int) -> None:
    log: list[str] = []
    model = TinyNet()
    mp = Engine("bf16", device="cpu", grad_accumulation=2, hooks=[Recorder(log)])
    mp.prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(mp, model, opt, seed)
    _train_step(mp, model, opt, seed + 1)
    assert log == ["on_attach", "on_prepare", "on_backward", "on_backward", "after_unscale", "wait_found_inf",
                   "before_optimizer_step", "after_step"]


@pytest.mark.parametrize("fused", [False, True])
def test_hooks_reducer_decision_makes_the_step_skip_and_leaves_params_unchanged(seed: int, fused: bool) -> None:
    model = TinyNet()
    before = copy.deepcopy(model.state_dict())
    reducer = ForceSkip()
    mp = Engine("bf16", device="cpu", hooks=[reducer])
    assert mp.reduces_found_inf and overrides(reducer, EngineHook, "reduce_found_inf")
    mp.prepare(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    result = _train_step(mp, model, opt, seed)
    assert result.skipped and float(result.found_inf) == 1.0  # the local check found nothing
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    mp.remove_hook(reducer)
    assert not mp.reduces_found_inf and _train_step(mp, model, opt, seed).applied


def test_hooks_wait_found_inf_runs_after_clipping(seed: int) -> None:
    model = TinyNet()
    reducer = ForceSkip()
    mp = Engine("fp32", device="cpu", clip_grad_norm=1e-3, hooks=[reducer])
    mp.prepare(model)
    result = _train_step(mp, model, torch.optim.SGD(model.parameters(), lr=0.1), seed)
    assert reducer.calls == ["reduce_found_inf", "wait_found_inf"]
    assert result.grad_norm is not None and float(result.grad_norm) > 1e-2  # the norm before clipping
    assert reducer.clipped_norms[0] <= 1e-3 * 1.01  # the gradients wait_found_inf saw were clipped


def _alarm_classes(cls: type[Alarm]) -> list[type[Alarm]]:
    return [cls] + [c for sub in cls.__subclasses__() for c in _alarm_classes(sub)]


def test_hook_event_reason_names_every_alarm_a_replay_can_come_from() -> None:
    importlib.import_module("ampkit.telemetry")  # every built-in alarm class
    reasons = {name for part in get_args(ReplayReason) for name in get_args(part)}
    names = {c.name for c in _alarm_classes(Alarm)}
    assert names == set(get_args(AlarmName))
    # AlarmEvent.reason is the alarm's finding code, else its name: both are replay reasons.
    assert names | set(CODES) <= reasons
