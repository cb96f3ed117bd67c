"""The backward watcher: ``torch.autograd.backward`` (which ``Tensor.backward`` calls) — the loss
dtype (LOSS_IN_LOW_PRECISION), loss scaling (NO_LOSS_SCALING) and the loss's finiteness."""

from __future__ import annotations

import torch
from typing_extensions import override

from ampkit._util.threads import PerThread, thread_values
from ampkit.diagnose.core.display import preflight_hint
from ampkit.diagnose.script import failures
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.findings import Finding, loss_in_low_precision_finding
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["BackwardWatch"]


class BackwardWatch(Watcher):
    """``torch.autograd.backward`` (which ``Tensor.backward`` calls): loss dtype, scaling, finiteness."""

    # Between ``before_backward`` and ``after_backward`` of one backward call, per thread: another
    # thread's backward must not swap the loss being judged.
    _pending_loss: PerThread[torch.Tensor | None] = PerThread(lambda: None)
    _scaled_now = PerThread(bool)

    @override
    def before_backward(self, flat: list[torch.Tensor]) -> None:
        scalers = self.state.scalers
        scalers.backwards_since_update += 1
        scaled = scalers.scaled_source(flat[0])
        loss = scaled.loss if scaled is not None else flat[0]
        window = self.state.models.on_backward(flat, loss, scaled.scale if scaled is not None and scaled.enabled else None)
        low = {c.low_precision for c in window} - {None}
        mine = thread_values(self)  # per-step: writes with no Python frame
        mine._scaled_now = scaled is not None and scaled.enabled and scaled.kind == "torch"
        if torch.float16 in low and (scaled is None or not scaled.enabled):
            self.state.ledger.add(Finding(
                code="NO_LOSS_SCALING", severity="error",
                message=(
                    "backward ran on a loss whose forward computed in fp16 without loss scaling: gradients "
                    "smaller than 2^-24 (6e-8) flush to zero in fp16, so small updates vanish silently"
                ),
                fix=((
                    "scale the loss: `scaler = torch.amp.GradScaler(device)`, `scaler.scale(loss).backward()`, "
                    "`scaler.step(optimizer)`, `scaler.update()` (or use ampkit.MixedPrecision('fp16')), "
                    "or train in bf16, which needs no scaling"
                ) if scaled is None or scaled.kind != "torch" else (
                    "the loss goes through scaler.scale(), but that GradScaler is off (turned off by torch on "
                    "this device, or by its enabled= argument): build it for the device the forward runs on "
                    "with its switch on, `torch.amp.GradScaler(device_type, enabled=True)`, or train in bf16, "
                    "which needs no scaling"
                )) + preflight_hint("fp16"),
                location=self.state.frames.caller(), step=self.state.step,
            ), key="backward")
        if loss.numel() == 1 and loss.dtype in LOW_PRECISION_DTYPES:
            location = self.state.frames.caller()
            self.state.ledger.add(loss_in_low_precision_finding(loss.dtype, location=location, step=self.state.step),
                                  key=location)
        mine._pending_loss = loss

    @override
    def after_backward(self, flat: list[torch.Tensor]) -> None:
        mine = thread_values(self)
        loss = mine._pending_loss if mine._pending_loss is not None else flat[0]
        mine._pending_loss = None
        if mine._scaled_now:
            return  # a GradScaler guards this step: a skip triggers the diagnosis (and reads the loss then)
        it = self.state.step
        bad = (~torch.isfinite(loss.detach())).any()
        self.state.pending.read(bad, lambda v: failures.loss_read(self.state, it, v > 0))
