"""The loss scalers' rules, written once: ``DynamicLossScaler``'s settings and a saved scaler state.

``DYNAMIC_RULES`` holds one rule per setting of the dynamic scaler; its constructor and the check
of a state before ``load_state_dict`` both apply it (``check_dynamic_settings``), so a scaler that
can be built can be resumed, and the reverse.  Every check runs before anything is assigned, so a
state that does not fit raises and leaves the scaler exactly as it was.
``torch.amp.GradScaler.state_dict()`` passes the dynamic check: ampkit's extra keys are optional.

>>> check_dynamic_settings({"growth_interval": 0}, "DynamicLossScaler")
Traceback (most recent call last):
...
ValueError: DynamicLossScaler: growth_interval=0 must be an int >= 1 (default 2000)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
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

__all__ = [
    "DEFAULT_MIN_SCALE",
    "DYNAMIC_RULES",
    "Rule",
    "check_dynamic_scaler_state",
    "check_dynamic_settings",
    "check_static_scaler_state",
    "is_gradscaler_state",
]

DEFAULT_MIN_SCALE = 2.0**-149
"""``DynamicLossScaler``'s default floor, the smallest positive fp32: it never binds while
``torch.amp.GradScaler``'s scale is positive, so both match bit for bit until GradScaler's is 0.0."""


@dataclass(frozen=True)
class Rule:
    """What one setting must be: ``ok`` tests a value, ``want`` says it in words (with the default)."""

    ok: Callable[[Any], bool]
    want: str


DYNAMIC_RULES: dict[str, Rule] = {
    "growth_factor": Rule(lambda v: is_real(v) and v > 1, "a number > 1 (torch's default is 2.0)"),
    "backoff_factor": Rule(lambda v: is_real(v) and 0 < v < 1, "a number in (0, 1) (torch's default is 0.5)"),
    "growth_interval": Rule(int_at_least(1), "an int >= 1 (default 2000)"),
    "max_scale": Rule(lambda v: v is None or (is_real(v) and v > 0), "None or a number > 0 (None: no cap)"),
    "min_scale": Rule(lambda v: v is None or is_positive_finite(v),
                      f"None or a finite number > 0 (None: no floor; default {DEFAULT_MIN_SCALE!r}, the "
                      "smallest positive fp32)"),
    "hysteresis": Rule(int_at_least(1), "an int >= 1 (1 = back off on every overflow)"),
    "hysteresis_mode": Rule(lambda v: v in ("consecutive", "windowed"), "'consecutive' or 'windowed'"),
}
"""``DynamicLossScaler``'s settings, each with its rule (the state keys of the same names)."""


def check_dynamic_settings(settings: Mapping[str, Any], where: str) -> None:
    """Raise unless each of ``DYNAMIC_RULES`` present in ``settings`` holds, and ``min_scale <= max_scale``."""
    for key, rule in DYNAMIC_RULES.items():
        optional(settings, key, rule.ok, rule.want, where)
    low, high = settings.get("min_scale"), settings.get("max_scale")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{where}: min_scale={low!r} is above max_scale={high!r}")

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
    check_dynamic_settings(state, where)
    optional(state, "_hysteresis_left", int_at_least(0), "an int >= 0", where)
    warn_unknown(state, _GRADSCALER_KEYS + _DYNAMIC_EXTRA_KEYS, where)
