"""The optimizer watcher: optimizers built and stepped, LR schedulers."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from ampkit.diagnose.script import failures
from ampkit.diagnose.script.services.casts import CastSite
from ampkit.diagnose.script.watchers.optim import OptimWatch
from diagnose.script.watchers.alone import watching

HERE = Path(__file__).relative_to(Path.cwd())


def test_optim_watch_alone_reports_low_precision_parameters_with_their_cast_site() -> None:
    with watching(OptimWatch) as w:
        model = nn.Linear(2, 2).bfloat16()
        site = CastSite(location="train.py:3", how=".bfloat16()", dtype="bf16", kind="cast")
        w.state.casts.add(model.parameters(), site)  # what the cast watcher records
        line = sys._getframe().f_lineno + 1
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(1, 2, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    [f] = w.state.ledger.findings()
    assert f.code == "LOW_PRECISION_PARAMS" and f.location == "train.py:3" and f.step == 1
    assert f"(created at {HERE}:{line}) updates 2 of 2 trainable parameters stored in bf16" in f.message
    assert "through `.bfloat16()` at train.py:3" in f.message and f.evidence["made_low_precision"] == site.evidence()
    info = w.state.optimizers.get(opt)
    assert info is not None and info.location == f"{HERE}:{line}"
    # the primary optimizer stepped directly: its gradients were checked, and the iteration ended
    assert w.state.steps == 1 and w.failures == []


def test_optim_watch_alone_notes_a_scheduler_step_after_a_skipped_step() -> None:
    model = nn.Linear(2, 2)
    with watching(OptimWatch) as w:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        opt.step()  # step 1, applied
        sched.step()  # after a step that applied: fine
        # step 2: a guarded step that found inf/NaN, as the scaler watcher reports it
        failures.found_read(w.state, opt, torch.ones(()), torch.tensor(2.0**16), True)
        line = sys._getframe().f_lineno + 1
        sched.step()
    assert (w.watcher.scheduler_steps, w.watcher.sched_on_skip) == (2, [2])
    assert w.state.locations["scheduler_step"] == f"{HERE}:{line}"
