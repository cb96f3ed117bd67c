"""What the script watchers share: a small state object, not the whole context.

Each watcher reads and writes ``WatchState`` (the iteration counter, the findings ledger, the
deferred device reads, the sampler, the user-frame classifier and the model watcher's
captures) and reports step events back through ``StepSignals``, which ``Context`` implements.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

import torch

from ampkit._util.frames import UserFrames
from ampkit._util.host import DeferredReads
from ampkit._util.threads import PerThread, thread_values
from ampkit.diagnose.script.ledger import Ledger
from ampkit.diagnose.script.models import ModelWatch

__all__ = ["Sampler", "StepSignals", "WatchState"]


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


class StepSignals(Protocol):
    """The step events the watchers report (``Context`` turns them into failures worth a replay)."""

    def end_iteration(self) -> None:
        """The primary optimizer stepped (or was skipped): a new iteration begins."""

    def on_loss(self, it: int, nonfinite: bool) -> None:
        """The loss of iteration ``it`` was read back."""

    def loss_made(self) -> None:
        """The loss is complete: it is being scaled for its backward."""

    def on_grads(self, it: int, nonfinite: bool) -> None:
        """The gradients at an optimizer step no GradScaler guards were read back."""

    def on_scaler_found(self, found: torch.Tensor, scale: torch.Tensor, it: int, primary: bool,
                        urgent: bool) -> None:
        """A GradScaler step produced ``found_inf`` for iteration ``it``."""


@dataclass
class WatchState:
    """The state every watcher shares.

    A script may train in several threads (each with its own model and optimizer): the step
    counter is per thread (``iteration``, ``step``), ``steps`` counts the optimizer steps of all
    threads, and the ledger takes findings from any thread.
    """

    frames: UserFrames
    """Tells the script's code from library code; ``caller()`` is the user's ``file:line``."""
    models: ModelWatch
    """The user's models and the captured forwards of the current optimizer window."""
    signals: StepSignals
    ledger: Ledger = field(default_factory=Ledger)
    pending: DeferredReads = field(default_factory=DeferredReads)
    sampler: Sampler = field(default_factory=Sampler)
    iteration = PerThread(int)
    """This thread's optimizer steps of its primary optimizer so far (skipped ones included): a count,
    0-based where it indexes (the ``Sampler``); findings, messages and the sets below use ``step``."""
    step = PerThread(lambda: 1)
    """The optimizer step in progress, counted from 1 (``iteration + 1``, kept beside it so that the
    hooks read it with no Python frame): step N is the N-th optimizer step, the number telemetry's
    records and the engine's ``StepResult.optimizer_step`` give it too."""
    steps: int = 0
    """Optimizer steps of the primary optimizers of all threads so far (``count_step``)."""
    loss_nonfinite: set[int] = field(default_factory=set)
    """Steps whose loss was non-finite."""
    locations: dict[str, str | None] = field(default_factory=dict)
    """The first user line of a kind of event (``scheduler_step``, ``boundary_overflow`` ...)."""

    def __post_init__(self) -> None:
        self._count_lock = threading.Lock()

    def count_step(self) -> None:
        """This thread's primary optimizer stepped (or was skipped)."""
        mine = thread_values(self)  # per-step: writes with no Python frame
        mine.iteration += 1
        mine.step = mine.iteration + 1
        with self._count_lock:  # += on a shared attribute is not atomic across threads
            self.steps += 1

    # Read by every hook: an attrgetter property runs no Python frame.
    paused = property(attrgetter("models.paused"),
                      doc="True while the doctor runs models itself (replays): the watchers observe nothing.")

    def note_location(self, what: str, location: str | None) -> None:
        self.locations.setdefault(what, location)
