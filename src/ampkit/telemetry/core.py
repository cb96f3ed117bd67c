"""``Telemetry``: the engine hook that records step metrics on the device and flushes them.

Data path of one optimizer step (all on the device, no host sync):

1. ``on_backward`` keeps a copy of the user's loss (unscaled, undivided: one scalar kernel); a
   forward pre-hook on each prepared model keeps the bounds of its floating inputs (``aminmax``:
   one read of the input);
2. ``before_optimizer_step`` (gradients unscaled, clipped, not yet applied; on a skipped
   fp16 step they still hold the inf/NaN) collects the step's values: the loss sum, the input
   bounds' sum, found_inf, the gradient norm, the clip coefficient and the gradient element counts;
3. ``after_step`` adds the scale used, the scale after the update and the learning rate (copies of
   those that change in place later) and queues the row as tensors; every 64 steps one stack
   writes the queued rows into the device buffer (``MetricBuffer.add_row``).

A step therefore costs a handful of kernels whatever the number of parameters or micro-batches
(docs/telemetry.md, "Cost"); whether a loss or an input was inf/NaN is read on the host at the
flush, off the float64 sums (a sum of finite fp32/bf16 values cannot overflow in float64, and an
inf or NaN term makes it inf or NaN).

The engine hooks are thin calls of the recording API (``record_loss``, ``count_grads``,
``begin_step``, ``end_step``), which reads the loop's settings from a ``StepSource``: the
engine, or a ``LoopObserver`` (``ampkit.telemetry.observe``) that calls the same API from
torch's optimizer and module hooks for a loop ampkit does not drive.

Every ``flush_every`` steps the rows are read to the host with one copy (the one sync), turned
into records (plain dicts), checked by the alarms, written to the sinks, and the alarms'
actions run.  Between flushes nothing reaches the host, so alarms react up to
``flush_every - 1`` steps late: lower ``flush_every`` to react sooner, at one sync per flush.
"""

from __future__ import annotations

import atexit
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from ampkit._util.modhooks import own_hook
from ampkit.hooks import EngineHook, HookedEngine, StepResult
from ampkit.telemetry.alarms import Alarm, AlarmEvent, Monitor, default_alarms
from ampkit.telemetry.delivery import act, deliver, guarded
from ampkit.telemetry.exitflush import close_at_exit
from ampkit.telemetry.fp8stats import Fp8Stats
from ampkit.telemetry.gradcounts import StepGradCounts, grads_of, params_with_grads, settled_among
from ampkit.telemetry.metrics import COL, MetricBuffer, ModuleAbsmax
from ampkit.telemetry.records import StepMeta, current_rank, floating_tensors, make_record
from ampkit.telemetry.sinks import Sink, as_sink
from ampkit.telemetry.source import StepSource

__all__ = ["MAX_FLUSH_EVERY", "Telemetry"]

MAX_FLUSH_EVERY = 100_000
"""The device buffer holds one row per step until the flush (about 0.1 KB on CPU): 100,000 steps
is about 10 MB, while an unbounded ``flush_every`` would be allocated whole at the start."""


