"""The autocast watcher."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diagnose.script.observe import observe


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
    assert ctx.forwards.autocast[torch.bfloat16] == 2
    assert [f.code for f in ctx.ledger.findings()] == ["STALE_WEIGHT_CACHE"]


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
