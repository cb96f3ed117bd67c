"""Loss scalers: dynamic, static and none, built on torch's fused AMP kernels.

All scaler state lives on the device (``scale``, growth tracker, hysteresis counter), so
scaling, unscaling, the overflow check and the update never synchronise with the host.
``DynamicLossScaler.state_dict()`` has the exact layout of ``torch.amp.GradScaler.state_dict()``
(plus ampkit's extra keys, which GradScaler ignores), so either can resume from the other.
``load_state_dict`` checks the whole state (``check_state_dict``) before it assigns anything.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch

from ampkit._scaler_rules import (
    DEFAULT_MIN_SCALE,
    check_dynamic_scaler_state,
    check_dynamic_settings,
    check_static_scaler_state,
)
from ampkit._util.grads import unscale_groups

if TYPE_CHECKING:
    from ampkit.precision import Precision

__all__ = [
    "DEFAULT_MIN_SCALE",
    "DynamicLossScaler",
    "LossScaler",
    "NoLossScaler",
    "StaticLossScaler",
    "resolve_scaler",
    "unscale_and_check_",
]

HysteresisMode = Literal["consecutive", "windowed"]

def unscale_and_check_(
    grads: Iterable[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` and add 1 to ``found_inf`` if any is non-finite.

    Grads are grouped by (device, dtype) and each group goes through one
    ``torch._amp_foreach_non_finite_check_and_unscale_`` call: one fused read-and-write pass
    over the gradients, no host sync.  ``found_inf`` (a float32 scalar on ``inv_scale``'s
    device) is returned; groups on other devices are reduced onto it.

    Dense gradients and the values of sparse ones are multiplied in place, except an uncoalesced
    fp16 sparse gradient: it is checked and multiplied as a coalesced copy, as ``GradScaler``
    checks it (duplicate indices can overflow fp16 only once summed), and stays scaled itself.
    To keep the result, replace it by ``g.coalesce()`` first, as the engine does on each
    parameter (``ampkit.engine._boundary.grads_to_unscale``); a coalesced tensor coalesces to itself.
    A complex gradient is checked and multiplied through its real view (``unscale_groups``).

    >>> g = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    >>> found = unscale_and_check_(g, torch.tensor(0.5), torch.zeros(()))
    >>> g[0].tolist(), float(found) > 0
    ([1.0, 2.0], True)
    """
    per_device: dict[torch.device, torch.Tensor] = {}
    for (device, _dtype), tensors in unscale_groups(grads).items():
        if device not in per_device:
            per_device[device] = (
                found_inf if device == found_inf.device else torch.zeros((), device=device)
            )
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, per_device[device], inv_scale.to(device, non_blocking=True)
        )
    for device, f in per_device.items():
        if device != found_inf.device:
            # max, not sum: fused optimizers skip only when found_inf is exactly 1.0.
            torch.maximum(found_inf, f.to(found_inf.device, non_blocking=True), out=found_inf)
    return found_inf


class LossScaler:
    """Base loss scaler: scale 1, no update.  Subclasses override the hooks they need.

    The engine drives every scaler the same way: ``scale(loss)`` before backward,
    ``unscale_(grads, found_inf)`` at the accumulation boundary, ``update(found_inf)`` after
    the optimizer step.
    """

    enabled: bool = False
    """Whether this scaler multiplies the loss (``False`` for ``NoLossScaler``)."""

    def __init__(self) -> None:
        self._device: torch.device | None = None
        self._ones: dict[torch.device, torch.Tensor] = {}

    # -- device state ------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> LossScaler:
        """Place the scaler's state on ``device`` (live state moves with it); returns ``self``.

        >>> float(StaticLossScaler(8.0).to("cpu").scale_tensor("cpu"))
        8.0
        """
        self._ensure_state(torch.device(device))
        return self

    def _ensure_state(self, device: torch.device) -> None:
        self._device = device

    def scale_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The current scale as a float32 tensor on ``device`` (no host sync)."""
        return self._one(torch.device(device))

    def _one(self, device: torch.device) -> torch.Tensor:
        # Cached: the hot path would otherwise allocate a scalar every step.
        if device not in self._ones:
            self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return self._ones[device]

    # -- hooks ---------------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return the loss to call ``backward`` on."""
        return loss

    def unscale_(self, grads: Iterable[torch.Tensor], found_inf: torch.Tensor) -> torch.Tensor:
        """Check ``grads`` for non-finite values (multiplying by 1 is exact) and mark ``found_inf``."""
        return unscale_and_check_(grads, self._one(found_inf.device), found_inf)

    def update(self, found_inf: torch.Tensor) -> None:
        """Adjust the scale after a step; ``found_inf > 0`` means the step was skipped."""

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise unless ``state_dict`` can be loaded; changes nothing (``load_state_dict`` calls it first)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"{type(self).__name__} state must be a dict, got {type(state_dict).__name__}")
        if "scale" in state_dict:
            raise ValueError(
                f"the state holds a loss scale ({state_dict['scale']!r}) but this scaler is {type(self).__name__} "
                "(no loss scaling), so it would be dropped; build the engine with scaler='dynamic' (fp16) to "
                "resume it, or load only the model and optimizer"
            )
        if state_dict:
            warnings.warn(f"{type(self).__name__} state: ignoring unknown keys {sorted(state_dict)}", UserWarning,
                          stacklevel=3)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_state_dict(state_dict)