class Telemetry(EngineHook):
    """On-device step metrics, sinks and alarms for an engine (an ``EngineHook``).

    Attach it with ``MixedPrecision(..., telemetry=tel)``, ``hooks=[tel]`` or
    ``engine.add_hook(tel)``; ``on_attach`` allocates the device buffers.

    Args:
        sinks: ``Sink`` objects (``JsonlSink``, ``TensorBoardSink``, ``ProgressSink``,
            ``CallbackSink``); a plain callable is wrapped in a ``CallbackSink``.
        flush_every: steps between flushes (each flush is one device-to-host copy).
        module_absmax_every: sample per-module gradient absmax on steps 1, 1+K, 1+2K, ... (0: off).
        zero_grads_every: count the zero gradient elements (``zero_grad_fraction``) on steps 1, 1+K,
            1+2K, ... (0: off; None on the other steps).  The count is one more read of every
            gradient, about 0.5 % of a small model's step on a CPU; the non-finite count is taken
            on every step.
        fp8_stats_every: sample the amax and flush fraction of every fp8 GEMM operand (torchao
            ``Float8Linear`` layers) on steps 1, 1+K, ...; None: every 100 steps when the models have
            fp8 layers (0: off).  Without fp8 layers nothing is hooked and nothing is measured.
        alarms: ``Alarm`` configs; None gives ``default_alarms()`` (all "warn"), ``()`` none.
        watch_inputs: count inf/NaN floating inputs of the prepared models (a forward pre-hook).

    Each record is a plain dict: ``step``, ``rank``, ``loss``, ``loss_nonfinite``, ``scale``,
    ``next_scale``, ``skipped``, ``grad_norm``, ``clip_coef``, ``nonfinite_grads``,
    ``zero_grad_fraction``, ``lr``, ``input_nonfinite`` (None when no model is watched), plus
    ``module_grad_absmax`` and ``fp8_amax`` / ``fp8_flush_fraction`` on sampled steps, and ``alarms``
    on steps where one fired.

    >>> import ampkit, torch
    >>> records = []
    >>> tel = Telemetry(sinks=[records.append], flush_every=2)
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    >>> mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=tel)
    >>> _ = mp.prepare(model)
    >>> for _ in range(3):
    ...     with mp.autocast():
    ...         loss = model(torch.ones(2, 4)).float().pow(2).mean()
    ...     mp.backward(loss)
    ...     _ = mp.step(opt)
    >>> [r["step"] for r in records]
    [1, 2]
    >>> tel.close()
    >>> [r["step"] for r in records], records[0]["skipped"], records[0]["lr"]
    ([1, 2, 3], False, 0.001)
    """

    def __init__(
        self,
        sinks: Sequence[Any] = (),
        *,
        flush_every: int = 50,
        module_absmax_every: int = 0,
        zero_grads_every: int = 10,
        fp8_stats_every: int | None = None,
        alarms: Sequence[Alarm] | None = None,
        watch_inputs: bool = True,
    ) -> None:
        if not (isinstance(flush_every, int) and not isinstance(flush_every, bool)
                and 1 <= flush_every <= MAX_FLUSH_EVERY):
            raise ValueError(f"Telemetry(flush_every={flush_every!r}): must be an int from 1 to {MAX_FLUSH_EVERY} "
                             "(steps between flushes; the device buffer holds one row per step until the flush)")
        if not (isinstance(module_absmax_every, int) and module_absmax_every >= 0):
            raise ValueError(f"Telemetry(module_absmax_every={module_absmax_every!r}): must be an int >= 0 (0 = off)")
        if not (isinstance(zero_grads_every, int) and not isinstance(zero_grads_every, bool)
                and zero_grads_every >= 0):
            raise ValueError(f"Telemetry(zero_grads_every={zero_grads_every!r}): must be an int >= 0 (0 = off)")
        if not (fp8_stats_every is None or (isinstance(fp8_stats_every, int) and fp8_stats_every >= 0)):
            raise ValueError(f"Telemetry(fp8_stats_every={fp8_stats_every!r}): must be None (every 100 steps with "
                             "fp8 layers) or an int >= 0 (0 = off)")
        self.flush_every = flush_every
        self.fp8_stats_every = fp8_stats_every
        self.module_absmax_every = module_absmax_every
        self.zero_grads_every = zero_grads_every
        self.watch_inputs = watch_inputs
        if isinstance(sinks, Sink) or callable(sinks):
            sinks = [sinks]
        self.sinks: list[Sink] = [as_sink(s) for s in sinks]
        alarm_list = default_alarms() if alarms is None else list(alarms)
        for a in alarm_list:
            if not isinstance(a, Alarm):
                raise TypeError(f"Telemetry(alarms=[..., {a!r}]): each alarm must be an ampkit.telemetry Alarm "
                                "such as ScaleCollapseAlarm(action='stop')")
        self.alarms = alarm_list
        self.monitors: list[Monitor] = [a.monitor() for a in alarm_list]
        self.engine: StepSource | None = None
        """What this telemetry records: the engine it is attached to, or a ``LoopObserver``."""
        self._closed = False
        self._meta: list[StepMeta] = []
        self._pending: StepMeta | None = None
        self._pending_values: list[torch.Tensor] = []
        """The row values ``begin_step`` collected, ``COLUMNS`` order up to ``scale`` (written by ``end_step``)."""
        self._watched: dict[int, Any] = {}
        self._n_models = 0
        self._step_losses: list[torch.Tensor] = []
        """Copies of this step's losses, summed at the boundary."""
        self._bounds: list[torch.Tensor] = []
        """min and max of each watched floating input since the previous boundary."""
        self._step_grads: list[torch.Tensor] | None = None
        """The gradients ``count_grads`` fetched (and counted or noted) for the step ``begin_step`` records next."""
        self._hooks_seen: tuple[EngineHook, ...] = ()
        self._hooks_settled = False

    def add_alarm(self, alarm: Alarm) -> Monitor:
        """Add ``alarm`` to the rules evaluated at each flush; returns its monitor."""
        if not isinstance(alarm, Alarm):
            raise TypeError(f"add_alarm({alarm!r}): pass an ampkit.telemetry Alarm such as SkipRateAlarm()")
        monitor = alarm.monitor()
        if self.engine is not None:
            monitor.bind(self.engine)
        self.alarms.append(alarm)
        self.monitors.append(monitor)
        return monitor

    # -- binding -------------------------------------------------------------------------------
    @override
    def on_attach(self, engine: HookedEngine) -> None:
        """Bind to ``engine`` and allocate the device buffers (one Telemetry per engine)."""
        if not isinstance(engine, StepSource):
            raise TypeError(f"Telemetry records an ampkit engine's steps (a StepSource: device, scaler, models, "
                            f"optimizer_steps, clip_grad_norm, emit); {type(engine).__name__} is not one; for a "
                            "loop ampkit does not drive use ampkit.telemetry.observe(...)")
        self.bind(engine)

    def bind(self, source: StepSource) -> None:
        """Bind to the loop's driver (an engine, or a ``LoopObserver``) and allocate the device buffers."""
        if self.engine is source:
            return
        if self.engine is not None:
            raise ValueError("this Telemetry is already attached to another MixedPrecision engine or observed "
                             "loop; build one Telemetry per engine (or per ampkit.telemetry.observe(...))")
        self.engine = source
        device = source.device
        self.buffer = MetricBuffer(device, self.flush_every)
        # Constants of the rows: never written, so a row may hold them as they are (the stack copies).
        self._nan = torch.full((), math.nan, dtype=torch.float32, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._grad_counts = StepGradCounts(device, self.zero_grads_every)
        self._modules = ModuleAbsmax(device)
        self._fp8 = Fp8Stats(device, self.fp8_stats_every, lambda: source.optimizer_steps + 1, self.buffer.dtype)
        for m in self.monitors:
            m.bind(source)
        self._watch_new_models()
        # A run that ends without close() (an exception, sys.exit) still writes the rows it holds:
        # the last ones are often the steps that went wrong.  A weak reference, so the hook keeps
        # nothing alive; SIGKILL, and SIGTERM without a handler, end the process before any hook.
        self._exit_hook = close_at_exit(self)

    def _watch_new_models(self) -> None:
        source = self.engine
        if source is None or len(source.models) == self._n_models:
            return
        self._n_models = len(source.models)
        self._fp8.watch(source.models)
        if not self.watch_inputs:
            return
        for model in source.models:
            if id(model) not in self._watched:
                self._watched[id(model)] = model.register_forward_pre_hook(own_hook(model, self._check_inputs), with_kwargs=True)

    def _check_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._closed or not torch.is_grad_enabled():
            return  # evaluation forwards are not part of the step
        for t in floating_tensors(args, kwargs):
            # min and max in one read; either is inf/NaN iff an element is (judged at the flush).
            self._bounds.extend(torch.aminmax(t.detach().reshape(-1)))

    # -- engine hooks: thin calls of the recording API below -------------------------------------------
    @override
    def on_prepare(self, engine: HookedEngine, model: nn.Module) -> None:
        if not self._closed:
            self._watch_new_models()

    @override
    def on_backward(self, engine: HookedEngine, loss: torch.Tensor) -> None:
        self.record_loss(loss)

    @override
    def after_unscale(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        # Counted before clipping: on a skipped step clip_grad_norm_ multiplies every gradient by a
        # NaN coefficient, which would make every element look non-finite.
        self.count_grads(optimizers, settled=self._settled(engine))

    def _settled(self, engine: HookedEngine) -> bool:
        """Whether no other hook of ``engine`` can change a gradient between this hook's ``after_unscale``
        and its ``before_optimizer_step``: none after it has an ``after_unscale``, none a found_inf reduction
        or wait, none before it a ``before_optimizer_step``.  Decided once per hook list (a tuple compare)."""
        hooks = engine.hooks
        if hooks != self._hooks_seen:
            self._hooks_seen, self._hooks_settled = hooks, settled_among(self, hooks)
        return self._hooks_settled

    @override
    def before_optimizer_step(self, engine: HookedEngine, optimizers: Sequence[torch.optim.Optimizer],
                              found_inf: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.begin_step(optimizers, found_inf, grad_norm)

    @override
    def after_step(self, engine: HookedEngine, result: StepResult,
                   optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.end_step(result.scale, engine.scale)

    # -- recording API (hot path: no host sync) ----------------------------------------------------------
    def record_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss (unscaled, undivided) to the step being recorded."""
        if self._closed:
            return
        self._watch_new_models()
        # A copy (one scalar kernel), summed at the boundary: the caller may change its loss in place
        # afterwards (transformers' Trainer scales the model's loss with `loss *= ...`).
        value = loss.detach()
        value = value.reshape(()).clone() if value.numel() == 1 else value.float().mean()
        self._step_losses.append(value)

    def count_grads(self, optimizers: Sequence[torch.optim.Optimizer], *, settled: bool = False) -> None:
        """Count zero and non-finite gradient elements before the engine clips (else ``begin_step``
        counts them); on CPU this may only note the gradients, or (``settled``: no other hook can change
        them before ``begin_step``) leave them alone (``ampkit.telemetry.gradcounts``)."""
        source = self.engine
        if not self._closed and source is not None:
            # begin_step of the same step reads the element count of the counted gradients from here.
            self._step_grads = self._grad_counts.before_clip(
                lambda: grads_of(params_with_grads(optimizers)), source.optimizer_steps + 1,
                engine_clips=source.clip_grad_norm is not None, settled=settled)

    def begin_step(self, optimizers: Sequence[torch.optim.Optimizer], found_inf: torch.Tensor,
                   grad_norm: torch.Tensor | None, *, grads: bool = True, lr: Any = None) -> None:
        """Collect the step's values: losses, input bounds, ``found_inf``, norm, clip coefficient, gradient
        counts, lr (``end_step`` writes them).

        ``grads=False`` when the gradients are gone (an observed step that no hook saw):
        ``nonfinite_grads`` and ``zero_grad_fraction`` are then None.  ``lr`` overrides the
        learning rate read from ``optimizers[0]``.
        """
        source = self.engine
        if self._closed or source is None:
            return
        step = source.optimizer_steps + 1
        counted, self._step_grads = self._step_grads, None
        fetched: list[list[torch.Tensor]] = []

        def current() -> list[torch.Tensor]:  # the gradients the parameters hold now, fetched once
            if not fetched:
                fetched.append(grads_of(params_with_grads(optimizers)))
            return fetched[0]

        zeros, nonfinite = self._grad_counts.take(current, step, grad_norm) if grads else (self._nan, self._nan)
        norm = self._nan if grad_norm is None else grad_norm
        max_norm = source.clip_grad_norm
        clip = self._one if max_norm is None else torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's formula
        losses, self._step_losses = self._step_losses, []
        bounds, self._bounds = self._bounds, []
        self._pending_values = [self._sum(losses), self._sum(bounds), found_inf, norm, clip, nonfinite, zeros]
        if lr is None:
            lr = optimizers[0].param_groups[0].get("lr", math.nan) if optimizers else math.nan
        lr_tensor: torch.Tensor | None = None
        if isinstance(lr, torch.Tensor):
            lr_tensor, lr = lr, None
        # The element count is needed only for the zero fraction (steps with the zero count): of the
        # gradients that were counted.
        numel = 0
        if grads and self._grad_counts.zero_step(step):
            numel = sum(g.numel() for g in (counted if counted is not None else current()))
        meta = StepMeta(step=step, losses=len(losses), numel=numel,
                        lr=None if lr is None else float(lr), watched=bool(self._watched), lr_tensor=lr_tensor)
        if self.module_absmax_every or self._fp8.names:
            self._sample(meta, optimizers if grads else (), source)
        self._pending = meta

    def _sum(self, values: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the step's scalars in the buffer's dtype (one value: itself, no kernel; none: 0)."""
        if len(values) <= 1:
            return values[0] if values else self._zero
        return torch.stack(values).sum(dtype=self.buffer.dtype)

    def _sample(self, meta: StepMeta, optimizers: Sequence[torch.optim.Optimizer], source: StepSource) -> None:
        """Write the sampled tables' rows of the step (per-module absmax, fp8 operand statistics)."""
        every = self.module_absmax_every
        params = params_with_grads(optimizers) if every and (meta.step - 1) % every == 0 else []
        if params:
            slot = sum(1 for m in self._meta if m.module_slot is not None)
            values, present = self._modules.compute(params, grads_of(params), source.models)
            self.buffer.module_row(slot, len(values))[: len(values)].copy_(values)
            meta.module_slot, meta.module_names, meta.module_present = slot, self._modules.names, present
        fp8 = self._fp8.take(meta.step) if self._fp8.names else None
        if fp8 is not None:
            slot = sum(1 for m in self._meta if m.fp8_slot is not None)
            self.buffer.row("fp8", slot, len(fp8))[: len(fp8)].copy_(fp8)
            meta.fp8_slot, meta.fp8_layers = slot, list(self._fp8.names)

    def end_step(self, scale: torch.Tensor | None, next_scale: torch.Tensor,
                 found_inf: torch.Tensor | None = None) -> None:
        """Add the scale used and the scale after the update (and a final ``found_inf``) to the step's values
        and commit its row.

        The row is queued as tensors (``MetricBuffer.add_row``: no kernel); what changes in place later is
        copied now: the scale after the update, unless it is the very tensor the step used (no scaler
        updated it), and a tensor learning rate.  Flushes when ``flush_every`` rows are pending.
        """
        meta = self._pending
        if self._closed or meta is None:
            return
        values = self._pending_values
        if found_inf is not None:
            values[COL["found_inf"]] = found_inf
        used = scale if scale is not None else self._one
        if next_scale is not used:
            next_scale = next_scale.clone()  # one scalar copy, with a loss scaler only
        lr = self._nan if meta.lr_tensor is None else meta.lr_tensor.detach().to(
            self.buffer.device, copy=True, non_blocking=True)
        self.buffer.add_row([*values, used, next_scale, lr])
        meta.lr_tensor = None
        self._meta.append(meta)
        self._pending, self._pending_values = None, []
        if len(self._meta) >= self.flush_every:
            self.flush()

    # -- flushing ------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Steps recorded on the device and not yet flushed."""
        return len(self._meta)

    def flush(self) -> list[dict[str, Any]]:
        """Read the pending rows (one host sync), run the alarms, write the sinks; return the records."""
        metas = self._meta
        if not metas:
            return []
        sampled = {"modules": sum(1 for m in metas if m.module_slot is not None),
                   "fp8": sum(1 for m in metas if m.fp8_slot is not None)}
        steps, tables = self.buffer.read(len(metas), sampled)
        self._meta = []
        rank = current_rank()
        records = [make_record(meta, values, rank, tables) for meta, values in zip(metas, steps)]
        events: list[AlarmEvent] = []
        for rec in records:
            fired = [e for e in (m.observe(rec) for m in self.monitors) if e is not None]
            if fired:
                rec["alarms"] = [e.to_dict() for e in fired]
                events.extend(fired)
        deliver(self.sinks, records, events, rank)
        act(events, self.engine)
        return records

    @override
    def close(self) -> None:
        """Flush what is pending, close the sinks, remove the input hooks.  Idempotent."""
        if self._closed:
            return
        if hasattr(self, "_exit_hook"):
            atexit.unregister(self._exit_hook)
        try:
            self.flush()
        finally:
            self._closed = True
            for sink in list(self.sinks):
                guarded(self.sinks, sink, "close", _close, sink)
            for handle in self._watched.values():
                handle.remove()
            self._watched.clear()
            if self.engine is not None:
                self._fp8.close()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The alarms' running state (windows, streaks), so a resumed run keeps its baselines."""
        return {"alarms": [{"name": a.name, "state": m.state_dict()} for a, m in zip(self.alarms, self.monitors)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("alarms", [])
        for i, (a, m) in enumerate(zip(self.alarms, self.monitors)):
            if i < len(saved) and saved[i].get("name") == a.name:
                m.load_state_dict(saved[i]["state"])

    def __repr__(self) -> str:
        return (f"Telemetry(sinks={self.sinks!r}, flush_every={self.flush_every}, "
                f"module_absmax_every={self.module_absmax_every}, zero_grads_every={self.zero_grads_every}, "
                f"alarms={[a.name for a in self.alarms]})")


def _close(sink: Sink) -> None:
    sink.close()
