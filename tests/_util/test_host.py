"""Deferred device->host reads."""

from __future__ import annotations

import torch

from ampkit._util.host import DeferredReads


def test_doctor_observers_pending_delivers_cpu_values_at_once() -> None:
    pending = DeferredReads()
    got: list[float] = []
    pending.read(torch.tensor(2.5), got.append)
    assert got == [2.5] and len(pending) == 0
    pending.flush()
    assert got == [2.5]
