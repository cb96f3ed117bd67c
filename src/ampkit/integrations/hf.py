"""``AmpkitCallback``: ampkit telemetry, setup checks and the doctor inside a Hugging Face ``Trainer``.

``Trainer(..., callbacks=[AmpkitCallback(telemetry="runs/ampkit.jsonl")])``.  Callbacks receive
neither the batch nor the loss, so the callback builds an ``ampkit.integrations.accelerate.Watcher``
on the Trainer's own model, optimizer, scheduler and ``GradScaler`` (the one Accelerate made, read
through the ``AcceleratedOptimizer``) at ``on_train_begin``; the watcher catches the batch and the
loss through model hooks and reads the scaler's ``found_inf`` and scale on the device:

* ``on_train_begin``: setup-check findings (MIXED_PRECISION_OFF, LOW_PRECISION_PARAMS,
  SCALER_WITH_BF16, fused optimizer + fp16); after ``resume_from_checkpoint``, a check that the
  loss scale the checkpoint was saved with is the one the Trainer restored (CHECKPOINT_MISSING_SCALER);
* the Trainer's ``accelerator.clip_grad_norm_`` (wrapped on the instance for the ``train()`` call):
  the step's gradients are recorded with the total norm it returns, the norm before clipping that
  the Trainer logs as ``grad_norm`` (no second norm, no host read);
* ``on_step_end``: closes the step (one record per optimizer step, after the scheduler stepped, so
  SCHEDULER_STEPPED_ON_SKIP sees it) and turns an alarm with action ``"stop"`` into
  ``control.should_training_stop``; no host read between flushes;
* ``on_save``: flushes and writes the callback's state next to the Trainer's checkpoint
  (``ampkit_state.rank{N}.pt``, written atomically);
* ``on_train_end``: flushes and removes every hook.

A non-finite loss is recorded from the model's output, so ``logging_nan_inf_filter=True`` (which
hides it from the Trainer's logs) does not hide it from ampkit.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Any

import torch
from transformers import TrainerCallback
from typing_extensions import override

from ampkit._util.io import atomic_replace
from ampkit.findings import CODES, Finding
from ampkit.integrations.accelerate import Watcher, accelerate_precision, strategy_of, unwrap

__all__ = ["STATE_FILE", "AmpkitCallback"]

STATE_FILE = "ampkit_state.rank{rank}.pt"
"""The callback's state in each checkpoint folder, one file per rank."""


