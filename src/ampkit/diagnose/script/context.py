"""All script watchers behind one ``Context``: install, observe, detect failures, restore.

``Context`` builds the services the watchers share (``script.services.Services``: the
``state.WatchState`` with the iteration counter, the findings ledger, the deferred reads and the
sampler; the scaler and optimizer registries, the autocast regions, the cast sites), then one
watcher of each class in ``watchers.WATCHERS``, each given the services its constructor names.
It turns two signals into failures worth a replay: a step the GradScaler skipped, and a
non-finite loss.

Sampling (what keeps an unproblematic script within 1.5x of its plain run time): the first
``Sampler.warmup`` iterations, every ``Sampler.period``-th one, and a few after any failure are
*dense*: global module hooks discover models, parameter dtypes and normalisation statistics are
checked, and deferred device reads are flushed.  The other iterations pay only for the wrappers
(a few Python calls per step) and the root-model hooks (two hook calls per forward).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Generic, TypeVar

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ampkit._util.dtypes import dtype_name
from ampkit._util.frames import UserFrames
from ampkit._util.overrides import overrides
from ampkit._util.threads import thread_values
from ampkit.diagnose.capture import Capture
from ampkit.diagnose.script.lossgrad import LossGrads
from ampkit.diagnose.script.losstrace import (
    HIDDEN_LOSS_CODE,
    FirstBad,
    LossSideTrace,
    LossTapes,
    hidden_code_text,
    loss_code_text,
)
from ampkit.diagnose.script.models import ModelWatch
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.services import ScalerRegistry, Services
from ampkit.diagnose.script.state import Sampler, WatchState
from ampkit.diagnose.script.watchers import WATCHERS, Watcher
from ampkit.diagnose.script.watchers.autocast import AutocastWatch
from ampkit.diagnose.script.watchers.base import dispatch_backward
from ampkit.diagnose.script.watchers.casts import CastWatch
from ampkit.diagnose.script.watchers.compile import CompileWatch
from ampkit.diagnose.script.watchers.fork import ForkWatch
from ampkit.diagnose.script.watchers.frameworks import FrameworkWatch
from ampkit.diagnose.script.watchers.io import CheckpointWatch
from ampkit.diagnose.script.watchers.optim import OptimWatch
from ampkit.diagnose.step.compiled import COMPILE_HOOK_WARNING
from ampkit.findings import nonfinite_input

__all__ = ["Context", "Failure"]

W = TypeVar("W", bound=Watcher)


@dataclass
class Failure:
    """A step that went wrong, with what is needed to replay it."""

    kind: str
    """``skip`` (the GradScaler skipped the step) or ``nonfinite_loss``."""
    step: int
    """The optimizer step that failed, counted from 1 (``WatchState.step``)."""
    cause: str
    """``nonfinite_data``, ``nonfinite_loss``, ``scaled_loss_overflow`` or ``gradient_overflow``."""
    captures: list[Capture]
    scale: float | None = None


@dataclass
class _Forwards:
    total: int = 0
    autocast: Counter[torch.dtype] = field(default_factory=Counter)
    half_params: Counter[torch.dtype] = field(default_factory=Counter)
    wrong_device: dict[tuple[str, str], int] = field(default_factory=dict)
    devices: set[str] = field(default_factory=set)
    autocast_threads: set[str] = field(default_factory=set)
    """Threads that ran a forward under autocast."""
    outside_threads: dict[str, tuple[int, str, str | None, str | None]] = field(default_factory=dict)
    """Thread -> (forwards, the thread that was in autocast then, its autocast line, the first forward's
    line): fp32 forwards while another thread was inside an enabled autocast block."""


class _WatcherOf(Generic[W]):
    """``ctx.<name>``: the context's watcher of class ``cls`` (the names the rules and the runner read)."""

    def __init__(self, cls: type[W]) -> None:
        self.cls = cls

    def __get__(self, ctx: Context, owner: type | None = None) -> W:
        return ctx.watcher(self.cls)


