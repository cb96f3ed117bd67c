"""Checks of one saved state's keys, before anything of it is loaded.

A required key must be present with the right type and range; an optional one, when present;
keys the reader does not know only warn, because saved formats grow by adding keys.  The engine's
and the loss scalers' state checks are built from these (``ampkit.engine._state``,
``ampkit._scaler_rules``).  No torch: the values checked are plain Python numbers and strings.

>>> require({"scale": 0.0}, "scale", is_positive_finite, "a finite number > 0", "scaler state")
Traceback (most recent call last):
...
ValueError: scaler state: scale=0.0 must be a finite number > 0
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["as_mapping", "int_at_least", "is_positive_finite", "is_real", "optional", "require", "warn_unknown"]


def is_real(v: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_at_least(lo: int) -> Callable[[Any], bool]:
    """A test for an int (not a bool) >= ``lo``."""
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def is_positive_finite(v: Any) -> bool:
    """A real number, finite and > 0."""
    return is_real(v) and math.isfinite(v) and v > 0


def require(state: Mapping[str, Any], key: str, ok: Callable[[Any], bool], want: str, where: str) -> None:
    """Raise unless ``state[key]`` is present and passes ``ok`` (``want`` says what it must be)."""
    if key not in state:
        raise ValueError(f"{where}: the required key {key!r} is missing ({want}); keys present: {sorted(state)}")
    if not ok(state[key]):
        raise ValueError(f"{where}: {key}={state[key]!r} must be {want}")


def optional(state: Mapping[str, Any], key: str, ok: Callable[[Any], bool], want: str, where: str) -> None:
    """As ``require`` when ``key`` is present; nothing when it is absent."""
    if key in state:
        require(state, key, ok, want, where)


def warn_unknown(state: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    """Warn about keys outside ``known`` (the caller's caller is named: stacklevel 4)."""
    unknown = sorted(str(k) for k in state if k not in known)
    if unknown:
        warnings.warn(f"{where}: ignoring unknown keys {unknown} (written by a newer ampkit, or not this kind "
                      f"of state); the keys read are {list(known)}", UserWarning, stacklevel=4)


def as_mapping(state: Any, where: str) -> Mapping[str, Any]:
    """``state`` itself when it is a mapping; else raise, naming what it was."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{where} must be a dict (what state_dict() returned), got {type(state).__name__}")
    return state
