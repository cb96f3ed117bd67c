"""``watch(accelerator, model, optimizer)``: ampkit telemetry, setup checks and the doctor for a
hand-written Accelerate loop.

Accelerate owns the loop's ``GradScaler`` (``accelerator.scaler``, created for fp16 on an
accelerator only), wraps the optimizer (``AcceleratedOptimizer``) and the scheduler, and enters
autocast inside ``model.forward``.  ``watch`` reads all of it through
``ampkit.telemetry.observe`` (torch's public hooks; nothing in the loop changes):

* before step 1, ``ampkit.integrations.setup_checks`` compares the precision requested with the one
  in effect and checks the parameters, the scaler and the optimizer;
* each optimizer step gives one telemetry record, with the scaler's ``found_inf`` and scale read
  on the device (no host sync between flushes), including the steps Accelerate's
  ``step_was_skipped`` misses with fused optimizers (accelerate#4242);
* with ``doctor=True`` a failing step is replayed through ``ampkit.diagnose.live``.

DeepSpeed and FSDP are recognised by class names (DeepSpeed is never imported); a
``StrategyWarning`` says what works under them (docs/integrations.md).  Nothing here imports
``accelerate``: the accelerator is read by attribute.

>>> import torch, ampkit.integrations.accelerate as acc
>>> acc.strategy_of(torch.nn.Linear(2, 2)) is None
True
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampkit.findings import Finding, accelerate_fp16_off
from ampkit.hooks import HookEvent
from ampkit.integrations._doctor import LoopDoctor
from ampkit.integrations.setup_checks import PrecisionInEffect, setup_checks
from ampkit.precision import PrecisionName
from ampkit.telemetry import AlarmEvent, CallbackSink, LoopObserver, observe

__all__ = ["StrategyWarning", "Watcher", "accelerate_precision", "strategy_of", "unwrap", "watch"]

STRATEGY_NOTES = {
    "deepspeed": (
        "DeepSpeed scales the loss with its own loss scaler and steps the optimizer inside its engine, on "
        "partitioned (ZeRO) gradients. ampkit records the loss, the learning rate and one record per step, and "
        "runs the setup checks; it does not read DeepSpeed's loss scaler (records show scale 1.0 and no "
        "skipped step, so SCALE_COLLAPSE and SCHEDULER_STEPPED_ON_SKIP cannot fire), gradient statistics cover "
        "what the wrapped optimizer sees, and the doctor's replay is off"),
    "fsdp": (
        "FSDP shards the parameters and gradients. ampkit reads the (Sharded)GradScaler as usual: the scale, "
        "skipped steps, SCALE_COLLAPSE and SCHEDULER_STEPPED_ON_SKIP are exact; gradient counts and grad_norm "
        "cover this rank's shard only (not the global norm); the doctor's replay is off (a replay needs the "
        "whole model on one rank)"),
}
"""What works under each detected strategy (docs/integrations.md, "DeepSpeed and FSDP: what works")."""


class StrategyWarning(UserWarning):
    """A distributed strategy under which part of ampkit's observation is not available."""


def strategy_of(*objects: Any) -> str | None:
    """``"deepspeed"``, ``"fsdp"`` or None, from class names and Accelerate's ``distributed_type``.

    Class names only: DeepSpeed is never imported (``DeepSpeedEngine``, ``DeepSpeedPlugin``,
    ``DeepSpeedOptimizerWrapper``; FSDP's ``FullyShardedDataParallel`` and FSDP2's ``FSDPModule``).
    """
    for obj in objects:
        if obj is None:
            continue
        dist = getattr(getattr(obj, "distributed_type", None), "name", None)
        names = [dist or ""] + [c.__name__ for c in type(obj).__mro__]
        plugin = getattr(obj, "deepspeed_plugin", None)
        if plugin is not None:
            names.append(type(plugin).__name__)
        if any("DeepSpeed" in n or n == "DEEPSPEED" for n in names):
            return "deepspeed"
        if any(n in ("FSDP", "FullyShardedDataParallel", "FSDPModule") for n in names):
            return "fsdp"
    return None


