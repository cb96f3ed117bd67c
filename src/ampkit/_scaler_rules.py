"""The loss scalers' saved states checked before they are loaded.

Every check runs before anything is assigned, so a state that does not fit raises and leaves
the scaler exactly as it was.  ``torch.amp.GradScaler.state_dict()`` passes the dynamic check:
ampkit's extra keys are optional.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ampkit._util.statecheck import (
    as_mapping,
    int_at_least,
    is_positive_finite,
    is_real,
    optional,
    require,
    warn_unknown,
)

__all__ = ["check_dynamic_scaler_state", "check_static_scaler_state", "is_gradscaler_state"]

_GRADSCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_DYNAMIC_EXTRA_KEYS = ("max_scale", "min_scale", "hysteresis", "hysteresis_mode", "_hysteresis_left")


def is_gradscaler_state(state: Mapping[str, Any]) -> bool:
    """True for ``torch.amp.GradScaler.state_dict()`` (or a scaler state): ``scale`` and ``_growth_tracker``."""
    return "scale" in state and "_growth_tracker" in state and "scaler" not in state


def check_static_scaler_state(state: Any, where: str = "StaticLossScaler state") -> None:
    """Raise unless ``state`` holds a finite ``scale`` > 0."""
    state = as_mapping(state, where)
    require(state, "scale", is_positive_finite, "a finite number > 0", where)
    warn_unknown(state, ("scale",), where)


def check_dynamic_scaler_state(state: Any, where: str = "DynamicLossScaler state") -> None:
    """Raise unless ``state`` is a valid ``DynamicLossScaler``/``GradScaler`` state (types and ranges)."""
    state = as_mapping(state, where)
    if not state:
        raise RuntimeError(
            f"{where} is an empty dict; this happens when the state came from a disabled "
            "torch.amp.GradScaler (enabled=False) — save it from an enabled one"
        )
    require(state, "scale", is_positive_finite, "a finite number > 0", where)
    require(state, "_growth_tracker", int_at_least(0), "an int >= 0 (clean steps since the last growth)", where)
    optional(state, "growth_factor", lambda v: is_real(v) and v > 1, "a number > 1", where)
    optional(state, "backoff_factor", lambda v: is_real(v) and 0 < v < 1, "a number in (0, 1)", where)
    optional(state, "growth_interval", int_at_least(1), "an int >= 1", where)
    optional(state, "max_scale", lambda v: v is None or (is_real(v) and v > 0), "None or a number > 0", where)
    optional(state, "min_scale", lambda v: v is None or is_positive_finite(v), "None or a finite number > 0", where)
    optional(state, "hysteresis", int_at_least(1), "an int >= 1", where)
    optional(state, "hysteresis_mode", lambda v: v in ("consecutive", "windowed"),
             "'consecutive' or 'windowed'", where)
    optional(state, "_hysteresis_left", int_at_least(0), "an int >= 0", where)
    low, high = state.get("min_scale"), state.get("max_scale")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{where}: min_scale={low!r} is above max_scale={high!r}")
    warn_unknown(state, _GRADSCALER_KEYS + _DYNAMIC_EXTRA_KEYS, where)