class AmpkitCallback(TrainerCallback):
    """Observe a ``transformers.Trainer`` run with ampkit (see the module docstring and docs/integrations.md).

    Args:
        telemetry: a ``Telemetry`` (with its alarms and sinks), a list of sinks, a ``*.jsonl`` path (one
            file per rank: ``{rank}`` in the path is replaced by the rank), or True (alarms only).
        doctor: replay a failing step through the doctor, with the precision the Trainer runs.
        checks: run the setup checks before step 1.
    """

    def __init__(self, telemetry: Any = True, doctor: bool = False, *, checks: bool = True) -> None:
        self.telemetry_spec = telemetry
        self.doctor = doctor
        self.checks = checks
        self.watcher: Watcher | None = None
        """The watcher of the current ``train()`` call (None before it starts)."""
        self.resumed: dict[str, Any] | None = None
        """After a resume: ``{"checkpoint", "saved_scale", "scale"}``."""
        self._findings: list[Finding] = []
        self._tap: _PreClipNorm | None = None

    @property
    def findings(self) -> list[Finding]:
        """Everything found so far: setup checks, alarms, resume check, doctor."""
        return self.watcher.findings if self.watcher is not None else list(self._findings)

    @override
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._release()
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise RuntimeError("AmpkitCallback needs the Trainer's model and optimizer in on_train_begin; "
                               "pass it in Trainer(callbacks=[AmpkitCallback()]) rather than calling it directly")
        accel_state = getattr(optimizer, "accelerator_state", None)
        setting = "TrainingArguments(fp16=True)" if args.fp16 else "TrainingArguments(bf16=True)"
        precision = accelerate_precision("fp16" if args.fp16 else "bf16" if args.bf16 else "no",
                                         _autocast_in_forward(model), args.device, setting=setting)
        scaler = getattr(optimizer, "scaler", None)
        self.watcher = Watcher(
            model, [unwrap(optimizer, "optimizer")], scaler=scaler, precision=precision,
            scheduler=unwrap(kwargs.get("lr_scheduler"), "scheduler"), telemetry=_per_rank(self.telemetry_spec, args),
            doctor=self.doctor, strategy=strategy_of(accel_state, model, optimizer), framework="Trainer",
            grad_accumulation=args.gradient_accumulation_steps,
            clip_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
            checks=self.checks)
        clipping = self.watcher.observer.clip_grad_norm is not None
        self._tap = _PreClipNorm.attach(_calling_trainer(), self.watcher, clipping=clipping)
        if state.global_step > 0:
            self._check_resume(self.watcher, args, state)

    @override
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watcher is None:
            return
        self.watcher.poll()
        if self.watcher.should_stop:
            control.should_training_stop = True

    @override
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watcher is None:
            return
        self.watcher.flush()  # the state carries the alarms' windows up to this step: one host read per checkpoint
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(folder):
            return
        payload = {"global_step": state.global_step, **self.watcher.state_dict()}
        atomic_replace(os.path.join(folder, STATE_FILE.format(rank=args.process_index)),
                       lambda f: torch.save(payload, f))

    @override
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.watcher is not None:
            self._findings = self.watcher.findings
        self._release()

    def _release(self) -> None:
        if self._tap is not None:
            self._tap.remove()
            self._tap = None
        if self.watcher is not None:
            self.watcher.close()

    def _check_resume(self, watcher: Watcher, args: Any, state: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        path = os.path.join(folder, STATE_FILE.format(rank=args.process_index))
        if not os.path.isfile(path):
            return
        saved = torch.load(path, weights_only=True)
        watcher.load_state_dict(saved)
        scaler = watcher.scaler
        now = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        self.resumed = {"checkpoint": folder, "saved_scale": saved.get("scale"), "scale": now}
        if saved.get("scale") is not None and saved["scale"] != now:
            watcher.add_finding(Finding(
                code="CHECKPOINT_MISSING_SCALER", severity=CODES["CHECKPOINT_MISSING_SCALER"],
                message=(f"the run resumed from {folder} with loss scale {now} but was saved with "
                         f"{saved['scale']}: the GradScaler's state did not survive the resume, so the scale "
                         "re-calibrates from its initial value (skipped steps, or underflow if it restarts low)"),
                fix=("keep scaler.pt in the checkpoint folder (the Trainer writes and reads it when the accelerator "
                     "has a GradScaler), and create the resumed run with the same precision settings"),
                step=state.global_step, evidence={"saved_scale": saved["scale"], "resumed_scale": now,
                                                  "checkpoint": folder}))

    def __repr__(self) -> str:
        return f"AmpkitCallback(doctor={self.doctor}, watcher={self.watcher!r})"


class _PreClipNorm:
    """The Trainer's ``accelerator.clip_grad_norm_``, wrapped on the instance while ``train()`` runs.

    The Trainer clips (and, with a GradScaler, unscales) before any callback event of the step, and
    ``on_pre_optimizer_step`` sees the clipped gradients.  The total norm ``clip_grad_norm_`` returns
    is the norm before clipping (the Trainer's logged ``grad_norm``): the step's gradients are
    recorded with it, right after the unscale and the clip.  A device tensor: no host read.
    """

    def __init__(self, accelerator: Any, watcher: Watcher) -> None:
        self.accelerator, self.watcher = accelerator, watcher
        self.original = accelerator.clip_grad_norm_
        accelerator.clip_grad_norm_ = self

    @classmethod
    def attach(cls, trainer: Any, watcher: Watcher, *, clipping: bool) -> _PreClipNorm | None:
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None and callable(getattr(accelerator, "clip_grad_norm_", None)):
            return cls(accelerator, watcher)
        if clipping:
            warnings.warn("ampkit: AmpkitCallback found no Trainer calling it, so the recorded grad_norm is read after "
                          "the Trainer's clipping (at most max_grad_norm); use it from Trainer(callbacks=[...])",
                          RuntimeWarning, stacklevel=3)
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        norm = self.original(*args, **kwargs)
        if isinstance(norm, torch.Tensor) and getattr(self.accelerator, "sync_gradients", True):
            self.watcher.grads_ready(norm.detach().to(torch.float32))
        return norm

    def remove(self) -> None:
        if vars(self.accelerator).get("clip_grad_norm_") is self:
            del self.accelerator.clip_grad_norm_


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose ``train()`` runs this callback event (callbacks are not handed
    it): the first caller frame whose ``self`` is one.  A walk of a few frames, once per ``train()``."""
    from transformers import Trainer

    frame: FrameType | None = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


def _autocast_in_forward(model: Any) -> bool:
    """Whether Accelerate wrapped ``model.forward`` in autocast (it keeps the original as ``_original_forward``)."""
    inner = unwrap(model, "module")
    return any(hasattr(m, "_original_forward") for m in (model, inner))


def _per_rank(spec: Any, args: Any) -> Any:
    if isinstance(spec, (str, os.PathLike)) and "{rank}" in os.fspath(spec):
        return os.fspath(spec).replace("{rank}", str(args.process_index))
    return spec
