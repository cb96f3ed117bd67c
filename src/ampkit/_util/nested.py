"""Tensors nested in lists and tuples, taken apart and put back the way ``GradScaler.scale`` does.

``torch.amp.GradScaler.scale(outputs)`` accepts a tensor or any iterable of them, nested, and
returns the same structure: a list stays a list, a tuple (a named tuple included) a tuple, and any
other iterable becomes an iterator.  ``flatten_tensors`` walks such a structure once, in
depth-first order, and returns its tensors with a function that rebuilds the structure around
new ones; a generator is therefore read only once.  Strings, bytes and mappings are refused: a
mapping would be walked through its keys.

>>> import torch
>>> leaves, rebuild = flatten_tensors([torch.tensor(1.0), (torch.tensor(2.0),)])
>>> [float(t) for t in leaves]
[1.0, 2.0]
>>> rebuild([t * 10 for t in leaves])
[tensor(10.), (tensor(20.),)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["flatten_tensors"]

_Spec = Any
"""None for a tensor, else ``(kind, children)``: kind is the list/tuple type, or None for an iterator."""


def flatten_tensors(
    outputs: Any, *, call: str = "outputs",
) -> tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], Any]]:
    """The tensors of ``outputs`` (depth first) and a function that rebuilds ``outputs`` around new ones.

    ``call`` names the argument in the error raised for anything else than a tensor or a nested
    iterable of tensors.
    """
    leaves: list[torch.Tensor] = []

    def walk(value: Any) -> _Spec:
        if isinstance(value, torch.Tensor):
            leaves.append(value)
            return None
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise TypeError(
                f"{call} needs a tensor or nested lists/tuples of tensors (as torch.amp.GradScaler.scale), "
                f"got {type(value).__name__}"
                + (": pass list(losses.values())" if isinstance(value, Mapping) else "")
            )
        kind = type(value) if isinstance(value, (list, tuple)) else None
        return (kind, [walk(v) for v in value])

    spec = walk(outputs)

    def rebuild(tensors: Sequence[torch.Tensor]) -> Any:
        items = iter(tensors)

        def build(node: _Spec) -> Any:
            if node is None:
                return next(items)
            kind, children = node
            built = [build(c) for c in children]
            if kind is None:
                return iter(built)
            if hasattr(kind, "_fields"):  # a named tuple takes its fields as arguments
                return kind(*built)
            return kind(built)

        return build(spec)

    return leaves, rebuild
