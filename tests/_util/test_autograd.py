"""Walks of a loss's autograd graph: a cast reported only when it is an output's sole consumer, the node whose backward raised."""

from __future__ import annotations

import torch

from ampkit._util.autograd import backward_roots, failing_node, note_backward_roots, sole_cast_consumers


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


def _raised(loss: torch.Tensor) -> str:
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("the backward should have raised")


def test_autograd_failing_node_is_the_one_whose_backward_raises_not_an_earlier_promoting_one() -> None:
    # The root multiplies an fp32 loss by an fp16 factor: its node saves both dtypes, and its backward
    # promotes fine.  huber_loss's backward with an fp16 target does not.  Only a re-run that raises
    # the same error counts, so the walk passes the root and names huber_loss.
    w, w2 = torch.ones(4, requires_grad=True), torch.ones(4, requires_grad=True)
    huber = torch.nn.functional.huber_loss(w * 2, torch.zeros(4).half())
    loss = huber * w2.half().sum()
    assert type(loss.grad_fn).__name__ == "MulBackward0"
    message = _raised(loss)
    before = w2.grad.clone()  # the failed backward reached w2 before huber_loss raised
    node, saved = failing_node([loss.grad_fn], message)
    assert type(node).__name__ == "HuberLossBackward0"
    assert saved == {"self": torch.float32, "target": torch.float16}
    assert w.grad is None and torch.equal(w2.grad, before)  # no AccumulateGrad was re-run: no .grad written


def test_autograd_failing_node_is_none_for_another_error_or_a_graph_without_mixed_dtypes() -> None:
    w = torch.ones(4, requires_grad=True)
    loss = torch.nn.functional.huber_loss(w * 2, torch.zeros(4).half())
    message = _raised(loss)
    assert failing_node([loss.grad_fn], "some other error") is None
    clean = (w * 3).sum()
    assert failing_node([clean.grad_fn], message) is None


def test_autograd_backward_roots_are_kept_on_the_exception_once() -> None:
    exc = RuntimeError("x")
    first, second = torch.ones(1, requires_grad=True) * 2, torch.ones(1, requires_grad=True) * 3
    note_backward_roots(exc, [first])
    note_backward_roots(exc, [second])
    assert backward_roots(exc) == [first.grad_fn]
    assert backward_roots(ValueError("never noted")) == []
