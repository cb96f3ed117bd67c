"""The script doctor's run state: one dataclass, ``RunState``, with everything the watchers, the
failure detection (``script.failures``), the end-of-run rules and the runner share.

Each watcher is built with the one ``RunState`` and reads and writes its fields: the step counters,
the findings ledger, the deferred device reads, the sampler, the user-frame classifier, the models
service (the user's models and the captured forwards of the current optimizer window), the services
(scalers, optimizers, autocast regions, cast sites, frameworks) and the failure records.  A step
event (an optimizer step, a loss or a ``found_inf`` read back) is a call of ``script.failures`` with
the state; nothing calls back into the ``Context``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ampkit._util.frames import UserFrames
from ampkit._util.host import DeferredReads
from ampkit._util.threads import PerThread, thread_values
from ampkit.diagnose.capture import Capture
from ampkit.diagnose.script.ledger import Ledger
from ampkit.diagnose.script.losstrace import LossSideTrace, LossTapes
from ampkit.diagnose.script.models import ModelWatch
from ampkit.diagnose.script.services.autocast import AutocastRegions
from ampkit.diagnose.script.services.casts import CastSites
from ampkit.diagnose.script.services.frameworks import Frameworks
from ampkit.diagnose.script.services.optimizers import OptimizerRegistry
from ampkit.diagnose.script.services.scalers import ScalerRegistry
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["Failure", "FailureCause", "FailureKind", "Forwards", "RunState", "Sampler", "SkipCause"]


class Sampler:
    """Which iterations are observed densely.

    >>> s = Sampler(warmup=2, period=10, after_event=3)
    >>> [i for i in range(25) if s.dense(i)]
    [0, 1, 10, 20]
    >>> s.boost(13); [i for i in range(12, 18) if s.dense(i)]
    [13, 14, 15, 16]
    """

    def __init__(self, warmup: int = 4, period: int = 32, after_event: int = 4) -> None:
        self.warmup, self.period, self.after_event = warmup, period, after_event
        self._boosts: list[tuple[int, int]] = []

    def dense(self, it: int) -> bool:
        return it < self.warmup or it % self.period == 0 or any(a <= it <= b for a, b in self._boosts)

    def boost(self, it: int) -> None:
        """Observe ``it`` and the ``after_event`` iterations after it densely."""
        if self._boosts and self._boosts[-1][0] <= it <= self._boosts[-1][1] + 1:
            self._boosts[-1] = (self._boosts[-1][0], max(self._boosts[-1][1], it + self.after_event))
        else:
            self._boosts.append((it, it + self.after_event))


FailureKind = Literal["skip", "nonfinite_loss", "nonfinite_grads"]
"""How a step failed: the GradScaler skipped it, its loss was non-finite with no scaler, or its gradients were
non-finite at a step no scaler guards."""

FailureCause = Literal["nonfinite_data", "nonfinite_loss", "scaled_loss_overflow", "gradient_overflow"]
"""Why, as judged when the step fails (before any replay)."""

SkipCause = FailureCause | Literal["nonfinite_forward", "gradient_singularity"]
"""A skipped step's cause: a ``FailureCause``, or what a replay showed instead (``failures.reclassify``).
Each is a key of ``findings.SCALE_COLLAPSE_CAUSES``, which explains it in SCALE_COLLAPSE."""


@dataclass
class Failure:
    """A step that went wrong, with what is needed to replay it."""

    kind: FailureKind
    """``skip`` (the GradScaler skipped the step), ``nonfinite_loss`` or ``nonfinite_grads`` (at a step no
    scaler guards)."""
    step: int
    """The optimizer step that failed, counted from 1 (``RunState.step``)."""
    cause: FailureCause
    """``nonfinite_data``, ``nonfinite_loss``, ``scaled_loss_overflow`` or ``gradient_overflow``; a replay may
    correct it (``failures.reclassify``) to ``nonfinite_forward`` or ``gradient_singularity``."""
    captures: list[Capture]
    scale: float | None = None


@dataclass
class Forwards:
    """What the root forwards of the run ran in, counted as they return (``count``)."""

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

    def count(self, cap: Capture, regions: AutocastRegions) -> None:
        self.total += 1
        self.devices.add(cap.device.type)
        thread = threading.current_thread().name
        if cap.autocast_enabled:
            self.autocast[cap.autocast_dtype] += 1
            self.autocast_threads.add(thread)
        elif cap.param_dtype in LOW_PRECISION_DTYPES:
            self.half_params[cap.param_dtype] += 1
        elif not cap.other_autocast and (holder := regions.enabled_elsewhere()) is not None:
            n, holder_name, where, line = self.outside_threads.get(thread, (0, *holder, cap.location))
            self.outside_threads[thread] = (n + 1, holder_name, where, line)
        for other in cap.other_autocast:
            key = (other, cap.device.type)
            self.wrong_device[key] = self.wrong_device.get(key, 0) + 1


@dataclass(eq=False)
class RunState:
    """Everything the script doctor's watchers, failure detection, rules and runner share.

    A script may train in several threads (each with its own model and optimizer): the step
    counter is per thread (``iteration``, ``step``), ``steps`` counts the optimizer steps of all
    threads, and the ledger takes findings from any thread.
    """

    frames: UserFrames
    """Tells the script's code from library code; ``caller()`` is the user's ``file:line``."""
    models: ModelWatch
    """The user's models and the captured forwards of the current optimizer window; ``models.paused`` is
    True while the doctor runs models itself (replays): the watchers observe nothing then."""
    sampler: Sampler = field(default_factory=Sampler)
    on_failure: Callable[[Failure], None] | None = None
    """Called with each failure worth a replay, while the model still holds that step's weights."""
    on_step: Callable[[list[Capture]], None] | None = None
    """Called as each optimizer step of a primary optimizer ends (``failures.end_iteration``), with the
    captured forwards of that step, after the step's bookkeeping: it may raise to stop the script there
    (preflight's step capture, ``script.first_steps``)."""
    ledger: Ledger = field(default_factory=Ledger)
    pending: DeferredReads = field(default_factory=DeferredReads)
    optimizers: OptimizerRegistry = field(default_factory=OptimizerRegistry)
    """The script's optimizers and each thread's primary one."""
    scalers: ScalerRegistry = field(default_factory=ScalerRegistry)
    """The loss scalers (GradScalers, ampkit engines) and their update window."""
    regions: AutocastRegions = field(default_factory=AutocastRegions)
    """The autocast region each thread is in."""
    casts: CastSites = field(default_factory=CastSites)
    """Where parameters became fp16/bf16."""
    frameworks: Frameworks = field(default_factory=Frameworks)
    """The training frameworks the script drives and the precision asked of them."""
    iteration = PerThread(int)
    """This thread's optimizer steps of its primary optimizer so far (skipped ones included): a count,
    0-based where it indexes (the ``Sampler``); findings, messages and the sets below use ``step``."""
    step = PerThread(lambda: 1)
    """The optimizer step in progress, counted from 1 (``iteration + 1``, kept beside it so that the
    hooks read it with no Python frame): step N is the N-th optimizer step, the number telemetry's
    records and the engine's ``StepResult.optimizer_step`` give it too."""
    steps: int = 0
    """Optimizer steps of the primary optimizers of all threads so far (``count_step``)."""
    forwards: Forwards = field(default_factory=Forwards)
    locations: dict[str, str | None] = field(default_factory=dict)
    """The first user line of a kind of event (``scheduler_step``, ``boundary_overflow`` ...)."""
    loss_nonfinite: set[int] = field(default_factory=set)
    """Steps whose loss was non-finite."""
    skips: dict[int, SkipCause] = field(default_factory=dict)
    """Skipped step -> its cause."""
    cause_of: dict[SkipCause, SkipCause] = field(default_factory=dict)
    """Cause corrections learnt from replays, applied to the other skipped steps at the end."""
    boundary_overflows: list[int] = field(default_factory=list)
    """Skipped steps whose gradient was already non-finite where it reached the model outputs."""
    norm_bad: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    """module name -> (first step seen, non-finite count, seen right after a skipped step)."""
    corrupted_by: tuple[str, Any, int] | None = None
    """(code, key, step) of the finding whose NaN gradients an unguarded step applied (later NaN inputs fold in)."""
    explained: BaseException | None = None
    """The last exception a watcher explained in the ledger (the runner explains a crash that is not it).  A
    strong reference, held until the next one or the run's end: torch raises built-in exceptions, which take
    no weak reference (so no ``WeakIdentityMap``), and the doctor writes nothing on the user's objects."""
    tapes: LossTapes = field(init=False)
    """Each iteration's own loss-side calls, recorded from the end of a root forward to the loss's scaling."""
    loss_trace: LossSideTrace | None = None
    loss_trace_report: Callable[[LossSideTrace | None], None] | None = None
    loss_trace_scale: float | None = None

    def __post_init__(self) -> None:
        self._count_lock = threading.Lock()
        self.tapes = LossTapes(self.frames, lambda: self.models.paused or self.models.in_forward)

    def count_step(self) -> None:
        """This thread's primary optimizer stepped (or was skipped)."""
        mine = thread_values(self)  # per-step: writes with no Python frame
        mine.iteration += 1
        mine.step = mine.iteration + 1
        with self._count_lock:  # += on a shared attribute is not atomic across threads
            self.steps += 1

    def note_location(self, what: str, location: str | None) -> None:
        self.locations.setdefault(what, location)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Observe nothing while the doctor runs models itself (replays, checkups)."""
        before = self.models.paused
        self.models.paused = True
        try:
            yield
        finally:
            self.models.paused = before