class Context:
    """Shared observer state.  ``install(patches)`` hooks torch; ``patches.restore()`` undoes it."""

    def __init__(self, code: UserFrames, *, on_failure: Callable[[Failure], None] | None = None,
                 sampler: Sampler | None = None) -> None:
        self.on_failure = on_failure
        self._lock = threading.Lock()
        models = ModelWatch(on_root_forward=self._on_root_forward, on_root_enter=lambda: self.tapes.pause(),
                           locate=code.caller, user_frame=code.caller_frame)
        self.state = WatchState(frames=code, models=models, signals=self, sampler=sampler or Sampler())
        self.services = Services.build(self.state)
        self.watchers: list[Watcher] = [cls(**self.services.arguments(cls)) for cls in WATCHERS]
        """One of each registered watcher, in ``WATCHERS`` order."""
        self._by_class: dict[type[Watcher], Watcher] = {type(w): w for w in self.watchers}
        self._forward_watchers = [w for w in self.watchers if overrides(w, Watcher, "on_root_forward")]
        """The watchers called on every forward (the others' no-op would cost a call each)."""
        self.forwards = _Forwards()
        self.skips: dict[int, str] = {}
        self.cause_of: dict[str, str] = {}
        """Cause corrections learnt from replays, applied to the other skipped steps at the end."""
        self.applied_scaled = 0
        self.boundary_overflows: list[int] = []
        """Skipped steps whose gradient was already non-finite where it reached the model outputs."""
        self.nonfinite_grad_steps: list[int] = []
        """Steps whose gradients were non-finite at an optimizer step no scaler guarded."""
        self.norm_bad: dict[str, tuple[int, int, bool]] = {}
        """module name -> (first step seen, non-finite count, seen right after a skipped step)."""
        self._loss_trace: LossSideTrace | None = None
        self._loss_trace_report: Callable[[LossSideTrace | None], None] | None = None
        self._loss_trace_scale: float | None = None
        self.corrupted_by: tuple[str, Any, int] | None = None
        """(code, key, step) of the finding whose NaN gradients an unguarded step applied (later NaN inputs fold in)."""
        self.tapes = LossTapes(code, lambda: self.state.paused or self.models.in_forward)

    # The watchers and the shared state, under the names the rules and the runner read.
    autocast = _WatcherOf(AutocastWatch)
    casts = _WatcherOf(CastWatch)
    frameworks = _WatcherOf(FrameworkWatch)
    optim = _WatcherOf(OptimWatch)
    checkpoints = _WatcherOf(CheckpointWatch)
    compiles = _WatcherOf(CompileWatch)
    forks = _WatcherOf(ForkWatch)
    code = property(lambda self: self.state.frames)
    models = property(lambda self: self.state.models)
    ledger = property(lambda self: self.state.ledger)
    pending = property(lambda self: self.state.pending)
    sampler = property(lambda self: self.state.sampler)
    loss_nonfinite = property(lambda self: self.state.loss_nonfinite)
    locations = property(lambda self: self.state.locations)

    @property
    def scalers(self) -> ScalerRegistry:
        """The loss scalers of the run (``services.scalers``)."""
        return self.services.scalers

    def watcher(self, cls: type[W]) -> W:
        """The context's watcher of class ``cls``.

        Raises:
            LookupError: ``cls`` is not in ``watchers.WATCHERS``.
        """
        watcher = self._by_class.get(cls)
        if isinstance(watcher, cls):
            return watcher
        raise LookupError(f"no {cls.__qualname__} among the watchers; register it in watchers.WATCHERS")

    @property
    def iteration(self) -> int:
        return self.state.iteration

    # Read by every hook: an attrgetter property runs no Python frame.
    step = property(attrgetter("state.step"), doc="This thread's optimizer step in progress (``WatchState.step``).")

    @property
    def steps(self) -> int:
        """Optimizer steps of all threads (``WatchState.steps``)."""
        return self.state.steps

    paused = property(attrgetter("state.models.paused"), doc="``WatchState.paused``.")

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Observe nothing while the doctor runs models itself (replays, checkups)."""
        before = self.models.paused
        self.models.paused = True
        try:
            yield
        finally:
            self.models.paused = before

    def install(self, patches: PatchSet) -> None:
        for watch in self.watchers:
            watch.install(patches)
        dispatch_backward(self.watchers, self.state, patches)
        patches.on_restore(register_optimizer_step_pre_hook(self.loss_made).remove)
        self.models.set_discovery(True)
        patches.on_restore(self.models.remove)
        # torch.compile warns about global module hooks; the doctor's are no-ops inside compiled code.
        warnings.filterwarnings("ignore", message=COMPILE_HOOK_WARNING)
        entry = warnings.filters[0]
        patches.on_restore(lambda: _drop_filter(entry))

    def finish(self) -> None:
        """The run ended: each watcher adds its end-of-run findings (after the pending reads are flushed)."""
        self._close_loss_trace(final=True)
        self.tapes.end()
        for watch in self.watchers:
            watch.finish()

    # -- the loss-side trace (``script.losstrace``) -------------------------------------------------
    def arm_loss_trace(self, report: Callable[[LossSideTrace | None], None], *,
                       grads_at_scale: float | None = None) -> None:
        """Trace the next iteration from the end of a root forward (it records up to the loss's backward,
        and is closed at the end of the step); ``report`` gets the trace (its ``first`` op that made a
        finite value inf/NaN), or None when no iteration was traced.  ``grads_at_scale``: also follow the
        loss-side ops' backward (``script.lossgrad``), run at that loss scale."""
        if self._loss_trace_report is None:
            self._loss_trace_report = report
            self._loss_trace_scale = grads_at_scale

    def _open_loss_trace(self) -> None:
        if self._loss_trace_report is not None and self._loss_trace is None and not self.state.paused:
            scale = self._loss_trace_scale
            self._loss_trace = LossSideTrace(self.code, lambda: self.state.paused,
                                             grads=None if scale is None else LossGrads(scale))
            self._loss_trace.__enter__()

    def _close_loss_trace(self, *, final: bool) -> None:
        trace, report = self._loss_trace, self._loss_trace_report
        if trace is not None and trace.thread == threading.get_ident():
            trace.__exit__(None, None, None)
            self._loss_trace = self._loss_trace_report = None
            assert report is not None
            report(trace)
        elif final and report is not None:
            self._loss_trace_report = None
            report(None)

    def loss_made(self, *_: Any) -> None:
        self.tapes.stop()

    def loss_tape_first(self, step: int) -> FirstBad | None:
        return self.tapes.first_bad(step)

    def taped_loss_code(self, label: str, became: str, step: int) -> bool:
        """Report the op of ``step``'s own loss-side calls that made its non-finite loss; False without one."""
        first = self.loss_tape_first(step)
        if first is not None:
            self.ledger.add("FORWARD_NAN" if first.nan else "FORWARD_OVERFLOW", key=("loss-code", label), op=first.op,
                            step=step, location=first.location,
                            **loss_code_text(first, label, became, step, recorded=True))
        return first is not None

    def hidden_loss_code(self, label: str, failure: Failure) -> bool:
        """Report the op of the failing step's own loss-side calls that made an inf/NaN the loss hid (a where,
        a clip) and the backward met (0 * inf): the root of a gradient overflow with a finite loss."""
        first = self.loss_tape_first(failure.step)
        if first is None:
            return False
        code = "FORWARD_NAN" if first.nan else "FORWARD_OVERFLOW"
        self.ledger.add(code, key=HIDDEN_LOSS_CODE, op=first.op, step=failure.step, location=first.location,
                        **hidden_code_text(first, label, failure.step))
        if failure.kind == "nonfinite_grads" and self.corrupted_by is None:
            self.corrupted_by = (code, HIDDEN_LOSS_CODE, failure.step)  # the unguarded step applied them
        return True

    def note_location(self, what: str, location: str | None) -> None:
        self.state.note_location(what, location)

    # -- events -----------------------------------------------------------------------------
    def _on_root_forward(self, cap: Capture) -> None:
        with self._lock:  # forwards of several threads: the counters must not lose an increment
            self._count_forward(cap)
        self._open_loss_trace()
        if self._loss_trace is None and not self.state.paused:  # the traced iteration has its trace
            self.tapes.resume(self.step, cap.low_precision is not None)
        for watch in self._forward_watchers:
            watch.on_root_forward(cap)

    def _count_forward(self, cap: Capture) -> None:
        f = self.forwards
        f.total += 1
        f.devices.add(cap.device.type)
        thread = threading.current_thread().name
        if cap.autocast_enabled:
            f.autocast[cap.autocast_dtype] += 1
            f.autocast_threads.add(thread)
        elif cap.param_dtype in (torch.float16, torch.bfloat16):
            f.half_params[cap.param_dtype] += 1
        elif not cap.other_autocast and (holder := self.services.regions.enabled_elsewhere()) is not None:
            n, holder_name, where, line = f.outside_threads.get(thread, (0, *holder, cap.location))
            f.outside_threads[thread] = (n + 1, holder_name, where, line)
        for other in cap.other_autocast:
            key = (other, cap.device.type)
            f.wrong_device[key] = f.wrong_device.get(key, 0) + 1

    def end_iteration(self) -> None:
        """The primary optimizer stepped (or was skipped): a new iteration begins."""
        self._close_loss_trace(final=False)
        self.tapes.end()
        self.state.count_step()
        thread_values(self.models).step = self.step  # per-step: a write with no Python frame
        self.models.new_window()
        dense = self.sampler.dense(self.iteration)
        self.models.set_discovery(dense)
        if dense:
            self.models.refresh_roots()
            self.check_norm_stats()
            self.pending.flush()

    def on_loss(self, it: int, nonfinite: bool) -> None:
        if not nonfinite:
            return
        self.loss_nonfinite.add(it)
        scaled = any(c.scale is not None for c in self.models.captures)
        if self._consequence(it):
            return
        if not scaled and it == self.step:
            cause = "nonfinite_data" if self._inputs_nonfinite(self.models.captures, it) else "nonfinite_loss"
            self._fail(Failure("nonfinite_loss", it, cause, list(self.models.captures)))

    def on_grads(self, it: int, nonfinite: bool) -> None:
        """Non-finite gradients at an unguarded optimizer step (the weights are about to be corrupted)."""
        if not nonfinite or it != self.step:
            return
        self.nonfinite_grad_steps.append(it)
        if self._consequence(it):
            return
        cause = "nonfinite_data" if self._inputs_nonfinite(self.models.captures, it) else "gradient_overflow"
        self._fail(Failure("nonfinite_grads", it, cause, list(self.models.captures)))

    def on_scaler_found(self, found: torch.Tensor, scale: torch.Tensor, it: int, primary: bool,
                        urgent: bool) -> None:
        caps = list(self.models.captures)

        def judge(v: float) -> None:
            if v <= 0:
                if primary:
                    self.applied_scaled += 1
                return
            if not primary and it in self.skips:
                return
            live = it == self.step
            cause = self._classify(caps if live else [], it)
            self.skips[it] = cause
            if live:
                self.check_norm_stats(after_skip=True)
                self._fail(Failure("skip", it, cause, caps, float(scale)))
        if urgent:
            judge(float(found))
        else:
            self.pending.read(found, judge)

    def _consequence(self, it: int) -> bool:
        """Whether a failure at step ``it`` follows from weights an earlier unguarded step made non-finite
        (``corrupted_by``): its non-finite inputs are folded into that finding, and it is not diagnosed again."""
        if self.corrupted_by is None or it <= self.corrupted_by[2]:
            return False
        self._inputs_nonfinite(self.models.captures, it)
        return True

    def reclassify(self, it: int, cause: str) -> None:
        """A replay showed what really made step ``it`` fail (e.g. a forward overflow behind a finite loss)."""
        if it in self.skips:
            old = self.skips[it]
            self.cause_of[old] = cause
            self.skips[it] = cause

    def _classify(self, caps: list[Capture], it: int) -> str:
        if self._inputs_nonfinite(caps, it):
            return "nonfinite_data"
        if it in self.scalers.penalty_overflow:
            return "gradient_overflow"  # a loss made of gradients that overflowed at this scale
        if any(c.loss is not None and not bool(torch.isfinite(c.loss).all()) for c in caps):
            self.loss_nonfinite.add(it)  # read here, on the failure path, for scaled losses
        if it in self.loss_nonfinite:
            return "nonfinite_loss"
        if it in self.scalers.scaled_overflow:
            return "scaled_loss_overflow"
        return "gradient_overflow"

    def _inputs_nonfinite(self, caps: list[Capture], it: int) -> bool:
        """NONFINITE_INPUT: non-finite values in a captured batch (a host read; failure path only)."""
        bad = False
        for cap in caps:
            for i, x in enumerate(cap.float_inputs()):
                rows = (~torch.isfinite(x.detach())).reshape(x.shape[0], -1).any(1) if x.dim() else \
                    (~torch.isfinite(x.detach())).reshape(1)
                idx = rows.nonzero().flatten().tolist()
                if not idx:
                    continue
                bad = True
                model = self.models.label(cap.root)
                root = self.corrupted_by
                if root is not None and it > root[2] and self.ledger.fold(
                        root[0], root[1], {"code": "NONFINITE_INPUT", "step": it, "model": model, "input": i,
                                           "samples": len(idx)}):
                    continue  # computed by a model whose weights that step made NaN: not the data's fault
                message, fix = nonfinite_input(
                    f"input #{i} of {model} ({tuple(x.shape)}, {dtype_name(x.dtype)}) holds NaN/inf in {len(idx)} "
                    f"of {rows.numel()} samples (indices {idx[:8]}{' ...' if len(idx) > 8 else ''}) at step {it}, "
                    "before any low-precision op runs")
                self.ledger.add(
                    "NONFINITE_INPUT", key=("input", model, i), message=message, fix=fix,
                    location=cap.location, step=it,
                    evidence={"input": i, "samples": idx[:32], "batch_size": int(rows.numel())},
                )
        return bad

    def check_norm_stats(self, after_skip: bool = False) -> None:
        names = self.models.named_modules()
        it = self.step
        for mod, bad in self.models.norm_stats():
            name = names.get(id(mod), type(mod).__name__)

            def judge(v: float, name: str = name) -> None:
                if v > 0 and name not in self.norm_bad:
                    self.norm_bad[name] = (it, int(v), after_skip)
            self.pending.read(bad, judge)

    def _fail(self, failure: Failure) -> None:
        self.sampler.boost(failure.step - 1)  # the Sampler counts from 0
        if self.on_failure is not None:
            self.on_failure(failure)


def _drop_filter(entry: Any) -> None:
    filters: list[Any] = warnings.filters  # type: ignore[assignment]
    if entry in filters:
        filters.remove(entry)
        warnings._filters_mutated()  # type: ignore[attr-defined]
