"""The cast-consumer walk: a cast is reported only when it is an output's sole consumer."""

from __future__ import annotations

import torch

from ampkit._util.autograd import sole_cast_consumers


def test_autograd_sole_cast_is_reported() -> None:
    w = torch.ones(3, requires_grad=True)
    out = (w * 2).half()
    loss = out.float().sum()
    found = sole_cast_consumers([loss.grad_fn], {out.grad_fn})
    assert list(found) == [out.grad_fn]
    assert type(found[out.grad_fn]).__name__ == "ToCopyBackward0"


def test_autograd_cast_with_another_consumer_is_not_reported() -> None:
    w = torch.ones(3, requires_grad=True)
    out = (w * 2).half()
    loss = out.float().sum() + 2 * out.sum().float()  # the cast sees 1.0, out receives 3.0
    assert sole_cast_consumers([loss.grad_fn], {out.grad_fn}) == {}


def test_autograd_walk_gives_up_on_a_large_loss_graph() -> None:
    w = torch.ones(3, requires_grad=True)
    out = (w * 2).half()
    x = out.float()
    for _ in range(10):
        x = x * 1.0 + 0.0
    assert sole_cast_consumers([x.sum().grad_fn], {out.grad_fn}, limit=8) == {}
    assert list(sole_cast_consumers([x.sum().grad_fn], {out.grad_fn})) == [out.grad_fn]
