"""Observer of ``torch.save`` / ``torch.load``: checkpoints that drop the loss-scaler state.

A resumable checkpoint is one that holds optimizer state.  When a GradScaler is in use, such a
checkpoint needs the scaler's state too; otherwise a resumed run restarts at ``init_scale`` and
spends its first steps skipping updates while the scale falls back (and, with a stable scale
lost, trains differently from the run that saved it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.findings import Finding

__all__ = ["CheckpointWatch", "checkpoint_contents"]


def checkpoint_contents(obj: Any, depth: int = 0) -> set[str]:
    """Which of ``model``, ``optimizer``, ``scaler`` states an object to be saved holds.

    >>> sorted(checkpoint_contents({"model": {"w": torch.zeros(1)}, "opt": {"state": {}, "param_groups": []}}))
    ['model', 'optimizer']
    """
    found: set[str] = set()
    if depth > 3:
        return found
    if isinstance(obj, torch.amp.GradScaler):
        return {"scaler"}
    if isinstance(obj, nn.Module):
        return {"model"}
    if isinstance(obj, torch.optim.Optimizer):
        return {"optimizer"}
    if isinstance(obj, Mapping):
        keys = set(obj)
        if {"state", "param_groups"} <= keys:
            return {"optimizer"}
        if {"scale", "growth_factor"} <= keys or {"scale", "growth_tracker"} <= keys:
            return {"scaler"}
        values = list(obj.values())
        if values and all(isinstance(v, torch.Tensor) for v in values):
            return {"model"}
        for v in values:
            found |= checkpoint_contents(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj[:16]:
            found |= checkpoint_contents(v, depth + 1)
    return found


@dataclass
class _Event:
    iteration: int
    location: str | None
    contents: set[str]


class CheckpointWatch(Watcher):
    """``torch.save`` / ``torch.load``: a checkpoint without the GradScaler's state (CHECKPOINT_MISSING_SCALER)."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        self.saves: list[_Event] = []
        self.loads: list[_Event] = []

    @override
    def install(self, patches: PatchSet) -> None:
        patches.wrap(torch, "save", self._wrap_save)
        patches.wrap(torch, "load", self._wrap_load)

    def _wrap_save(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(obj, *args, **kwargs)
            self.saves.append(_Event(self.state.step, self.state.frames.caller(), checkpoint_contents(obj)))
            return out
        return save

    def _wrap_load(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def load(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            self.loads.append(_Event(self.state.step, self.state.frames.caller(), checkpoint_contents(out)))
            return out
        return load

    def _saves_without_scaler(self) -> list[_Event]:
        """Resumable checkpoints (optimizer state) saved without the scaler's, none at the same step."""
        with_scaler = {e.iteration for e in self.saves if "scaler" in e.contents}
        return [e for e in self.saves
                if "optimizer" in e.contents and "scaler" not in e.contents and e.iteration not in with_scaler]

    def _latent(self) -> None:
        """Info: the checkpoint lacks the state of a scaler that only this machine turns off (no CUDA)."""
        off = [i for i in self.state.scalers.infos if i.off_reason() in ("no_cuda", "device")]
        if not off or any(i.state_taken for i in off):
            return  # a disabled scaler's state_dict() is {}: asking for it is the sign it is saved
        for e in self._saves_without_scaler():
            self.state.ledger.add(Finding(
                code="CHECKPOINT_MISSING_SCALER", severity="info",
                message=(
                    f"torch.save at {e.location} writes a resumable checkpoint ({', '.join(sorted(e.contents))} "
                    f"state) without the GradScaler state. The {off[0].built_as} created at {off[0].location} is "
                    f"disabled on this machine{' (no CUDA device)' if off[0].off_reason() == 'no_cuda' else ''}, so nothing is "
                    "lost here; where it is active "
                    "(on a GPU) a resumed run restarts at init_scale and skips steps until the scale falls back"
                ),
                fix="save and restore the scaler with the rest: `ckpt['scaler'] = scaler.state_dict()` and, "
                    "on resume, `scaler.load_state_dict(ckpt['scaler'])`",
                location=e.location, step=e.iteration,
                evidence={"contents": sorted(e.contents), "latent": True, "off_reason": off[0].off_reason()},
            ), key=("latent", e.location))

    @override
    def finish(self) -> None:
        # An engine's scale is saved with mp.state_dict(), which this watcher does not recognise.
        scalers = [i for i in self.state.scalers.enabled_infos() if not i.engine]
        if not scalers:
            self._latent()
            return
        located = scalers[0].location
        for e in self._saves_without_scaler():
            self.state.ledger.add(Finding(
                code="CHECKPOINT_MISSING_SCALER", severity="warning",
                message=(
                    f"torch.save at {e.location} writes a resumable checkpoint ({', '.join(sorted(e.contents))} "
                    f"state) without the GradScaler state while a GradScaler (created at {located}) is in "
                    "use: a resumed run restarts at init_scale and skips steps until the scale falls back"
                ),
                fix="save and restore the scaler with the rest: `ckpt['scaler'] = scaler.state_dict()` and, "
                    "on resume, `scaler.load_state_dict(ckpt['scaler'])` (ampkit.save_checkpoint does both)",
                location=e.location, step=e.iteration, evidence={"contents": sorted(e.contents)},
            ), key=e.location)
        loaded_state = any(i.state_loaded for i in scalers)
        for e in self.loads:
            if "optimizer" in e.contents and "scaler" not in e.contents:
                self.state.ledger.add(Finding(
                    code="CHECKPOINT_MISSING_SCALER", severity="warning",
                    message=(
                        f"the checkpoint loaded at {e.location} has optimizer state but no GradScaler state: "
                        "the resumed run starts again from init_scale"
                    ),
                    fix="save `scaler.state_dict()` in the checkpoint and restore it with scaler.load_state_dict",
                    location=e.location, step=e.iteration, evidence={"contents": sorted(e.contents)},
                ), key=("load", e.location))
            elif "scaler" in e.contents and not loaded_state:
                self.state.ledger.add(Finding(
                    code="CHECKPOINT_MISSING_SCALER", severity="warning",
                    message=(
                        f"the checkpoint loaded at {e.location} holds GradScaler state, but "
                        "scaler.load_state_dict was never called: the run resumed from init_scale"
                    ),
                    fix="call `scaler.load_state_dict(ckpt['scaler'])` when resuming",
                    location=e.location, step=e.iteration,
                ), key=("unused", e.location))
