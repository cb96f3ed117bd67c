"""Checks of saved states before they are loaded: an engine's and a loss scaler's.

Every check runs before anything is assigned, so a state that does not fit raises and leaves
the engine or scaler exactly as it was.  Required keys must be present with the right type and
range; keys this version does not know only warn, because the formats grow by adding keys.

>>> check_engine_state({"precision": "fp16", "grad_accumulation": 2, "micro_step": 2,
...                     "optimizer_steps": 0, "scaler": {}}, precision="fp16", grad_accumulation=2)
Traceback (most recent call last):
...
ValueError: engine state: micro_step=2 must be an int in [0, grad_accumulation=2) (the micro-batches seen since the last boundary)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EngineState",
    "check_dynamic_scaler_state",
    "check_engine_state",
    "check_static_scaler_state",
    "is_gradscaler_state",
]

ENGINE_KEYS = ("precision", "grad_accumulation", "micro_step", "optimizer_steps", "scaler")
_CHECKPOINT_KEYS = ("format", "model", "optimizer", "scheduler", "rng")
_GRADSCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_DYNAMIC_EXTRA_KEYS = ("max_scale", "min_scale", "hysteresis", "hysteresis_mode", "_hysteresis_left")


@dataclass(frozen=True)
class EngineState:
    """A checked engine state; ``micro_step``/``optimizer_steps`` are None for a bare GradScaler state."""

    scaler: dict[str, Any]
    micro_step: int | None = None
    optimizer_steps: int | None = None


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(lo: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _positive_finite(v: Any) -> bool:
    return _real(v) and math.isfinite(v) and v > 0


def _require(state: Mapping[str, Any], key: str, ok: Callable[[Any], bool], want: str, where: str) -> None:
    if key not in state:
        raise ValueError(f"{where}: the required key {key!r} is missing ({want}); keys present: {sorted(state)}")
    if not ok(state[key]):
        raise ValueError(f"{where}: {key}={state[key]!r} must be {want}")


def _optional(state: Mapping[str, Any], key: str, ok: Callable[[Any], bool], want: str, where: str) -> None:
    if key in state:
        _require(state, key, ok, want, where)


def _warn_unknown(state: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in state if k not in known)
    if unknown:
        warnings.warn(f"{where}: ignoring unknown keys {unknown} (written by a newer ampkit, or not this kind "
                      f"of state); the keys read are {list(known)}", UserWarning, stacklevel=4)


def _mapping(state: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(f"{where} must be a dict (what state_dict() returned), got {type(state).__name__}")
    return state


def is_gradscaler_state(state: Mapping[str, Any]) -> bool:
    """True for ``torch.amp.GradScaler.state_dict()`` (or a scaler state): ``scale`` and ``_growth_tracker``."""
    return "scale" in state and "_growth_tracker" in state and "scaler" not in state


def check_static_scaler_state(state: Any, where: str = "StaticLossScaler state") -> None:
    """Raise unless ``state`` holds a finite ``scale`` > 0."""
    state = _mapping(state, where)
    _require(state, "scale", _positive_finite, "a finite number > 0", where)
    _warn_unknown(state, ("scale",), where)


def check_dynamic_scaler_state(state: Any, where: str = "DynamicLossScaler state") -> None:
    """Raise unless ``state`` is a valid ``DynamicLossScaler``/``GradScaler`` state (types and ranges)."""
    state = _mapping(state, where)
    if not state:
        raise RuntimeError(
            f"{where} is an empty dict; this happens when the state came from a disabled "
            "torch.amp.GradScaler (enabled=False) — save it from an enabled one"
        )
    _require(state, "scale", _positive_finite, "a finite number > 0", where)
    _require(state, "_growth_tracker", _int(0), "an int >= 0 (clean steps since the last growth)", where)
    _optional(state, "growth_factor", lambda v: _real(v) and v > 1, "a number > 1", where)
    _optional(state, "backoff_factor", lambda v: _real(v) and 0 < v < 1, "a number in (0, 1)", where)
    _optional(state, "growth_interval", _int(1), "an int >= 1", where)
    _optional(state, "max_scale", lambda v: v is None or (_real(v) and v > 0), "None or a number > 0", where)
    _optional(state, "min_scale", lambda v: v is None or _positive_finite(v), "None or a finite number > 0", where)
    _optional(state, "hysteresis", _int(1), "an int >= 1", where)
    _optional(state, "hysteresis_mode", lambda v: v in ("consecutive", "windowed"),
              "'consecutive' or 'windowed'", where)
    _optional(state, "_hysteresis_left", _int(0), "an int >= 0", where)
    low, high = state.get("min_scale"), state.get("max_scale")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{where}: min_scale={low!r} is above max_scale={high!r}")
    _warn_unknown(state, _GRADSCALER_KEYS + _DYNAMIC_EXTRA_KEYS, where)


def check_engine_state(state: Any, *, precision: str, grad_accumulation: int) -> EngineState:
    """Check an ``Engine.state_dict()`` (or a ``GradScaler.state_dict()``) against an engine's settings.

    The scaler part is returned unchecked: the engine's scaler checks it, as only it knows its kind.
    """
    where = "engine state"
    state = _mapping(state, where)
    whole = [k for k in _CHECKPOINT_KEYS if k in state]
    if "model" in state or "optimizer" in state:
        raise ValueError(
            f"this is a whole checkpoint (keys {whole}), not an engine state; restore it with "
            "ampkit.load_checkpoint(path, model=..., optimizer=..., engine=mp), or pass its 'engine' entry "
            "to mp.load_state_dict(ckpt['engine'])"
        )
    if is_gradscaler_state(state):
        # torch.amp.GradScaler's layout: the scaler fields only; the accumulation position and the
        # step counter are not in it, so they stay as they are.
        return EngineState(scaler=dict(state))
    if not state:
        raise ValueError(f"{where} is an empty dict; pass what mp.state_dict() returned (or a GradScaler's "
                         "state_dict() from an enabled GradScaler)")
    _require(state, "precision", lambda v: isinstance(v, str), "a precision name such as 'fp16'", where)
    if state["precision"] != precision:
        saved = state["precision"]
        raise ValueError(
            f"this engine state was saved with precision={saved!r} but the engine runs {precision!r}; build "
            f"MixedPrecision({saved!r}, ...) to resume it, or start the new precision without loading the engine state"
        )
    _require(state, "grad_accumulation", _int(1), "an int >= 1", where)
    saved_acc = state["grad_accumulation"]
    _require(state, "micro_step", lambda v: _int(0)(v) and v < saved_acc,
             f"an int in [0, grad_accumulation={saved_acc}) (the micro-batches seen since the last boundary)", where)
    _require(state, "optimizer_steps", _int(0), "an int >= 0", where)
    _require(state, "scaler", lambda v: isinstance(v, Mapping), "a dict (the loss scaler's state_dict())", where)
    micro = state["micro_step"]
    if micro and saved_acc != grad_accumulation:
        raise ValueError(
            f"the checkpoint was saved mid-window ({micro} of {saved_acc} micro-batches) but this engine "
            f"accumulates {grad_accumulation}; resume with the same grad_accumulation or save at a boundary"
        )
    _warn_unknown(state, ENGINE_KEYS, where)
    return EngineState(scaler=dict(state["scaler"]), micro_step=micro, optimizer_steps=state["optimizer_steps"])
