"""``LoopDoctor``: the live doctor (``ReplayDoctor``) fed by a loop that ampkit does not drive.

``ReplayDoctor`` is an engine hook: it captures each forward of the models the engine prepared,
the losses given to ``backward`` and, at each step's end, the step's ``found_inf`` and scale.
Here a framework drives the loop, so a small stand-in exposes what the doctor reads from an
engine (``device``, ``precision``, ``models``, ``grad_accumulation``, ``optimizer_steps``) and
the observer's step-end callback delivers the ``StepResult``.  The replay itself is the
doctor's, unchanged: a failing step is re-run on a copy of the model, fully instrumented, with
the precision the framework used.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ampkit.diagnose.live import ReplayDoctor
from ampkit.findings import Finding
from ampkit.hooks import HookEvent, StepResult
from ampkit.precision import Precision
from ampkit.telemetry.observe import loss_of

if TYPE_CHECKING:
    from ampkit.engine import Engine

__all__ = ["LoopDoctor"]

log = logging.getLogger("ampkit.doctor")


class _LoopEngine:
    """What ``ReplayDoctor`` reads from its engine, for a loop driven by a framework."""

    def __init__(self, model: nn.Module, precision: Precision, grad_accumulation: int) -> None:
        self.models = [model]
        self.precision = precision
        self.device = precision.device
        self.grad_accumulation = max(1, int(grad_accumulation))
        self.optimizer_steps = 0


class LoopDoctor:
    """Replays a failing step of a framework's loop through ``ReplayDoctor``.

    Args:
        model: the model whose forward the framework calls (its inputs are captured by reference).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the precision the framework runs.
        grad_accumulation: micro-batches per optimizer step (the loss the framework backpropagates
            is divided by it).
    """

    def __init__(self, model: nn.Module, precision: str, *, grad_accumulation: int = 1) -> None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.doctor = ReplayDoctor()
        self._engine = _LoopEngine(model, Precision.parse(precision, device), grad_accumulation)
        self.doctor.on_attach(self._as_engine)
        self._handle = model.register_forward_hook(self._on_output)
        self._explicit_loss = False
        self._forwards = 0
        self._warned = False
        self._name = type(model).__name__

    @property
    def _as_engine(self) -> Engine:
        return cast("Engine", self._engine)

    @property
    def findings(self) -> list[Finding]:
        """Every finding of every replay so far."""
        return self.doctor.findings

    def step_end(self, step: int, scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """The observer closed ``step``: hand the doctor its result (it replays the step if it failed)."""
        self._engine.optimizer_steps = step
        if self._forwards == 0 and not self._warned:
            # The replay re-runs the captured forward calls: with none there is nothing to replay.
            self._warned = True
            log.warning("ampkit doctor: %s's forward was not called during step %d, so a failing step cannot be "
                        "replayed; call the model itself (self(x) in a LightningModule's training_step, not only "
                        "its submodules) so the doctor captures its inputs", self._name, step)
        self._forwards = 0
        result = StepResult(boundary=True, found_inf=found_inf, scale=scale, optimizer_step=step)
        self.doctor.after_step(self._as_engine, result, [])

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss the framework backpropagates, when the model's forward does not return it.

        Pass the tensor itself (not detached): the doctor walks its graph to the casts that consume
        the model's outputs.  From then on losses returned by the forward are not taken as well.
        """
        self._explicit_loss = True
        if torch.is_grad_enabled():
            self.doctor.on_backward(self._as_engine, loss)

    def on_event(self, event: HookEvent) -> bool | None:
        """A telemetry alarm's request (action ``"doctor"``): replay the last step."""
        return self.doctor.on_event(self._as_engine, event)

    def close(self) -> None:
        self._handle.remove()
        self.doctor.close()

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._forwards += 1
        if self._explicit_loss:
            return
        loss = loss_of(output)
        if loss is not None and torch.is_grad_enabled():
            self.doctor.on_backward(self._as_engine, loss)