def unwrap(obj: Any, attr: str) -> Any:
    """The torch object inside a framework's wrappers (``AcceleratedOptimizer.optimizer``, ``.scheduler``, ``.module``)."""
    for _ in range(4):  # wrappers nest a few levels at most (DDP around a compiled module, ...)
        inner = getattr(obj, attr, None)
        if inner is None or inner is obj:
            break
        obj = inner
    return obj


_AUTOCAST: dict[str, PrecisionName] = {"fp16": "fp16", "bf16": "bf16"}
"""Accelerate's ``mixed_precision`` values that run autocast (its fp8 runs other libraries' layers)."""


def accelerate_precision(mixed_precision: str, native_amp: bool, device: torch.device | str, *,
                         setting: str) -> PrecisionInEffect:
    """What Accelerate runs for ``mixed_precision`` (its ``native_amp`` says whether autocast is on)."""
    requested = _AUTOCAST.get(mixed_precision)
    actual: PrecisionName = requested if requested is not None and native_amp else "fp32"
    dev = torch.device(device).type
    if requested == "fp16":
        reason, turn_on = accelerate_fp16_off(dev)
    else:
        reason = f"Accelerate did not enable {requested} autocast on {dev} (native_amp is False)"
        turn_on = f"run on a device with {requested} support (check `ampkit env`)"
    return PrecisionInEffect(requested, actual or "fp32", setting=setting, reason=reason, turn_on=turn_on)


