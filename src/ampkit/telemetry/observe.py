"""``observe``: telemetry for a training loop that ampkit does not drive.

A framework (or the user) owns the loop: its own ``torch.amp.GradScaler`` (or none: bf16,
fp32), its optimizers and LR scheduler.  ``LoopObserver`` feeds the same ``Telemetry`` the engine
feeds (same records, same alarms, same sinks) through torch's public hooks only:

* ``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``: the step boundary, the
  gradients (inside ``GradScaler.step`` they are unscaled, or carry ``grad_scale`` for fused
  optimizers), the learning rate;
* a forward pre-hook (and a forward hook for a returned loss) on ``model``, and a
  ``register_post_accumulate_grad_hook`` on one parameter: host events of the next iteration,
  at which the previous step is closed.

A step is closed when the scaler's ``update()`` has run (``GradScalerView.token`` changed),
or, without a scaler, when the loop moves on after ``optimizer.step()``.  That is how a step
that ``GradScaler.step`` skipped is recorded although ``optimizer.step()`` never ran and no
optimizer hook fired: its ``found_inf`` comes from the scaler's per-device tensors and its
``next_scale`` shows the backoff, all on the device.  Fused optimizers (``AdamW(fused=True)``)
are called on skipped steps too, with ``found_inf`` and ``grad_scale`` passed in.

No hook reads the device: every value is written into the telemetry's device rows, which
reach the host once per ``flush_every`` steps.  An alarm with action ``"stop"`` sets
``should_stop`` (the loop or the framework integration reads it) instead of raising out of a
hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._util.grads import global_grad_norm
from ampkit._util.modhooks import own_hook
from ampkit.hooks import HookEvent
from ampkit.telemetry.alarms import AlarmEvent, Monitor, TrainingStopped
from ampkit.telemetry.gradscaler import GradScalerView
from ampkit.telemetry.schedule import SchedulerLog, SchedulerOnSkipAlarm, SchedulerOnSkipMonitor
from ampkit.telemetry.spec import make_telemetry

__all__ = ["LoopObserver", "StepEnd", "loss_of", "observe"]

StepEnd = Callable[[int, torch.Tensor | None, torch.Tensor | None], None]
"""``on_step(step, scale, found_inf)``: called when a step is closed, with device tensors (no host read)."""


class LoopObserver:
    """Records every optimizer step of a loop ampkit does not drive into a ``Telemetry``.

    Build it with ``observe(...)`` (same arguments).  It is the telemetry's ``StepSource``.

    Args:
        optimizers: the loop's optimizer, or a list of them (one record per step of all of them).
        scaler: the loop's ``torch.amp.GradScaler``; None (or a disabled one) without loss scaling.
        telemetry: the ``telemetry=`` forms of ``MixedPrecision``: a ``Telemetry``, sinks, a
            ``*.jsonl`` path, or True (alarms only).
        model: module(s) whose floating inputs are watched and whose forward marks the next
            iteration; when its output is (or holds, as ``.loss`` or ``["loss"]``) a scalar loss, that
            loss is recorded, unless ``record_loss`` is called.
        scheduler: the LR scheduler the loop steps; checked for ``SCHEDULER_STEPPED_ON_SKIP``.
        clip_grad_norm: the max norm the loop clips to, for ``clip_coef`` (None: 1.0).
        on_event: receives the alarms' requests (``HookEvent(kind="replay")``); returns True when served.
        on_step: called as ``on_step(step, scale, found_inf)`` when a step is closed (the scale the step
            used and the summed ``found_inf``, device tensors or None); framework integrations feed the
            live doctor from it.
    """

    def __init__(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
                 scaler: Any = None, telemetry: Any = True, model: nn.Module | Sequence[nn.Module] | None = None,
                 scheduler: Any = None, clip_grad_norm: float | None = None,
                 on_event: Callable[[HookEvent], bool | None] | None = None,
                 on_step: StepEnd | None = None) -> None:
        self.optimizers = _optimizers(optimizers)
        self._view = GradScalerView(scaler)
        self.scaler = scaler
        self.models: list[nn.Module] = [] if model is None else [model] if isinstance(model, nn.Module) else list(model)
        self.clip_grad_norm = clip_grad_norm
        self.on_event = on_event
        self.on_step = on_step
        self.optimizer_steps = 0
        """Steps closed so far (applied or skipped)."""
        self.should_stop = False
        """True once an alarm with action ``"stop"`` fired: end the loop (integrations end the framework's)."""
        self.stop_event: AlarmEvent | None = None
        """The ``AlarmEvent`` that set ``should_stop``."""
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        if not params:
            raise ValueError("observe(optimizer): the optimizer holds no parameters; pass the loop's optimizer")
        self.device = params[0].device
        self.telemetry = make_telemetry(telemetry, where="observe")
        self._schedule = None if scheduler is None else SchedulerLog(scheduler)
        self.telemetry.bind(self)
        self._follow_scheduler()
        self._zero = torch.zeros((), dtype=torch.float32, device=self.device)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        self._closed = False
        self._explicit_loss = False
        self._token = self._view.token()
        self._reset_iteration()
        self._handles = self._attach(params)

    # -- StepSource ----------------------------------------------------------------------------------
    def emit(self, event: HookEvent) -> bool:
        """Pass an alarm's request to ``on_event``; True when it was served."""
        return bool(self.on_event(event)) if self.on_event is not None else False

    # -- what the loop (or an integration) may call ----------------------------------------------------
    def record_loss(self, loss: torch.Tensor) -> None:
        """Record one micro-batch's loss (unscaled, not divided by the accumulation); turns off output capture."""
        self._explicit_loss = True
        self._tick()
        self.telemetry.record_loss(loss)

    def grads_ready(self, grad_norm: torch.Tensor | None = None) -> None:
        """Record the step's gradients now: call at the boundary after ``scaler.unscale_(optimizer)``.

        Optional: the optimizer pre-hook records them otherwise, but on a step that
        ``GradScaler.step`` skips for a non-fused optimizer that hook never runs, so the record
        then has ``nonfinite_grads=None`` and a NaN ``grad_norm``.  ``grad_norm``: the norm that
        ``clip_grad_norm_`` returned (before clipping); else it is computed from the gradients.
        """
        self._tick()
        if not self._begun:
            self._begin(grad_norm if grad_norm is not None else self._norm())

    def poll(self) -> None:
        """Close the step if the loop has moved past it (its ``scaler.update()`` or ``optimizer.step()`` ran).

        A host event without any device read: a framework callback that runs after the step (and
        after the scheduler's step) calls it, so the step's record and alarms need not wait for the
        next forward.
        """
        self._tick()

    def flush(self) -> list[dict[str, Any]]:
        """Read the closed steps (one host sync), run the alarms, write the sinks; return the records."""
        self._tick()  # a step whose scaler.update() already ran is closed first
        return self._guard(self.telemetry.flush) or []

    def close(self) -> None:
        """Close the last step, flush, close the sinks and remove every hook.  Idempotent."""
        if self._closed:
            return
        self._tick()
        if self._begun:  # the loop ended after the step but before scaler.update()
            self._close_step(self._token)
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._guard(self.telemetry.close)

    def __enter__(self) -> LoopObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """Step count and the alarms' running state, for the loop's checkpoint."""
        return {"optimizer_steps": self.optimizer_steps, "telemetry": self.telemetry.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", self.optimizer_steps))
        self.telemetry.load_state_dict(state.get("telemetry", {}))

    # -- hooks (hot path: no host sync) -------------------------------------------------------------------
    def _attach(self, params: list[torch.Tensor]) -> list[Any]:
        handles = []
        for opt in self.optimizers:
            handles.append(opt.register_step_pre_hook(self._pre_step))
            handles.append(opt.register_step_post_hook(self._post_step))
        trainable = [p for p in params if p.requires_grad]
        if trainable:  # a host event in every backward, even without a model
            handles.append(trainable[0].register_post_accumulate_grad_hook(self._on_grad))
        for model in self.models:
            # Before the telemetry's input watch: the previous step closes before this forward counts.
            handles.append(model.register_forward_pre_hook(own_hook(model, self._on_forward), prepend=True))
            handles.append(model.register_forward_hook(own_hook(model, self._on_output)))
        return handles

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._tick()

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._explicit_loss or self._closed or not torch.is_grad_enabled():
            return
        loss = loss_of(output)
        if loss is not None:
            self.telemetry.record_loss(loss)

    def _on_grad(self, param: torch.Tensor) -> None:
        self._tick()

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._closed:
            return
        if (args and callable(args[0])) or callable(kwargs.get("closure")):
            # optimizer.step(closure) (Lightning's stock plugins without a scaler, LBFGS): the
            # iteration's forward and backward run inside the step, after this hook, so the step
            # begins at grads_ready() or in the post-hook, with this iteration's gradients.
            self._closure_step = True
            return
        self._open_step(opt)

    def _open_step(self, opt: torch.optim.Optimizer) -> None:
        if not self._view.active and id(opt) in self._stepped:
            self._close_step(None)  # no scaler: a second step of this optimizer starts the next iteration
        self._tick(from_step=True)
        self._stepped.add(id(opt))
        if not self._begun:
            norm = self._norm()
            scale = GradScalerView.pending_scale(opt) if self._view.active else None
            if norm is not None and scale is not None:
                norm = norm / scale  # a fused optimizer's gradients still carry the loss scale here
            self._begin(norm)

    def _post_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._closure_step and not self._closed:
            self._closure_step = False
            self._open_step(opt)
        self._done = True

    # -- step bookkeeping ------------------------------------------------------------------------------------
    def _reset_iteration(self) -> None:
        self._begun = self._done = self._closure_step = False
        self._stepped: set[int] = set()
        self._scale_used: torch.Tensor | None = None
        self._lr: Any = None

    def _tick(self, *, from_step: bool = False) -> None:
        """A host event: close the previous step if the loop has moved past it, then note this iteration's start."""
        if self._closed:
            return
        if self._view.active:
            token = self._view.token()
            if token is not self._token:  # update() ran since the last event: that step is over
                old, self._token = self._token, token
                self._close_step(old)
            if self._scale_used is None and (scale := self._view.scale()) is not None:
                self._scale_used = scale.clone()  # update() changes the scale in place
        elif self._done and not from_step:
            self._close_step(None)
        if self._lr is None:
            lr = self.optimizers[0].param_groups[0].get("lr", math.nan)
            self._lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr

    def _norm(self) -> torch.Tensor | None:
        grads = [p.grad for opt in self.optimizers for g in opt.param_groups for p in g["params"]
                 if p.grad is not None and p.grad.numel()]
        return global_grad_norm(grads) if grads else None

    def _begin(self, grad_norm: torch.Tensor | None, *, grads: bool = True, lr: Any = None) -> None:
        # found_inf is final only when the step closes (end_step): 0 until then.
        self.telemetry.begin_step(self.optimizers, self._zero, grad_norm, grads=grads, lr=lr)
        self._begun = True

    def _close_step(self, token: object) -> None:
        if not self._begun:
            # No optimizer hook saw this step: GradScaler.step skipped optimizer.step(), and the
            # gradients are gone by now.  The row gets the lr of the iteration's start.
            self._begin(None, grads=False, lr=self._lr)
        found = GradScalerView.found_inf(token, self.optimizers, self.device)
        scale = self._view.scale()
        used = self._scale_used
        if self._schedule is not None:
            self._schedule.note(self.optimizer_steps + 1)  # before end_step: it may flush this step
        self._guard(lambda: self.telemetry.end_step(self._scale_used, self._one if scale is None else scale,
                                                    found))
        self.optimizer_steps += 1
        self._reset_iteration()
        if self.on_step is not None:
            self.on_step(self.optimizer_steps, used, found)

    def _guard(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except TrainingStopped as stop:  # a hook must not raise out of the framework's step
            self.should_stop = True
            self.stop_event = self.stop_event or stop.event
            return None

    def _follow_scheduler(self) -> None:
        if self._schedule is None:
            return
        monitors: list[Monitor] = [m for m in self.telemetry.monitors if isinstance(m, SchedulerOnSkipMonitor)]
        if not monitors:
            monitors = [self.telemetry.add_alarm(SchedulerOnSkipAlarm())]
        for m in monitors:
            if isinstance(m, SchedulerOnSkipMonitor):
                m.follow(self._schedule)

    def __repr__(self) -> str:
        return (f"LoopObserver(optimizers={[type(o).__name__ for o in self.optimizers]}, "
                f"scaler={type(self.scaler).__name__ if self.scaler is not None else None}, "
                f"steps={self.optimizer_steps}, should_stop={self.should_stop})")


def observe(optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *, scaler: Any = None,
            telemetry: Any = True, model: nn.Module | Sequence[nn.Module] | None = None, scheduler: Any = None,
            clip_grad_norm: float | None = None,
            on_event: Callable[[HookEvent], bool | None] | None = None,
            on_step: StepEnd | None = None) -> LoopObserver:
    """Record every optimizer step of a loop ampkit does not drive (see ``LoopObserver`` and docs/telemetry.md).

    >>> import torch, ampkit.telemetry
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> records = []
    >>> with ampkit.telemetry.observe(opt, telemetry=[records.append]) as obs:
    ...     for _ in range(3):
    ...         loss = model(torch.ones(2, 4)).pow(2).mean()
    ...         obs.record_loss(loss)
    ...         loss.backward()
    ...         opt.step()
    ...         opt.zero_grad()
    >>> [r["step"] for r in records], records[0]["skipped"], records[0]["lr"]
    ([1, 2, 3], False, 0.1)
    """
    return LoopObserver(optimizers, scaler=scaler, telemetry=telemetry, model=model, scheduler=scheduler,
                        clip_grad_norm=clip_grad_norm, on_event=on_event, on_step=on_step)


def _optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers or ())
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise TypeError(f"observe({optimizers!r}): pass the loop's torch.optim.Optimizer or a list of them")
    return opts


def loss_of(output: Any) -> torch.Tensor | None:
    """The scalar loss a forward returned: the output itself, ``output.loss`` or ``output["loss"]``."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", output)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return loss
    return None
