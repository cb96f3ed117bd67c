"""``GradScalerView``: what an observer reads from a ``torch.amp.GradScaler`` it does not own.

Every read of the scaler's internals is here, in one place, so a torch release that renames
them breaks one small class.  Nothing here changes the scaler or waits for the device:

* ``scale()`` is the scaler's scale tensor (``_scale``, updated in place by ``update()``);
* ``token()`` is the per-optimizer state dict (``_per_optimizer_states``), which ``update()``
  replaces by a new one: a different token means an update ran, i.e. an optimizer step ended,
  also when ``GradScaler.step`` skipped ``optimizer.step()`` and no optimizer hook fired;
* ``found_inf(token, optimizers)`` sums the per-device ``found_inf`` tensors that ``unscale_``
  left in that dict (on the device): the skip decision of that step.

>>> import torch
>>> view = GradScalerView(torch.amp.GradScaler("cpu", enabled=False))
>>> view.active, view.scale()
(False, None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GradScalerView"]


class GradScalerView:
    """Read-only, sync-free access to a ``torch.amp.GradScaler``'s scale and skip decisions."""

    def __init__(self, scaler: Any) -> None:
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"observe(scaler={scaler!r}): pass the loop's torch.amp.GradScaler (or torch.cuda.amp.GradScaler), "
                "or scaler=None for a loop without loss scaling (bf16, fp32); a loop driven by ampkit's "
                "MixedPrecision takes telemetry= directly")
        self.scaler = scaler
        self.active = scaler is not None and scaler.is_enabled()
        """False without a scaler or with ``GradScaler(enabled=False)``: no step is ever skipped."""

    def scale(self) -> torch.Tensor | None:
        """The current scale (a device tensor, changed in place by ``update()``); None before the first ``scale()``."""
        return getattr(self.scaler, "_scale", None) if self.active else None

    def token(self) -> object:
        """An object that ``update()`` replaces: compare by identity to tell that a step ended."""
        return getattr(self.scaler, "_per_optimizer_states", None) if self.active else None

    @staticmethod
    def found_inf(token: object, optimizers: Sequence[torch.optim.Optimizer],
                  device: torch.device) -> torch.Tensor | None:
        """Sum of the ``found_inf`` tensors ``unscale_`` recorded for ``optimizers`` in ``token`` (None: none).

        ``token`` is a dict from an earlier ``token()`` call; ``.get`` leaves its defaultdict unchanged.
        """
        if not isinstance(token, dict):
            return None
        found = [t for opt in optimizers for t in token.get(id(opt), {}).get("found_inf_per_device", {}).values()]
        if not found:
            return None
        return torch.stack([t.to(device=device, dtype=torch.float32, non_blocking=True) for t in found]).sum()

    @staticmethod
    def pending_scale(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The scale a fused optimizer's gradients still carry inside ``GradScaler.step`` (None: unscaled).

        ``GradScaler.step`` hands fused optimizers (``_step_supports_amp_scaling``) ``grad_scale``
        and ``found_inf`` as attributes and lets the kernel unscale; they are set only during the call.
        """
        scale = getattr(optimizer, "grad_scale", None)
        return scale if isinstance(scale, torch.Tensor) else None