class Watcher:
    """Telemetry, setup-check findings and the doctor for one framework-driven loop.

    Built by ``watch(...)`` (Accelerate) and ``ampkit.integrations.hf.AmpkitCallback`` (Trainer).
    ``findings`` holds the setup-check findings, the alarms' findings (at each flush) and the
    doctor's; ``events`` every alarm as a dict; ``should_stop`` is set by an alarm with action
    ``"stop"``.  A context manager; ``close()`` flushes and removes every hook.  ``doctor_roots``:
    modules the loop may call instead of ``model``'s forward, captured for the doctor too
    (``LoopDoctor``'s ``roots``).
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, scaler: Any,
                 precision: PrecisionInEffect, scheduler: Any = None, telemetry: Any = True, doctor: bool = False,
                 strategy: str | None = None, framework: str = "Accelerate", grad_accumulation: int = 1,
                 clip_grad_norm: float | None = None, checks: bool = True,
                 doctor_roots: Sequence[nn.Module] = ()) -> None:
        self.precision, self.strategy, self.framework = precision, strategy, framework
        self.scaler = scaler if isinstance(scaler, torch.amp.GradScaler) else None
        self.events: list[dict[str, Any]] = []
        """Every alarm event, as the sinks receive it."""
        self._findings: list[Finding] = []
        if checks:
            self._findings.extend(setup_checks(precision=precision, model=model, optimizers=optimizers,
                                               scaler=self.scaler, framework=framework))
        if strategy is not None:
            warnings.warn(f"ampkit: {framework} runs under {strategy.upper()}. {STRATEGY_NOTES[strategy]}",
                          StrategyWarning, stacklevel=3)
        self.doctor = (LoopDoctor(model, precision.actual, grad_accumulation=grad_accumulation, roots=doctor_roots,
                                  optimizers=optimizers, scaler=self.scaler)
                       if doctor and strategy is None else None)
        self.observer: LoopObserver = observe(
            list(optimizers), scaler=self.scaler, telemetry=telemetry, model=model, scheduler=scheduler,
            clip_grad_norm=clip_grad_norm, on_event=self._on_event,
            on_step=self.doctor.step_end if self.doctor is not None else None)
        self.telemetry = self.observer.telemetry
        self.telemetry.sinks.append(CallbackSink(_ignore, on_alarm=self._on_alarm))

    @property
    def findings(self) -> list[Finding]:
        """Setup-check, alarm, resume and doctor findings, in the order they were found."""
        return [*self._findings, *(self.doctor.findings if self.doctor is not None else [])]

    @property
    def should_stop(self) -> bool:
        """True once an alarm with action ``"stop"`` fired: end the loop."""
        return self.observer.should_stop

    def add_finding(self, finding: Finding) -> None:
        self._findings.append(finding)

    def record_loss(self, loss: torch.Tensor, *, backward: torch.Tensor | None = None) -> None:
        """Record a micro-batch's loss when the model does not return it (``LoopObserver.record_loss``).

        ``backward``: the tensor the loop backpropagates (scaled or divided, graph attached), for the
        doctor, which walks its graph; None: ``loss``.  Telemetry keeps ``loss`` detached.
        """
        self.observer.record_loss(loss.detach())
        if self.doctor is not None:
            self.doctor.record_loss(backward if backward is not None else loss)

    def grads_ready(self, grad_norm: torch.Tensor | None = None) -> None:
        """Record the step's gradients now, with ``grad_norm`` (``clip_grad_norm_``'s return, before clipping)
        when given (``LoopObserver.grads_ready``)."""
        self.observer.grads_ready(grad_norm)

    def poll(self) -> None:
        """Close the step the loop has moved past (no device read; see ``LoopObserver.poll``)."""
        self.observer.poll()

    def flush(self) -> list[dict[str, Any]]:
        """Read the closed steps (one host sync), run the alarms, write the sinks."""
        return self.observer.flush()

    def state_dict(self) -> dict[str, Any]:
        """The observer's state, plus the loss scale as a float (read on the host: call it at a checkpoint)."""
        scale = float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else None
        return {"observer": self.observer.state_dict(), "scale": scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.observer.load_state_dict(state.get("observer", {}))

    def close(self) -> None:
        """Close the last step, flush, close the sinks and remove every hook.  Idempotent."""
        self.observer.close()
        if self.doctor is not None:
            self.doctor.close()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_event(self, event: HookEvent) -> bool | None:
        return self.doctor.on_event(event) if self.doctor is not None else False

    def _on_alarm(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        finding = AlarmEvent(**event).to_finding()
        if finding is not None:
            self._findings.append(finding)

    def __repr__(self) -> str:
        return (f"Watcher(framework={self.framework!r}, precision={self.precision.actual!r}, "
                f"strategy={self.strategy!r}, steps={self.observer.optimizer_steps}, findings={len(self.findings)})")


def _ignore(record: dict[str, Any]) -> None:
    """The alarm collector's record callback: records reach the user's own sinks."""


def watch(accelerator: Any, model: nn.Module, optimizer: Any, *, scaler: Any = None, scheduler: Any = None,
          telemetry: Any = True, doctor: bool = False, clip_grad_norm: float | None = None,
          checks: bool = True, precision: PrecisionName | None = None) -> Watcher:
    """Watch a hand-written Accelerate loop (see the module docstring and docs/integrations.md).

    Args:
        accelerator: the loop's ``accelerate.Accelerator``.
        model, optimizer: what ``accelerator.prepare`` returned (wrappers are looked through).
        scaler: the loop's ``torch.amp.GradScaler``; None: ``accelerator.scaler``.
        scheduler: the LR scheduler the loop steps (checked for SCHEDULER_STEPPED_ON_SKIP).
        telemetry: a ``Telemetry``, sinks, a ``*.jsonl`` path, or True (alarms only).
        doctor: replay a failing step through the doctor, with the precision Accelerate runs.
        clip_grad_norm: the max norm the loop clips to (for ``clip_coef``).
        checks: run the setup checks (their findings are in ``findings`` at once).
        precision: ``"fp16"``/``"bf16"``/``"fp32"`` when the loop enters autocast itself (with its own
            ``GradScaler``) instead of through ``Accelerator(mixed_precision=...)``.
    """
    scaler = scaler if scaler is not None else getattr(accelerator, "scaler", None)
    state = getattr(accelerator, "state", None)
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    inner = [unwrap(o, "optimizer") for o in optimizers]
    precision_in_effect = precision
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    precision_info = accelerate_precision(mixed, bool(getattr(accelerator, "native_amp", False)),
                                          getattr(accelerator, "device", "cpu"),
                                          setting=f"Accelerator(mixed_precision={mixed!r})")
    if precision_in_effect is not None:
        precision_info.actual = precision_in_effect
    return Watcher(model, inner, scaler=scaler, precision=precision_info,
                   scheduler=unwrap(scheduler, "scheduler") if scheduler is not None else None,
                   telemetry=telemetry, doctor=doctor, strategy=strategy_of(state, accelerator, model, *optimizers),
                   framework="Accelerate", grad_accumulation=int(getattr(accelerator, "gradient_accumulation_steps", 1)),
                   clip_grad_norm=clip_grad_norm, checks=checks)
