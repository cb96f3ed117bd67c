"""With fused optimizers a step makes no host sync at all."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn import functional as F

import ampkit
from tests.helpers.models import TinyNet, make_batches


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_sync(monkeypatch: pytest.MonkeyPatch):
    def refuse(name: str):
        def raiser(*args, **kwargs):
            raise HostSync(f"Tensor.{name} was called: a host sync inside the step")

        return raiser

    with monkeypatch.context() as m:
        for name in ("item", "__bool__", "cpu", "tolist"):
            m.setattr(torch.Tensor, name, refuse(name))
        yield


@pytest.mark.parametrize(
    ("precision", "optimizer", "init_scale"),
    [("fp16", "adamw", 2.0**40), ("fp16", "adam", 2.0**16), ("fp16", "sgd", 2.0**16), ("bf16", "adamw", 1.0)],
)
def test_engine_step_makes_no_host_sync_with_fused_optimizers(monkeypatch, precision, optimizer, init_scale):
    model = TinyNet()
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    opt = cls(model.parameters(), lr=1e-2, fused=True)
    scaler = ampkit.DynamicLossScaler(init_scale=init_scale, growth_interval=2) if precision == "fp16" else None
    mp = ampkit.MixedPrecision(precision, device="cpu", grad_accumulation=2, clip_grad_norm=1.0, scaler=scaler)
    mp.prepare(model)
    results = []
    for x, y in make_batches(8):
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        with forbid_host_sync(monkeypatch):
            results.append(mp.step(opt))
    boundary = [r for r in results if r.boundary]
    assert len(boundary) == 4
    skipped = [r.skipped for r in boundary]  # resolved after the fact, outside the forbidden region
    if init_scale > 2.0**30:
        assert skipped[0], "the first fp16 step at scale 2^40 must overflow and skip"


def test_engine_nonfused_optimizer_makes_exactly_one_documented_sync(monkeypatch):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mp = ampkit.MixedPrecision("fp16", device="cpu")
    calls: list[str] = []
    original = torch.Tensor.item

    def counting_item(self):
        calls.append("item")
        return original(self)

    x, y = make_batches(1)[0]
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    mp.step(opt)
    assert calls == ["item"]
