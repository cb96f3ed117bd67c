"""The engine watcher: the doctor's hook on every ampkit engine a script builds."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from typing_extensions import override

import ampkit
from ampkit.diagnose.script.watchers.engine import DoctorEngineHook, EngineWatch
from ampkit.engine import Engine
from ampkit.hooks import EngineHook
from diagnose.script.observe import observe
from diagnose.script.watchers.alone import watching


def _train(steps: int, *, clip: str = "none", overflow: bool = False, hooks: Sequence[EngineHook] = ()) -> None:
    """fp16 engine loop; ``clip``: ``before`` (after mp.backward) or ``none``; ``overflow``: an inf batch."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    for hook in hooks:
        mp.add_hook(hook, first=True)  # after the doctor's, in front of it, as AmpkitPrecision does
    mp.prepare(model)
    for _ in range(steps):
        x = torch.full((3, 4), 7e4) if overflow else torch.randn(3, 4)
        with mp.autocast():
            loss = model(x).float().pow(2).mean()
        mp.backward(loss)
        if clip == "before":
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mp.step(opt)


def test_engine_watch_attaches_one_doctor_hook_first_and_removes_the_patch() -> None:
    engines: list[Engine] = []

    def run() -> None:
        engines.append(ampkit.MixedPrecision("fp16", device="cpu", hooks=[EngineHook()]))
        engines[-1].add_hook(EngineHook(), first=True)  # as AmpkitPrecision adds its order hook
        engines.append(ampkit.MixedPrecision("bf16", device="cpu"))

    observe(run)
    fp16, bf16 = engines
    assert [type(h) for h in fp16.hooks] == [DoctorEngineHook, EngineHook, EngineHook]
    assert bf16.hooks == ()  # nothing is scaled: nothing to observe
    assert ampkit.MixedPrecision("fp16", device="cpu").hooks == ()  # restored after the run


def test_engine_watch_skipped_steps_count_as_iterations_and_collapse_the_scale() -> None:
    ctx = observe(lambda: _train(20, overflow=True))
    assert ctx.state.iteration == 20  # a skipped non-fused step never calls optimizer.step()
    assert sorted(ctx.state.skips) == list(range(1, 21))  # steps, counted from 1
    collapse = [f for f in ctx.state.ledger.findings() if f.code == "SCALE_COLLAPSE"]
    assert len(collapse) == 1 and "ampkit.MixedPrecision" in collapse[0].message
    assert collapse[0].evidence["init_scale"] == 65536.0 and collapse[0].evidence["min_scale"] < 1.0


def test_engine_watch_clip_between_backward_and_step_is_clip_before_unscale() -> None:
    bad = observe(lambda: _train(2, clip="before"))
    good = observe(lambda: _train(2))
    assert [f.code for f in bad.state.ledger.findings()] == ["CLIP_BEFORE_UNSCALE"]
    assert "clip_grad_norm=" in bad.state.ledger.findings()[0].fix
    assert good.state.ledger.findings() == [] and good.state.skips == {} and good.state.iteration == 2


class _ClipAfterUnscale(EngineHook):
    """Clips where AmpkitPrecision runs Lightning's clipping: on the unscaled gradients."""

    @override
    def after_unscale(self, engine: Engine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        nn.utils.clip_grad_value_([p for o in optimizers for g in o.param_groups for p in g["params"]], 0.5)


def test_engine_watch_clip_in_a_hook_after_the_unscale_is_clean() -> None:
    ctx = observe(lambda: _train(2, hooks=[_ClipAfterUnscale()]))
    assert ctx.state.ledger.findings() == []


def test_engine_watch_alone_feeds_the_scaler_registry_and_ends_each_step() -> None:
    with watching(EngineWatch) as w:
        _train(1)
        _train(1, overflow=True)
        ampkit.MixedPrecision("bf16", device="cpu")  # scales nothing: not watched
    first, second = w.state.scalers.infos
    assert (first.engine, first.built_as, first.used, first.init_scale) == (True, "ampkit.MixedPrecision", 1, 2.0**16)
    assert [s for _, s in first.scales] == [2.0**16] and [s for _, s in second.scales] == [2.0**15]
    assert w.state.steps == 2 and list(w.state.skips) == [2]
    assert [(f.kind, f.step) for f in w.failures] == [("skip", 2)]
    assert len(w.watcher.hooks) == 2 and w.state.scalers.in_step == 0
