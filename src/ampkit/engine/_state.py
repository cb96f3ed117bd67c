"""The check of a saved engine state before it is loaded (a loss scaler's: ``ampkit._scaler_rules``).

The check runs before anything is assigned, so a state that does not fit raises and leaves
the engine exactly as it was.  Required keys must be present with the right type and
range; keys this version does not know only warn, because the formats grow by adding keys.

>>> check_engine_state({"precision": "fp16", "grad_accumulation": 2, "micro_step": 2,
...                     "optimizer_steps": 0, "scaler": {}}, precision="fp16", grad_accumulation=2)
Traceback (most recent call last):
...
ValueError: engine state: micro_step=2 must be an int in [0, grad_accumulation=2) (the micro-batches seen since the last boundary)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ampkit._scaler_rules import is_gradscaler_state
from ampkit._util.statecheck import as_mapping, int_at_least, require, warn_unknown
from ampkit.precision import PrecisionName

__all__ = ["EngineState", "check_engine_state"]

ENGINE_KEYS = ("precision", "grad_accumulation", "micro_step", "optimizer_steps", "scaler")
_CHECKPOINT_KEYS = ("format", "model", "optimizer", "scheduler", "rng")


@dataclass(frozen=True)
class EngineState:
    """A checked engine state; ``micro_step``/``optimizer_steps`` are None for a bare GradScaler state."""

    scaler: dict[str, Any]
    micro_step: int | None = None
    optimizer_steps: int | None = None


def check_engine_state(state: Any, *, precision: PrecisionName, grad_accumulation: int) -> EngineState:
    """Check an ``Engine.state_dict()`` (or a ``GradScaler.state_dict()``) against an engine's settings.

    The scaler part is returned unchecked: the engine's scaler checks it, as only it knows its kind.
    """
    where = "engine state"
    state = as_mapping(state, where)
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
    require(state, "precision", lambda v: isinstance(v, str), "a precision name such as 'fp16'", where)
    if state["precision"] != precision:
        saved = state["precision"]
        raise ValueError(
            f"this engine state was saved with precision={saved!r} but the engine runs {precision!r}; build "
            f"MixedPrecision({saved!r}, ...) to resume it, or start the new precision without loading the engine state"
        )
    require(state, "grad_accumulation", int_at_least(1), "an int >= 1", where)
    saved_acc = state["grad_accumulation"]
    require(state, "micro_step", lambda v: int_at_least(0)(v) and v < saved_acc,
             f"an int in [0, grad_accumulation={saved_acc}) (the micro-batches seen since the last boundary)", where)
    require(state, "optimizer_steps", int_at_least(0), "an int >= 0", where)
    require(state, "scaler", lambda v: isinstance(v, Mapping), "a dict (the loss scaler's state_dict())", where)
    micro = state["micro_step"]
    if micro and saved_acc != grad_accumulation:
        raise ValueError(
            f"the checkpoint was saved mid-window ({micro} of {saved_acc} micro-batches) but this engine "
            f"accumulates {grad_accumulation}; resume with the same grad_accumulation or save at a boundary"
        )
    warn_unknown(state, ENGINE_KEYS, where)
    return EngineState(scaler=dict(state["scaler"]), micro_step=micro, optimizer_steps=state["optimizer_steps"])