class NoLossScaler(LossScaler):
    """No loss scaling: the right choice for bf16 and fp32, whose exponent range is fp32's.

    Gradients are still checked for non-finite values so that a NaN skips the step instead of
    poisoning the weights.
    """


class StaticLossScaler(LossScaler):
    """A fixed loss scale.  Steps with non-finite gradients are skipped; the scale never moves.

    >>> s = StaticLossScaler(128.0)
    >>> float(s.scale(torch.tensor(0.5)))
    64.0
    """

    enabled = True

    def __init__(self, scale: float = 2.0**15) -> None:
        super().__init__()
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"StaticLossScaler(scale={scale!r}): the scale must be a finite number > 0")
        self._init_scale = float(scale)
        self._scale: torch.Tensor | None = None

    def _ensure_state(self, device: torch.device) -> None:
        if self._scale is None or self._scale.device != device:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._device = device

    def scale_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        self._ensure_state(torch.device(device))
        assert self._scale is not None
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_tensor(loss.device)

    def unscale_(self, grads: Iterable[torch.Tensor], found_inf: torch.Tensor) -> torch.Tensor:
        # Same reciprocal as GradScaler (computed in float64) so results match bit for bit.
        inv_scale = self.scale_tensor(found_inf.device).double().reciprocal().float()
        unscale_and_check_(grads, inv_scale, found_inf)
        # A scale of 0, or below 2**-128, has no finite fp32 reciprocal.  The fused check reads the
        # *scaled* gradients, finds them finite, and the multiply by inf then writes inf/NaN into
        # every one: GradScaler applies that step and the weights turn NaN.  Skip it instead.  Two
        # scalar kernels, no host sync; max keeps found_inf at exactly 1.0 for the fused optimizers.
        bad = torch.isfinite(inv_scale).logical_not_().to(found_inf.dtype)
        return torch.maximum(found_inf, bad, out=found_inf)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._init_scale}

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_static_scaler_state(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_state_dict(state_dict)
        self._init_scale = float(state_dict["scale"])
        self._scale = None


class DynamicLossScaler(StaticLossScaler):
    """Dynamic loss scaling: back off on overflow, grow after ``growth_interval`` clean steps.

    Algorithm (torch's, with two additions):

    1. each step the loss is multiplied by ``scale``; gradients are multiplied by ``1/scale``
       and checked for inf/NaN in one fused kernel;
    2. on overflow the step is skipped and ``scale *= backoff_factor``, unless ``hysteresis``
       overflows are still tolerated (then only the step is skipped);
    3. after ``growth_interval`` clean steps in a row ``scale *= growth_factor``, never above
       ``max_scale`` (growth is capped; an ``init_scale`` above it is only backed off from);
    4. the scale never backs off below ``min_scale``.

    ``min_scale`` defaults to ``DEFAULT_MIN_SCALE`` (2**-149, the smallest positive fp32): it never
    binds while ``torch.amp.GradScaler``'s scale is positive, so the two stay bit-identical until
    GradScaler's scale would become exactly 0.0 (~166 overflows in a row from 2**16).  A step whose
    ``1/scale`` overflows fp32 (a scale below 2**-128, this floor included) is always skipped:
    unscaling would make every gradient inf/NaN.  ``None`` removes the floor.  Telemetry's
    ``SCALE_COLLAPSE`` alarm fires when the scale sits at its floor.

    ``hysteresis_mode="consecutive"`` forgives overflows as soon as one clean step happens;
    ``"windowed"`` counts every overflow until the scale next grows (a burst of alternating
    good/bad steps therefore still backs off).

    With ``hysteresis=1`` (the default) every update is one ``torch._amp_update_scale_`` call,
    bit-identical to ``torch.amp.GradScaler``.

    >>> s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    >>> s.update(torch.zeros(())); s.update(torch.zeros(())); float(s.scale_tensor())
    16.0
    >>> s.update(torch.ones(())); float(s.scale_tensor())
    8.0
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        max_scale: float | None = 2.0**24,
        min_scale: float | None = DEFAULT_MIN_SCALE,
        hysteresis: int = 1,
        hysteresis_mode: HysteresisMode = "consecutive",
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"DynamicLossScaler(init_scale={init_scale!r}): must be a finite number > 0 "
                             "(the first loss scale; torch's default is 2.0**16 = 65536.0)")
        super().__init__(init_scale)
        check_dynamic_settings({"growth_factor": growth_factor, "backoff_factor": backoff_factor,
                                "growth_interval": growth_interval, "max_scale": max_scale, "min_scale": min_scale,
                                "hysteresis": hysteresis, "hysteresis_mode": hysteresis_mode}, "DynamicLossScaler")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.max_scale = None if max_scale is None or math.isinf(max_scale) else float(max_scale)
        self.min_scale = None if min_scale is None else float(min_scale)
        self.hysteresis = hysteresis
        self.hysteresis_mode: HysteresisMode = hysteresis_mode
        self._init_growth_tracker = 0
        self._init_hysteresis_left = hysteresis
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None

    def _ensure_state(self, device: torch.device) -> None:
        if self._scale is not None and self._scale.device == device:
            return
        if self._scale is not None:  # moved: carry the live state over
            assert self._growth_tracker is not None and self._hysteresis_left is not None
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)
            self._hysteresis_left = self._hysteresis_left.to(device)
        else:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=device)
            self._hysteresis_left = torch.full((), self._init_hysteresis_left, dtype=torch.int32, device=device)
        self._device = device

    def update(self, found_inf: torch.Tensor) -> None:
        device = self._device if self._device is not None else found_inf.device
        self._ensure_state(device)
        assert self._scale is not None and self._growth_tracker is not None
        found_inf = found_inf.to(device=device, dtype=torch.float32, non_blocking=True)
        if self.hysteresis > 1:
            self._update_with_hysteresis(found_inf)
        else:
            before = self._scale.clone() if self.max_scale is not None else None
            torch._amp_update_scale_(
                self._scale,
                self._growth_tracker,
                found_inf,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )
            if before is not None:
                self._cap_growth(before)
        if self.min_scale is not None:
            self._scale.clamp_(min=self.min_scale)

    def _cap_growth(self, before: torch.Tensor) -> None:
        # Growth may not pass max_scale; a scale already above it (a large init) may not grow.
        # Four scalar kernels per step, no host sync.
        assert self._scale is not None and self.max_scale is not None
        cap = torch.clamp(before, min=self.max_scale)
        self._scale.copy_(torch.where(self._scale > before, torch.minimum(self._scale, cap), self._scale))

    def _update_with_hysteresis(self, found_inf: torch.Tensor) -> None:
        scale, tracker, left = self._scale, self._growth_tracker, self._hysteresis_left
        assert scale is not None and tracker is not None and left is not None
        overflow = found_inf > 0
        left_after = torch.where(overflow, left - 1, left)
        backoff = overflow & (left_after <= 0)
        grown = scale * self.growth_factor
        can_grow = torch.isfinite(grown)
        if self.max_scale is not None:
            can_grow &= grown <= max(self.max_scale, 0.0)
        grow = (~overflow) & (tracker + 1 >= self.growth_interval)
        new_scale = torch.where(backoff, scale * self.backoff_factor, torch.where(grow & can_grow, grown, scale))
        new_tracker = torch.where(overflow | grow, torch.zeros_like(tracker), tracker + 1)
        if self.hysteresis_mode == "consecutive":
            reset = ~overflow
        else:  # windowed: forgiven only when the scale grows
            reset = grow
        new_left = torch.where(reset, torch.full_like(left, self.hysteresis), left_after.clamp(min=0))
        scale.copy_(new_scale)
        tracker.copy_(new_tracker)
        left.copy_(new_left)

    # -- state: GradScaler's layout plus ampkit's extra keys --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """GradScaler-compatible state (reads the scale back from the device: a host sync)."""
        if self._scale is not None:
            assert self._growth_tracker is not None and self._hysteresis_left is not None
            scale, tracker = float(self._scale.item()), int(self._growth_tracker.item())
            left = int(self._hysteresis_left.item())
        else:
            scale, tracker, left = self._init_scale, self._init_growth_tracker, self._init_hysteresis_left
        return {
            "scale": scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": tracker,
            "max_scale": self.max_scale,
            "min_scale": self.min_scale,
            "hysteresis": self.hysteresis,
            "hysteresis_mode": self.hysteresis_mode,
            "_hysteresis_left": left,
        }

    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Raise unless ``state_dict`` is a valid state (types, ranges; a scale finite and > 0)."""
        check_dynamic_scaler_state(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` or from ``torch.amp.GradScaler.state_dict()``.

        The whole state is checked first (``check_state_dict``); a bad one changes nothing.
        """
        self.check_state_dict(state_dict)
        self._init_scale = float(state_dict["scale"])
        self.growth_factor = float(state_dict.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state_dict.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state_dict.get("growth_interval", self.growth_interval))
        self._init_growth_tracker = int(state_dict["_growth_tracker"])
        if "max_scale" in state_dict:
            high = state_dict["max_scale"]
            self.max_scale = None if high is None or math.isinf(high) else float(high)
        if "min_scale" in state_dict:
            low = state_dict["min_scale"]
            self.min_scale = None if low is None else float(low)
        self.hysteresis = int(state_dict.get("hysteresis", self.hysteresis))
        self.hysteresis_mode = state_dict.get("hysteresis_mode", self.hysteresis_mode)
        self._init_hysteresis_left = int(state_dict.get("_hysteresis_left", self.hysteresis))
        if self._scale is not None:
            assert self._growth_tracker is not None and self._hysteresis_left is not None
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_left.fill_(self._init_hysteresis_left)


def resolve_scaler(scaler: LossScaler | str | None, precision: Precision) -> LossScaler:
    """The engine's ``scaler=`` argument as a ``LossScaler`` (None: dynamic for fp16, else none).

    >>> from ampkit.precision import Precision
    >>> type(resolve_scaler(None, Precision.parse("fp16", "cpu"))).__name__
    'DynamicLossScaler'
    """
    if scaler is None:
        return DynamicLossScaler() if precision.needs_loss_scaling else NoLossScaler()
    if isinstance(scaler, str):
        choices: dict[str, type[LossScaler]] = {"dynamic": DynamicLossScaler, "static": StaticLossScaler,
                                                  "none": NoLossScaler}
        if scaler not in choices:
            raise ValueError(f"scaler={scaler!r}: use one of {sorted(choices)} or a LossScaler instance")
        scaler = choices[scaler]()
    if not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler={scaler!r} is not an ampkit LossScaler; pass ampkit.DynamicLossScaler(...) "
                        "(a torch.amp.GradScaler's state can be loaded into one with load_state_dict)")
    if scaler.enabled and precision.is_fp8:
        raise ValueError(f"scaler={type(scaler).__name__}(...) with precision={precision.name!r}: fp8 training takes "
                         "no loss scaler. torchao scales every fp8 tensor itself (one scale per tensor or row, "
                         "recomputed each step), and the rest of the model runs under bf16 autocast with fp32 master "
                         "weights and gradients, which do not underflow the way fp16's do. Drop scaler=... (or pass "
                         "scaler='none').")
    if scaler.enabled and precision.name == "bf16":
        _warn_scaler_with_bf16()
    return scaler


def _warn_scaler_with_bf16() -> None:
    warnings.warn(
        "loss scaling was requested with bf16: bf16 has fp32's exponent range, so gradients do not "
        "underflow the way fp16's do and scaling only adds work (ampkit finding SCALER_WITH_BF16). "
        "Drop scaler=... for bf16, or use precision='fp16' if you need fp16.", UserWarning, stacklevel=3)
