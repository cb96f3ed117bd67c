"""``AmpkitCallback``: ampkit telemetry for a Lightning run that keeps Lightning's own precision plugin.

Observe-only: nothing in the step changes.  At ``on_fit_start`` the callback builds an
``ampkit.integrations.accelerate.Watcher`` (setup-check findings, an ``ampkit.telemetry.observe``
observer, the live doctor) on the Trainer's optimizers, the stock plugin's ``torch.amp.GradScaler``
(``"16-mixed"`` on a GPU; none for bf16 and fp32), the LightningModule and its step-interval
scheduler.  Then, per optimizer step:

* ``on_before_backward``: the loss, unscaled (the stock plugin hands the hook the scaled loss
  divided by ``accumulate_grad_batches``; undone on the device, no host read);
* ``on_before_optimizer_step``: the gradients, when they are unscaled there (after the stock
  plugin's ``unscale_``, before Lightning clips them: the norm before clipping);
* ``on_train_batch_end``: the step is closed (no device read) and an alarm with action
  ``"stop"`` sets ``trainer.should_stop``: training ends after the batch whose step fired it;
* ``teardown``: the last step is closed, the records flushed and every hook removed.

Without a scaler the stock plugins call ``optimizer.step(closure)``: forward and backward run inside
the step, and the observer begins the step's record when its gradients are ready.  With
``doctor=True`` the live doctor captures the inputs of the LightningModule's own forward
(``self(x)`` in ``training_step``), or of a child module with trainable parameters that
``training_step`` calls directly (``self.model(x)``), and the loss given to ``on_before_backward``;
on the CPU it decides at ``on_before_optimizer_step``, so a failing step is replayed before
Lightning applies it.

Its state (step count, the alarms' running state) is in the checkpoint (``state_dict``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

from ampkit.findings import Finding
from ampkit.integrations.accelerate import Watcher, strategy_of
from ampkit.integrations.lightning.precision import AmpkitPrecision
from ampkit.integrations.setup_checks import PrecisionInEffect
from ampkit.precision import PrecisionName
from ampkit.telemetry import AlarmEvent
from ampkit.telemetry.gradscaler import GradScalerView

__all__ = ["AmpkitCallback"]

# trainer.precision -> the dtype autocast (or the weights, for "-true") run in.
_ACTUAL: dict[str, PrecisionName] = {"16-mixed": "fp16", "bf16-mixed": "bf16", "16-true": "fp16", "bf16-true": "bf16"}


class AmpkitCallback(Callback):  # type: ignore[misc]
    """Records ampkit telemetry per optimizer step of a stock-precision Lightning run.

    Args:
        telemetry: a ``Telemetry`` (with its alarms and sinks), a list of sinks, a ``*.jsonl``
            path, or True (alarms only): the forms of ``MixedPrecision(telemetry=...)``.
        doctor: replay a failing step through the live doctor, with the precision the Trainer runs
            (the doctor captures the LightningModule's own forward, or a child's: ``self.model(x)``).

    With ``AmpkitPrecision`` the engine records the same telemetry itself: pass
    ``AmpkitPrecision(..., telemetry=...)`` instead of this callback.
    """

    def __init__(self, telemetry: Any = True, doctor: bool = False) -> None:
        self.telemetry_spec = telemetry
        self.doctor = doctor
        self.watcher: Watcher | None = None
        """The watcher of the current ``fit`` (None before it starts and after it ends)."""
        self.stop_event: AlarmEvent | None = None
        """The alarm (action ``"stop"``) that ended training, if one did."""
        self._pending_state: dict[str, Any] | None = None
        self._findings: list[Finding] = []
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
        # Lightning overwrites the requested precision when it falls back ("16-mixed" on CPU runs
        # bf16), so what is checked is the precision in effect.
        actual = _ACTUAL.get(str(trainer.precision), "fp32")
        steps = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]
        self.watcher = Watcher(
            pl_module, list(trainer.optimizers), scaler=scaler,
            precision=PrecisionInEffect(actual, actual, setting=f"Trainer(precision={str(trainer.precision)!r})"),
            scheduler=steps[0] if len(steps) == 1 else None, telemetry=self.telemetry_spec, doctor=self.doctor,
            strategy=strategy_of(trainer.strategy, trainer.strategy.model), framework="Lightning",
            grad_accumulation=self._accumulate, clip_grad_norm=_norm_clip(trainer),
            doctor_roots=_step_roots(pl_module))
        if self._pending_state is not None:
            self.watcher.load_state_dict(self._pending_state)
            self._pending_state = None

    @property
    def findings(self) -> list[Finding]:
        """Setup-check (before step 1), alarm and doctor findings, in the order they were found."""
        return self.watcher.findings if self.watcher is not None else list(self._findings)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.watcher is None:
            return
        value = loss.detach().float()
        scale = self._view.scale()
        if scale is not None:
            value = value / scale  # the stock plugin scaled it before this hook
        if pl_module.automatic_optimization and self._accumulate > 1:
            value = value * self._accumulate  # Lightning divided it for accumulation
        self.watcher.record_loss(value, backward=loss)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        # A fused optimizer's gradients still carry the scale here (it unscales inside step);
        # the observer's optimizer pre-hook records those.
        if self.watcher is None:
            return
        if not (self._view.active and getattr(optimizer, "_step_supports_amp_scaling", False)):
            self.watcher.observer.grads_ready()
        if self.watcher.doctor is not None:
            # Before the update: without a scaler Lightning applies a NaN step, and a replay after it sees NaN weights.
            self.watcher.doctor.before_update(self.watcher.observer.optimizer_steps + 1, self._view.scale())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.watcher is None:
            return
        self.watcher.poll()  # the step (and the scheduler's step) is over: close it, no device read
        if self.watcher.should_stop:
            self.stop_event = self.watcher.observer.stop_event
            trainer.should_stop = True

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Close the last step, flush the records and remove the hooks (``teardown`` calls it)."""
        if self.watcher is not None:
            self.watcher.close()
            self.stop_event = self.stop_event or self.watcher.observer.stop_event
            self._findings = self.watcher.findings
            self._pending_state = self.watcher.state_dict()
            self.watcher = None

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.watcher is not None:
            return self.watcher.state_dict()
        return dict(self._pending_state or {})

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start builds the watcher.
        self._pending_state = dict(state_dict)

    def __repr__(self) -> str:
        return f"AmpkitCallback(doctor={self.doctor}, watcher={self.watcher!r})"


def _step_roots(pl_module: pl.LightningModule) -> list[torch.nn.Module]:
    """The children a ``training_step`` may call instead of ``self(x)`` (``self.model(x)``, the pattern of
    Lightning's own examples): those with trainable parameters (a loss module or a metric has none)."""
    return [m for m in pl_module.children() if any(p.requires_grad for p in m.parameters())]


def _norm_clip(trainer: pl.Trainer) -> float | None:
    if not trainer.gradient_clip_val or trainer.gradient_clip_algorithm not in (None, GradClipAlgorithmType.NORM):
        return None
    return float(trainer.gradient_clip_val)
