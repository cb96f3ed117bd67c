"""The scaler registry: the loss scalers of a run (torch's GradScalers and ampkit engines) and the
bookkeeping of their optimizer window, shared by the watchers that feed or read it.

The GradScaler watcher and the engine watcher add scalers and report guarded steps; the backward
watcher asks which scaler scaled the loss it sees; the optimizer watcher asks whether a step is
guarded; the checkpoint watcher and the end-of-run rules read the ``ScalerInfo`` records.  A guarded
step's ``found_inf`` goes to ``script.failures.found_read``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ampkit._util.threads import PerThread
from ampkit._util.trees import leaves
from ampkit._util.weakmap import WeakIdentityMap

__all__ = ["ScaledSource", "ScalerInfo", "ScalerRegistry"]


@dataclass
class ScaledSource:
    """A tensor returned by a loss scaler's ``scale`` (identity-checked at backward)."""

    tensor: torch.Tensor
    loss: torch.Tensor
    scale: torch.Tensor | None
    enabled: bool
    kind: str
    """``torch`` (GradScaler) or ``ampkit`` (MixedPrecision's scaler)."""


@dataclass
class ScalerInfo:
    location: str | None
    device: str
    requested: bool
    enabled: bool
    init_scale: float
    used: int = 0
    stepped_since_update: bool = False
    unscaled_since_update: bool = False
    backward_scaled: bool = False
    """A backward of a scaled loss ran since the last update (gradients hold loss × scale)."""
    scales: list[tuple[int, float]] = field(default_factory=list)
    """(step, counted from 1, scale after update)."""
    state_taken: bool = False
    state_loaded: bool = False
    saw_bf16: bool = False
    saw_fp16: bool = False
    built_as: str = "torch.amp.GradScaler"
    """The class the script built, as it would spell it (``torch.cuda.amp.GradScaler``)."""
    engine: bool = False
    """The loss scaler of an ampkit engine (``watchers.engine``): it unscales inside ``mp.step``."""
    _copy: tuple[torch.Tensor, int, torch.Tensor] | None = field(default=None, repr=False)
    """(the scale tensor, its version, a copy of it then): ``scale_copy``'s last copy."""

    def scale_copy(self, scale: torch.Tensor) -> torch.Tensor:
        """A copy of the scaler's ``scale`` tensor as it is now (``update`` changes it in place), shared
        with the last copy while the tensor is unchanged (its version counter): the wrappers of
        ``scale``, ``step`` and ``update`` each need the value, and one copy a step serves them."""
        held = self._copy
        if held is not None and held[0] is scale and held[1] == scale._version:
            return held[2]
        copy = scale.clone()  # a GradScaler's scale never requires grad: no detach needed
        self._copy = (scale, scale._version, copy)
        return copy

    @property
    def label(self) -> str:
        """What findings call it: ``GradScaler``, or the ampkit class the script built."""
        return self.built_as if self.engine else "GradScaler"

    def off_reason(self) -> str | None:
        """Why the scaler is off: ``no_cuda`` or ``device`` (torch turned off a scaler the code enabled),
        ``enabled_false`` (the code's own switch), or None when it is on."""
        if self.enabled:
            return None
        if not self.requested:
            return "enabled_false"
        return "no_cuda" if self.device == "cuda" and not torch.cuda.is_available() else "device"


class ScalerRegistry:
    """The run's loss scalers, the tensors they scaled, and the counters of the current update window."""

    in_step = PerThread(int)
    """Depth of guarded optimizer steps (``GradScaler.step``, an ampkit engine's) in this thread."""

    def __init__(self) -> None:
        self.scalers: WeakIdentityMap[Any, ScalerInfo] = WeakIdentityMap()
        self.infos: list[ScalerInfo] = []
        self._scaled: dict[int, ScaledSource] = {}
        self.scaled_overflow: set[int] = set()
        """Steps where loss × scale overflowed the loss's low-precision dtype."""
        self.penalty_overflow: set[int] = set()
        """Steps whose ``torch.autograd.grad`` of a scaled loss returned inf/NaN gradients: the scaled backward
        overflowed, which the scaler's back-off handles (ordinary dynamic scaling, not a forward failure)."""
        self.ampkit_scaled = 0
        self.ampkit_enabled = False
        """An ampkit loss scaler that scaled a loss was enabled."""
        self.direct_steps = 0
        """optimizer.step() calls outside scaler.step since the last update."""
        self.backwards_since_update = 0
        """Backward calls since the last ``GradScaler.update`` (the step-order explanations read it)."""

    def enabled_scalers(self) -> list[tuple[Any, ScalerInfo]]:
        """Live enabled scalers (during the run)."""
        return [(s, i) for s, i in self.scalers.items() if i.enabled]

    def enabled_infos(self) -> list[ScalerInfo]:
        """Every enabled scaler the run created, also after the script dropped it (end-of-run rules)."""
        return [i for i in self.infos if i.enabled]

    def add_scaler(self, sc: Any, info: ScalerInfo) -> ScalerInfo:
        """Watch ``sc`` (a GradScaler, or an ampkit engine) as ``info``."""
        self.scalers[sc] = info
        self.infos.append(info)
        return info

    def info(self, sc: Any) -> ScalerInfo:
        """The record of GradScaler ``sc``; one built before the doctor started is added now."""
        info = self.scalers.get(sc)
        if info is None:
            info = self.add_scaler(sc, ScalerInfo(
                location=None, device=str(getattr(sc, "_device", "cuda")), requested=bool(sc._enabled),
                enabled=bool(sc._enabled), init_scale=float(getattr(sc, "_init_scale", 0.0)),
            ))
        return info

    def register_scaled(self, loss_in: Any, out: Any, scale: torch.Tensor | None, enabled: bool, kind: str) -> None:
        """``out`` is what a scaler's ``scale(loss_in)`` returned (tensors paired leaf by leaf)."""
        for a, b in zip(leaves(loss_in), leaves(out)):
            if isinstance(b, torch.Tensor):
                self._scaled[id(b)] = ScaledSource(tensor=b, loss=a, scale=scale, enabled=enabled, kind=kind)

    def peek_scaled(self, t: torch.Tensor) -> ScaledSource | None:
        """The scaling that produced ``t``, left in place for its backward (``scaled_source`` consumes it)."""
        src = self._scaled.get(id(t))
        return src if src is not None and src.tensor is t else None

    def scaled_source(self, t: torch.Tensor) -> ScaledSource | None:
        """The scaling that produced ``t`` (consumed: a backward asks once), or None when no scaler made it."""
        src = self._scaled.pop(id(t), None)
        if src is None or src.tensor is not t:
            return None
        if src.enabled and src.kind == "torch":
            for sc, info in self.enabled_scalers():
                if src.scale is not None and not info.engine and sc._scale is not None:
                    info.backward_scaled = True
        return src

    def after_update(self) -> None:
        """A GradScaler updated its scale: the backward and direct-step counts and the scaled tensors start over."""
        self.backwards_since_update = 0
        self.direct_steps = 0
        self._scaled.clear()
