"""A refused ``mp.backward(loss)`` leaves no trace: the next record and the next step are the good step's alone."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import ampkit
from ampkit.telemetry import Telemetry

from .telemetry_helpers import TinyRegressor, batch

REFUSED: dict[str, Callable[[TinyRegressor], object]] = {
    "needs no gradient": lambda model: torch.tensor(500.58),
    "nan, needs no gradient": lambda model: torch.tensor(math.nan),
    "nan in a structure, needs no gradient": lambda model: [torch.tensor(math.nan), torch.tensor(1.0)],
    "not a scalar": lambda model: model(*batch()[:2]).float() * math.nan,
}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("refused", list(REFUSED))
def test_telemetry_refused_backward_leaves_no_trace_in_the_next_record(precision: str, refused: str,
                                                                       tiny: TinyRegressor) -> None:
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=1, alarms=())
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision(precision, device="cpu", telemetry=tel)
    mp.prepare(tiny)
    with pytest.raises(RuntimeError, match=r"mp\.backward\(loss\)"):
        mp.backward(REFUSED[refused](tiny))
    assert all(p.grad is None for p in tiny.parameters())
    x, idx, y = batch()
    with mp.autocast():
        loss = (tiny(x, idx).float() - y).pow(2).mean()
    good = float(loss.detach())
    mp.backward(loss)
    mp.step(opt)
    assert len(records) == 1
    assert records[0]["loss"] == good
    assert records[0]["loss_nonfinite"] is False and records[0]["skipped"] is False
