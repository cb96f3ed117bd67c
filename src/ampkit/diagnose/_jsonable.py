"""Turn diagnostic values into strict JSON (no NaN/Infinity tokens, no tensors, no tuples)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["jsonable"]


def jsonable(value: Any) -> Any:
    """Recursively convert ``value`` so that ``json.dumps(..., allow_nan=False)`` accepts it.

    Non-finite floats become the strings ``"inf"``, ``"-inf"`` and ``"nan"``; tensors become
    lists (a host read-back); dtypes and devices become their names.

    >>> jsonable({"a": (1.0, float("inf")), "b": torch.tensor([2.0])})
    {'a': [1.0, 'inf'], 'b': [2.0]}
    """
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, torch.Tensor):
        return jsonable(value.detach().cpu().tolist())
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    return str(value)
