"""The cast-consumer walk: which model outputs reach the loss only through a dtype cast.

Both replaying doctors keep the gradient an output received in backward, to re-run the model
later and backpropagate it.  When a cast consumes the output (``out.float()`` before the loss,
autocast's fp32 loss ops), the gradient *before* that cast is wider (fp32) and is worth
keeping too: a loss scale that overflows fp16 exactly at that boundary then replays
faithfully.  The gradient arriving at a cast is the output's whole gradient only when that
cast is the output's sole consumer: with ``loss = out.float().sum() + 2 * out.sum().float()``
the cast sees 1.0 while ``out`` receives 3.0.  So a cast is reported only when the walk saw
the entire loss-side graph and the cast is the output's one consumer there.

Cost: a Python walk over at most ``limit`` autograd nodes, once per backward, on the doctor's
path only (no tensor is touched).

>>> import torch
>>> w = torch.ones(2, requires_grad=True)
>>> out16 = (w * 2).half()
>>> loss = out16.float().sum()
>>> [type(n).__name__ for n in sole_cast_consumers([loss.grad_fn], {out16.grad_fn}).values()]
['ToCopyBackward0']
>>> mixed = out16.float().sum() + 2 * out16.sum().float()
>>> sole_cast_consumers([mixed.grad_fn], {out16.grad_fn})
{}
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

__all__ = ["CAST_NODE", "sole_cast_consumers"]

CAST_NODE = "ToCopyBackward0"
"""The autograd node of ``Tensor.to(dtype)`` / ``.float()`` / ``.half()`` (and autocast's casts)."""


def sole_cast_consumers(roots: Iterable[Any], outputs: Container[Any], limit: int = 64) -> dict[Any, Any]:
    """``{output node: cast node}`` for each of ``outputs`` (autograd nodes) whose one consumer on
    the way from ``roots`` (the loss's nodes) is a dtype cast.

    The walk stops at ``outputs`` (never entering the model's own graph); when the loss-side
    graph has more than ``limit`` nodes nothing is returned, since an unseen consumer could
    make any cast's gradient partial.
    """
    queue = [r for r in roots if r is not None and r not in outputs]
    seen = set(queue)
    consumers: dict[Any, list[Any]] = {}
    while queue:
        if len(seen) > limit:
            return {}  # a large loss-side graph: keep the outputs' own gradients only
        node = queue.pop(0)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt in outputs:
                consumers.setdefault(nxt, []).append(node)
                continue
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return {out: nodes[0] for out, nodes in consumers.items()
            if len(nodes) == 1 and type(nodes[0]).__name__ == CAST_NODE}
