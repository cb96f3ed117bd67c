"""``LoopDoctor``: the live doctor (``ReplayDoctor``) fed by a loop that ampkit does not drive.

``ReplayDoctor`` is an engine hook: it captures each forward of the models the engine prepared,
the losses given to ``backward`` and, at each step's end, the step's ``found_inf`` and scale.
Here a framework drives the loop, so ``_Loop`` holds what a hook reads from its engine (a
``HookedEngine``: ``device``, ``precision``, ``models``, ``grad_accumulation``, ``optimizer_steps``,
``scale``, ``hooks``) and the observer's step-end callback delivers the ``StepResult``.  The replay itself is the
doctor's, unchanged: a failing step is re-run on a copy of the model, fully instrumented, with
the precision the framework used.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampkit._util.modhooks import own_hook
from ampkit.diagnose.live import ReplayDoctor
from ampkit.findings import Finding
from ampkit.hooks import EngineHook, HookEvent, StepResult
from ampkit.precision import Precision, PrecisionName
from ampkit.telemetry.gradscaler import GradScalerView
from ampkit.telemetry.observe import loss_of

__all__ = ["LoopDoctor"]

log = logging.getLogger("ampkit.doctor")


@dataclass
class _Loop:
    """A framework's loop as the hooks see an engine (``ampkit.hooks.HookedEngine``)."""

    models: list[nn.Module]
    precision: Precision
    grad_accumulation: int
    hooks: tuple[EngineHook, ...]
    optimizer_steps: int = 0
    scale: torch.Tensor = field(init=False)
    """The loss scale of the last step the observer closed (1.0 until then, and without a GradScaler)."""

    def __post_init__(self) -> None:
        self.scale = torch.ones((), device=self.device)

    @property
    def device(self) -> torch.device:
        return self.precision.device


class LoopDoctor:
    """Replays a failing step of a framework's loop through ``ReplayDoctor``.

    Args:
        model: the model whose forward the framework calls (its inputs are captured by reference).
        roots: further modules the framework's step may call instead of ``model``'s forward (a
            LightningModule's ``self.model(x)`` in ``training_step``): a call of one of them that is
            not inside another captured call is captured and replayed on its own.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the precision the framework runs.
        grad_accumulation: micro-batches per optimizer step (the loss the framework backpropagates
            is divided by it).
        optimizers, scaler: the loop's optimizers and ``torch.amp.GradScaler`` (or None).  A step
            pre-hook on each calls ``before_update`` when the optimizer is about to apply the
            gradients, so on the CPU a failing step is replayed on the weights it ran with.  A call
            ``optimizer.step(closure)`` runs forward and backward after that hook: the framework's
            integration calls ``before_update`` itself (Lightning's ``on_before_optimizer_step``).
    """

    def __init__(self, model: nn.Module, precision: PrecisionName, *, grad_accumulation: int = 1,
                 roots: Sequence[nn.Module] = (), optimizers: Sequence[torch.optim.Optimizer] = (),
                 scaler: Any = None) -> None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.doctor = ReplayDoctor()
        models = [model, *(r for r in roots if r is not model)]
        self._loop = _Loop(models, Precision.parse(precision, device), max(1, int(grad_accumulation)), (self.doctor,))
        self.doctor.on_attach(self._loop)
        self._handles = [model.register_forward_hook(own_hook(model, self._on_output))]
        self._handles += [m.register_forward_hook(own_hook(m, self._on_root_output)) for m in models[1:]]
        self._handles += [opt.register_step_pre_hook(self._before_step) for opt in optimizers]
        self._view = GradScalerView(scaler)
        self._explicit_loss = False
        self._forwards = 0
        self._warned = False
        self._name = type(model).__name__
        self._roots = bool(roots)

    @property
    def findings(self) -> list[Finding]:
        """Every finding of every replay so far."""
        return self.doctor.findings

    def step_end(self, step: int, scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """The observer closed ``step``: hand the doctor its result (it replays the step if it failed)."""
        self._loop.optimizer_steps = step
        if scale is not None:
            self._loop.scale = scale
        if self._forwards == 0 and not self._warned:
            # The replay re-runs the captured forward calls: with none there is nothing to replay.
            self._warned = True
            what = (f"neither {self._name}'s forward nor one of its child modules with trainable parameters was"
                    if self._roots else f"{self._name}'s forward was not")
            log.warning("ampkit doctor: %s called during step %d, so a failing step cannot be replayed; call the "
                        "model (self(x) or self.model(x) in a LightningModule's training_step, not only deeper "
                        "submodules) so the doctor captures its inputs", what, step)
        self._forwards = 0
        result = StepResult(boundary=True, found_inf=found_inf, scale=scale, optimizer_step=step)
        self.doctor.after_step(self._loop, result, [])

    def before_update(self, step: int, scale: torch.Tensor | None) -> None:
        """Step ``step``'s gradients are ready and the framework has not applied them: on the CPU a failing
        step is replayed now, on the weights it ran with (``ReplayDoctor.before_update``)."""
        self.doctor.before_update(step, None, scale)

    def _before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if (args and callable(args[0])) or callable(kwargs.get("closure")):
            return  # this step's forward and backward have not run yet
        self.before_update(self._loop.optimizer_steps + 1, self._view.scale())

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss the framework backpropagates, when the model's forward does not return it.

        Pass the tensor itself (not detached): the doctor walks its graph to the casts that consume
        the model's outputs.  From then on losses returned by the forward are not taken as well.
        """
        self._explicit_loss = True
        if torch.is_grad_enabled():
            self.doctor.on_backward(self._loop, loss)

    def on_event(self, event: HookEvent) -> bool | None:
        """A telemetry alarm's request (action ``"doctor"``): replay the last step."""
        return self.doctor.on_event(self._loop, event)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.doctor.close()

    def _on_root_output(self, module: nn.Module, args: Any, output: Any) -> None:
        # Only counted: a root's output is an intermediate value, the loss comes from the framework.
        if torch.is_grad_enabled():
            self._forwards += 1

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self._forwards += 1
        if self._explicit_loss:
            return
        loss = loss_of(output)
        if loss is not None and torch.is_grad_enabled():
            self.doctor.on_backward(self._loop, loss)
