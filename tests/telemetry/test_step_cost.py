"""The cheap per-step path of Telemetry keeps every record exact: counts left to the norm when no other hook
can touch the gradients, rows queued as tensors and written in batches, values that change in place copied."""

from __future__ import annotations

import math

import pytest
import torch

import ampkit
from ampkit.telemetry import Telemetry, core
from ampkit.telemetry.metrics import ROW_BATCH

from .telemetry_helpers import TinyRegressor, batch, train_step


class _PoisonGrad:
    """A gradient hook (autograd's, not an engine hook) that writes inf, NaN, -inf into a gradient on one call."""

    def __init__(self, bad_call: int) -> None:
        self.bad_call, self.calls = bad_call, 0

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls != self.bad_call:
            return g
        g = g.clone()
        g.view(-1)[:3] = torch.tensor([math.inf, math.nan, -math.inf])
        return g


def test_telemetry_without_other_hooks_walks_no_parameter_on_finite_steps(tiny: TinyRegressor,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    walks: list[int] = []
    step = [0]
    inner = core.params_with_grads

    def counted(optimizers):  # type: ignore[no-untyped-def]
        walks.append(step[0])
        return inner(optimizers)

    monkeypatch.setattr(core, "params_with_grads", counted)
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=5, alarms=(), zero_grads_every=0)
    opt = torch.optim.AdamW(tiny.parameters(), lr=2e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    tiny.body[2].weight.register_hook(_PoisonGrad(3))
    for i in range(5):
        step[0] = i + 1
        train_step(mp, tiny, opt, *batch())
    assert [r["nonfinite_grads"] for r in records] == [0, 0, 3, 0, 0]
    assert [r["skipped"] for r in records] == [False, False, True, False, False]
    assert set(walks) == {3}, "only the step whose norm is not finite reads the gradients"


def test_telemetry_lr_tensor_changed_in_place_after_each_step_is_recorded_per_step(tiny: TinyRegressor) -> None:
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=4, alarms=())
    lr = torch.tensor(1e-3)
    opt = torch.optim.AdamW(tiny.parameters(), lr=lr, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    for _ in range(4):
        train_step(mp, tiny, opt, *batch())
        opt.param_groups[0]["lr"].mul_(0.5)  # a scheduler that updates a tensor lr in place
    assert [r["lr"] for r in records] == pytest.approx([1e-3, 5e-4, 2.5e-4, 1.25e-4])


def test_telemetry_records_every_step_in_order_across_row_batches(tiny: TinyRegressor) -> None:
    steps = 2 * ROW_BATCH + 5
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=steps + 10, alarms=(), zero_grads_every=3)
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision("fp16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    losses, scales = [], []
    for _ in range(steps):
        x, idx, y = batch()
        with mp.autocast():
            loss = (tiny(x, idx).float() - y).pow(2).mean()
        losses.append(float(loss.detach()))
        scales.append(float(mp.scale))
        mp.backward(loss)
        mp.step(opt)
    tel.close()
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["loss"] for r in records] == losses
    assert [r["scale"] for r in records] == scales
    assert [r["next_scale"] for r in records] == [*scales[1:], float(mp.scale)]
    assert [r["zero_grad_fraction"] is not None for r in records] == [s % 3 == 1 for s in range(1, steps + 1)]


def test_telemetry_loss_changed_in_place_after_backward_is_recorded_as_passed(tiny: TinyRegressor) -> None:
    # transformers' Trainer scales the model's loss in place (`loss *= ...`) after the forward returned it.
    records: list[dict] = []
    tel = Telemetry(sinks=[records.append], flush_every=1, alarms=())
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3, fused=True)
    mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    mp.prepare(tiny)
    x, idx, y = batch()
    with mp.autocast():
        loss = (tiny(x, idx).float() - y).pow(2).mean()
    passed = float(loss.detach())
    mp.backward(loss)
    with torch.no_grad():
        loss.mul_(1000.0)
    mp.step(opt)
    assert records[0]["loss"] == passed
