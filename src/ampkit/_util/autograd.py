"""Walks of a loss's autograd graph: which model outputs reach the loss only through a dtype
cast, and which node's backward raised a dtype error.

Both replaying doctors keep the gradient an output received in backward, to re-run the model
later and backpropagate it.  When a cast consumes the output (``out.float()`` before the loss,
autocast's fp32 loss ops), the gradient *before* that cast is wider (fp32) and is worth
keeping too: a loss scale that overflows fp16 exactly at that boundary then replays
faithfully.  The gradient arriving at a cast is the output's whole gradient only when that
cast is the output's sole consumer: with ``loss = out.float().sum() + 2 * out.sum().float()``
the cast sees 1.0 while ``out`` receives 3.0.  So a cast is reported only when the walk saw
the entire loss-side graph and the cast is the output's one consumer there.

The same loss-side walk tells which model outputs a backward reaches at all (``outputs_reached``): a
forward that ran in another thread (an executor's worker) belongs to the step whose loss it feeds.

Cost: a Python walk over at most ``limit`` autograd nodes, once per backward, on the doctor's
path only (no tensor is touched).

A backward that raises a dtype error ("Found dtype Half but expected Float") names no op: the
forward accepted a mixed pair (it promotes), the node's backward kernel does not.
``failing_node`` finds that node after the fact, from the roots ``dispatch_backward`` notes on the
exception (``note_backward_roots``): only a node whose saved tensors mix a 16-bit floating dtype
with a wider one can raise it, and each such node is re-run on zero gradients to confirm.

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

import contextlib
from collections.abc import Container, Iterable, Sequence
from typing import Any

import torch

__all__ = ["CAST_NODE", "backward_roots", "failing_node", "note_backward_roots", "outputs_reached",
           "sole_cast_consumers"]

CAST_NODE = "ToCopyBackward0"
"""The autograd node of ``Tensor.to(dtype)`` / ``.float()`` / ``.half()`` (and autocast's casts)."""


def sole_cast_consumers(roots: Iterable[Any], outputs: Container[Any], limit: int = 64) -> dict[Any, Any]:
    """``{output node: cast node}`` for each of ``outputs`` (autograd nodes) whose one consumer on
    the way from ``roots`` (the loss's nodes) is a dtype cast.

    The walk stops at ``outputs`` (never entering the model's own graph); when the loss-side
    graph has more than ``limit`` nodes nothing is returned, since an unseen consumer could
    make any cast's gradient partial.
    """
    consumers = _output_consumers(roots, outputs, limit)
    if consumers is None:
        return {}  # a large loss-side graph: keep the outputs' own gradients only
    return {out: nodes[0] for out, nodes in consumers.items()
            if len(nodes) == 1 and type(nodes[0]).__name__ == CAST_NODE}


def outputs_reached(roots: Iterable[Any], outputs: Container[Any], limit: int = 1024) -> set[Any]:
    """Those of ``outputs`` (autograd nodes) that the graph under ``roots`` reaches, walking only the
    loss side (the walk stops at ``outputs``); empty when that side has more than ``limit`` nodes.

    >>> w = torch.ones(2, requires_grad=True)
    >>> a, b = w * 2, w * 3
    >>> outputs_reached([(a.float() ** 2).sum().grad_fn], {a.grad_fn, b.grad_fn}) == {a.grad_fn}
    True
    """
    live = [r for r in roots if r is not None]
    consumers = _output_consumers(live, outputs, limit)
    return set() if consumers is None else {r for r in live if r in outputs} | consumers.keys()


def _output_consumers(roots: Iterable[Any], outputs: Container[Any], limit: int) -> dict[Any, list[Any]] | None:
    """``{output node: the nodes that consume it}`` over the loss-side graph under ``roots`` (breadth-first,
    never entering ``outputs``); None when that graph has more than ``limit`` nodes."""
    queue = [r for r in roots if r is not None and r not in outputs]
    seen = set(queue)
    consumers: dict[Any, list[Any]] = {}
    while queue:
        if len(seen) > limit:
            return None
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
    return consumers


_ROOTS_ATTR = "_ampkit_backward_roots"
_NARROW = (torch.float16, torch.bfloat16)
_WIDE = (torch.float32, torch.float64)


def note_backward_roots(exc: BaseException, tensors: Sequence[torch.Tensor]) -> None:
    """Keep on ``exc`` the graph roots of the backward that raised it (the first backward to note wins)."""
    if not hasattr(exc, _ROOTS_ATTR):
        # An exception type without a __dict__ keeps nothing: its explanation just names no node.
        with contextlib.suppress(AttributeError):
            setattr(exc, _ROOTS_ATTR, [t.grad_fn for t in tensors if t.grad_fn is not None])


def backward_roots(exc: BaseException) -> list[Any]:
    """The roots ``note_backward_roots`` kept on ``exc``; empty when it was not raised by a watched backward."""
    return list(getattr(exc, _ROOTS_ATTR, ()))


def failing_node(roots: Iterable[Any], message: str, limit: int = 4096) -> tuple[Any, dict[str, torch.dtype]] | None:
    """(node, its saved floating tensors' dtypes by name) of the first node under ``roots`` (breadth-first
    from the loss, the order backward runs them) whose backward, re-run on zero gradients, raises an
    error with ``message``'s first line; None when no node does.

    Only built-in nodes whose saved tensors mix a 16-bit floating dtype with a wider one are re-run
    (no custom ``autograd.Function``: its backward is user code, and no ``AccumulateGrad``: it
    would write into ``.grad``); their re-run is the cost, on a crashed run's graph only.

    >>> w = torch.ones(4, requires_grad=True)
    >>> loss = torch.nn.functional.huber_loss(w * 2, torch.zeros(4).half())
    >>> try:
    ...     loss.backward()
    ... except RuntimeError as exc:
    ...     node, saved = failing_node([loss.grad_fn], str(exc))
    >>> type(node).__name__, sorted((k, str(v)) for k, v in saved.items())
    ('HuberLossBackward0', [('self', 'torch.float32'), ('target', 'torch.float16')])
    """
    first = message.splitlines()[0] if message else ""
    queue = [r for r in roots if r is not None]
    seen = set(queue)
    while queue and len(seen) <= limit:
        node = queue.pop(0)
        saved = _saved_dtypes(node)
        mixed = any(d in _NARROW for d in saved.values()) and any(d in _WIDE for d in saved.values())
        if mixed and _raises(node, first):
            return node, saved
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return None


def _saved_dtypes(node: Any) -> dict[str, torch.dtype]:
    """The dtypes of ``node``'s saved floating tensors (``_saved_<name>``), those still held."""
    out: dict[str, torch.dtype] = {}
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed after its backward ran
                continue
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                out[attr.removeprefix("_saved_")] = value.dtype
    return out


def _raises(node: Any, first_line: str) -> bool:
    if type(node).__name__ in ("AccumulateGrad", "BackwardCFunction") or hasattr(node, "_forward_cls"):
        return False
    try:
        grads = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) for m in node._input_metadata]
        with torch.no_grad():
            node(*grads)
    except Exception as exc:  # the kernel's own error is the answer; anything else is not this one
        text = str(exc)
        return bool(text) and text.splitlines()[0] == first_line
    return False
