"""Non-finite floats in ampkit's JSON, one documented policy per schema.

Strict JSON has no NaN or Infinity, yet a loss or a range statistic can be either.  Each
schema picks one encoding, and every writer of that schema goes through this module:

* ``ampkit.doctor/1``: the strings ``"inf"``, ``"-inf"``, ``"nan"`` (``NONFINITE_AS_STRING``) —
  a statistic's non-finiteness *is* the evidence, so it stays visible and distinguishable.
* ``ampkit.verify/1``: ``null`` (``NONFINITE_AS_NULL``) — a curve point that was not a number;
  the run's ``nonfinite_steps`` says how many.
* telemetry ``*.jsonl`` records: Python's tokens ``NaN`` / ``Infinity`` (``NONFINITE_AS_TOKEN``),
  which ``json.loads`` and pandas read back as floats; it is a log, not a schema'd report.

``to_json`` also turns tensors into lists (a host read-back), dtypes and devices into their
names, tuples and sets into lists.  It does not import torch: tensors are recognised by their
``tolist`` method.

>>> to_json({"a": (1.0, float("inf")), "b": float("nan")}, NONFINITE_AS_STRING)
{'a': [1.0, 'inf'], 'b': 'nan'}
>>> to_json([float("-inf"), 2], NONFINITE_AS_NULL)
[None, 2]
>>> dumps({"x": float("nan")}, NONFINITE_AS_TOKEN)
'{"x": NaN}'
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

__all__ = ["NONFINITE_AS_NULL", "NONFINITE_AS_STRING", "NONFINITE_AS_TOKEN", "NonFinitePolicy", "dumps", "to_json"]

NonFinitePolicy = Literal["string", "null", "token"]
NONFINITE_AS_STRING: NonFinitePolicy = "string"
NONFINITE_AS_NULL: NonFinitePolicy = "null"
NONFINITE_AS_TOKEN: NonFinitePolicy = "token"


def _float(value: float, policy: NonFinitePolicy) -> Any:
    if math.isfinite(value) or policy == NONFINITE_AS_TOKEN:
        return value
    if policy == NONFINITE_AS_NULL:
        return None
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def to_json(value: Any, policy: NonFinitePolicy) -> Any:
    """``value`` made JSON-able under ``policy`` (recursively; unknown objects become ``str``)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _float(value, policy)
    if isinstance(value, dict):
        return {str(k): to_json(v, policy) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v, policy) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and hasattr(value, "detach"):  # a tensor: one host read-back
        return to_json(value.detach().cpu().tolist(), policy)
    return str(value)


def dumps(value: Any, policy: NonFinitePolicy, **kwargs: Any) -> str:
    """``json.dumps`` of ``to_json(value, policy)``; strict (no NaN tokens) unless the policy is ``token``."""
    return json.dumps(to_json(value, policy), allow_nan=policy == NONFINITE_AS_TOKEN, **kwargs)
