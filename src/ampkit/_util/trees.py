"""The leaves of a nested output, with a fast path for the common case: one tensor.

``torch.utils._pytree.tree_flatten`` walks its registry even for a bare tensor (a few
microseconds).  The doctor's observers flatten a model's output and a scaled loss on every
training step, and those are one tensor almost always; the fast path makes that an
``isinstance``.

>>> import torch
>>> t = torch.zeros(1)
>>> leaves(t)[0] is t, len(leaves({"a": t, "b": (t, 3)}))
(True, 3)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["leaves"]


def leaves(tree: Any) -> list[Any]:
    """``tree_flatten(tree)[0]``: the leaves of ``tree`` in pytree order."""
    if isinstance(tree, torch.Tensor):  # a leaf to pytree too (tensor subclasses are not pytree nodes)
        return [tree]
    return tree_flatten(tree)[0]
