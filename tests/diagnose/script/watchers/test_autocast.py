"""The autocast watcher."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampkit.diagnose.script.watchers.autocast import AutocastWatch
from diagnose.script.observe import observe
from diagnose.script.watchers.alone import watching

HERE = Path(__file__).relative_to(Path.cwd())


def test_doctor_observers_see_the_deprecated_autocast_classes() -> None:
    def loop() -> None:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.warns(FutureWarning):
            region = torch.cpu.amp.autocast(dtype=torch.bfloat16)
        with region:
            for _ in range(2):   # the optimizer steps inside the region: stale cached weights
                model(torch.randn(3, 4)).float().sum().backward()
                opt.step()
                opt.zero_grad()

    ctx = observe(loop)
    assert ctx.state.forwards.autocast[torch.bfloat16] == 2
    assert [f.code for f in ctx.state.ledger.findings()] == ["STALE_WEIGHT_CACHE"]


def test_doctor_observers_autocast_records_objects_built_but_never_entered() -> None:
    def loop() -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16)   # built, never entered
        model = nn.Linear(4, 2)
        model(torch.randn(3, 4)).sum().backward()
        assert ctx.fast_dtype == torch.bfloat16

    watch = observe(loop).autocast
    assert watch.requests == {}
    [(key, built)] = watch.built.items()
    assert key[1:] == ("cpu", torch.bfloat16)
    assert built.requested and built.effective and built.entered == 0
    assert built.location is not None and built.location.endswith(f":{loop.__code__.co_firstlineno + 1}")


def test_autocast_watch_alone_reports_a_forward_after_a_step_inside_its_region() -> None:
    model = nn.Linear(4, 2)
    with watching(AutocastWatch) as w:
        regions = w.state.regions
        opened = sys._getframe().f_lineno + 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert regions.depth == 1 and regions.region_location == f"{HERE}:{opened}"
            model(torch.randn(2, 4))  # no optimizer step in the region yet: nothing to report
            assert w.codes() == []
            regions.region_stepped = "train.py:9"  # what the optimizer watcher marks at a step in the region
            model(torch.randn(2, 4))
        assert regions.depth == 0
    [f] = w.state.ledger.findings()
    assert f.code == "STALE_WEIGHT_CACHE" and f.step == 1
    assert f.evidence["region_opened_at"] == f"{HERE}:{opened}" and f.evidence["optimizer_step_at"] == "train.py:9"
    [request] = w.watcher.requests.values()
    assert (request.device_type, request.dtype, request.entered, request.location) == (
        "cpu", torch.bfloat16, 1, f"{HERE}:{opened}")


def test_autocast_watch_writes_nothing_on_torch_autocast_objects() -> None:
    """What the watcher knows of an autocast object (its request, line, paused entry) is kept beside it."""
    made: list[torch.autocast] = []

    def loop() -> None:
        model = nn.Linear(4, 2)
        made.append(torch.autocast("cpu", dtype=torch.bfloat16))
        for _ in range(2):
            with made[0]:
                model(torch.randn(3, 4)).float().sum().backward()

    ctx = observe(loop)
    assert [name for name in vars(made[0]) if name.startswith("_ampkit")] == []
    [req] = ctx.autocast.requests.values()
    assert (req.requested, req.entered) == (True, 2) and req.location is not None
