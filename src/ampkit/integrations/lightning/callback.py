"""``AmpkitCallback``: ampkit telemetry for a Lightning run that keeps Lightning's own precision plugin.

Observe-only: nothing in the step changes.  At ``on_fit_start`` the callback builds an
``ampkit.telemetry.observe`` observer on the Trainer's optimizers, the stock plugin's
``torch.amp.GradScaler`` (``"16-mixed"`` on a GPU; none for bf16 and fp32), the LightningModule
and its step-interval scheduler.  Then, per optimizer step:

* ``on_before_backward``: the loss, unscaled (the stock plugin hands the hook the scaled loss
  divided by ``accumulate_grad_batches``; undone on the device, no host read);
* ``on_before_optimizer_step``: the gradients, when they are unscaled there (after the stock
  plugin's ``unscale_``, before Lightning clips them: the norm before clipping);
* ``on_train_batch_end``: an alarm with action ``"stop"`` sets ``trainer.should_stop``.  A step
  is closed at the next host event (the next forward or backward), so training ends one batch
  after the step that fired the alarm;
* ``teardown``: the last step is closed, the records flushed and every hook removed.

Its state (step count, the alarms' running state) is in the checkpoint (``state_dict``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

from ampkit.integrations.lightning.precision import AmpkitPrecision
from ampkit.telemetry import AlarmEvent, LoopObserver, observe
from ampkit.telemetry.gradscaler import GradScalerView

__all__ = ["AmpkitCallback"]


class AmpkitCallback(Callback):  # type: ignore[misc]
    """Records ampkit telemetry per optimizer step of a stock-precision Lightning run.

    Args:
        telemetry: a ``Telemetry`` (with its alarms and sinks), a list of sinks, a ``*.jsonl``
            path, or True (alarms only): the forms of ``MixedPrecision(telemetry=...)``.
        doctor: accepted for symmetry with the Hugging Face callback; a failing step is not
            replayed here (run ``ampkit doctor script.py`` on the script instead).

    With ``AmpkitPrecision`` the engine records the same telemetry itself: pass
    ``AmpkitPrecision(..., telemetry=...)`` instead of this callback.
    """

    def __init__(self, telemetry: Any = True, doctor: bool = False) -> None:
        self.telemetry_spec = telemetry
        self.doctor = doctor
        self.observer: LoopObserver | None = None
        """The observer of the current ``fit`` (None before it starts and after it ends)."""
        self.stop_event: AlarmEvent | None = None
        """The alarm (action ``"stop"``) that ended training, if one did."""
        self._pending_state: dict[str, Any] | None = None
        self._view = GradScalerView(None)
        self._accumulate = 1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        if isinstance(plugin, AmpkitPrecision):
            raise ValueError("AmpkitCallback observes Lightning's own precision plugin; with AmpkitPrecision the "
                             "engine records the telemetry itself: pass AmpkitPrecision(..., telemetry=...) and "
                             "drop the callback")
        self.close()
        scaler = getattr(plugin, "scaler", None)
        self._view = GradScalerView(scaler)
        self._accumulate = int(trainer.accumulate_grad_batches)
        steps = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]
        self.observer = observe(list(trainer.optimizers), scaler=scaler, telemetry=self.telemetry_spec,
                                model=pl_module, scheduler=steps[0] if len(steps) == 1 else None,
                                clip_grad_norm=_norm_clip(trainer))
        if self._pending_state is not None:
            self.observer.load_state_dict(self._pending_state)
            self._pending_state = None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.observer is None:
            return
        loss = loss.detach().float()
        scale = self._view.scale()
        if scale is not None:
            loss = loss / scale  # the stock plugin scaled it before this hook
        if pl_module.automatic_optimization and self._accumulate > 1:
            loss = loss * self._accumulate  # Lightning divided it for accumulation
        self.observer.record_loss(loss)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        # A fused optimizer's gradients still carry the scale here (it unscales inside step);
        # the observer's optimizer pre-hook records those.
        if self.observer is not None and not (self._view.active and getattr(optimizer, "_step_supports_amp_scaling",
                                                                            False)):
            self.observer.grads_ready()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._check_stop(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Close the last step, flush the records and remove the hooks (``teardown`` calls it)."""
        if self.observer is not None:
            self.observer.close()
            self.stop_event = self.stop_event or self.observer.stop_event
            self._pending_state = self.observer.state_dict()
            self.observer = None

    def _check_stop(self, trainer: pl.Trainer) -> None:
        if self.observer is not None and self.observer.should_stop:
            self.stop_event = self.observer.stop_event
            trainer.should_stop = True

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.observer is not None:
            return self.observer.state_dict()
        return dict(self._pending_state or {})

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start builds the observer.
        self._pending_state = dict(state_dict)

    def __repr__(self) -> str:
        return f"AmpkitCallback(observer={self.observer!r})"


def _norm_clip(trainer: pl.Trainer) -> float | None:
    if not trainer.gradient_clip_val or trainer.gradient_clip_algorithm not in (None, GradClipAlgorithmType.NORM):
        return None
    return float(trainer.gradient_clip_val)
