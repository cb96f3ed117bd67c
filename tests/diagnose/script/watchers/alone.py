"""Build and run one script watcher on its own: real services, no ``Context`` (a test helper).

``watching(Cls)`` builds fresh ``Services`` around a ``WatchState`` whose step signals go to a
``Signals`` recorder (the part a ``Context`` plays), builds ``Cls`` from the services its
constructor names, installs it (with the backward events, ``dispatch_backward``) with the models
service's discovery on, and restores torch on
exit.  This test folder is the user code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from ampkit._util.frames import UserFrames
from ampkit.diagnose.capture import Capture
from ampkit.diagnose.script.models import ModelWatch
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.services import Services
from ampkit.diagnose.script.state import WatchState
from ampkit.diagnose.script.watchers import Watcher
from ampkit.diagnose.script.watchers.base import dispatch_backward

W = TypeVar("W", bound=Watcher)


@dataclass
class Signals:
    """The step signals a watcher sent, in order (``state.StepSignals``)."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def end_iteration(self) -> None:
        self.calls.append(("end_iteration",))

    def on_loss(self, it: int, nonfinite: bool) -> None:
        self.calls.append(("loss", it, nonfinite))

    def loss_made(self) -> None:
        """The loss is complete (no failure follows from it: not recorded)."""

    def on_grads(self, it: int, nonfinite: bool) -> None:
        self.calls.append(("grads", it, nonfinite))

    def on_scaler_found(self, found: torch.Tensor, scale: torch.Tensor, it: int, primary: bool,
                        urgent: bool) -> None:
        self.calls.append(("scaler_found", it, float(found), primary))


@dataclass
class Alone(Generic[W]):
    """One watcher with its services and the signals it sent."""

    watcher: W
    services: Services
    signals: Signals

    @property
    def state(self) -> WatchState:
        return self.services.state

    def codes(self) -> list[str]:
        """The codes of the findings in the ledger, after the deferred reads are flushed."""
        self.state.pending.flush()
        return [f.code for f in self.state.ledger.findings()]


def services(forwards: list[Watcher] | None = None) -> tuple[Services, Signals]:
    """Fresh services whose step signals are recorded; each root forward is handed to ``forwards``."""
    frames = UserFrames([Path(__file__).parent])
    listeners = forwards if forwards is not None else []

    def on_root_forward(cap: Capture) -> None:
        for w in listeners:
            w.on_root_forward(cap)

    models = ModelWatch(on_root_forward=on_root_forward, locate=frames.caller, user_frame=frames.caller_frame)
    signals = Signals()
    return Services.build(WatchState(frames=frames, models=models, signals=signals)), signals


@contextmanager
def watching(cls: type[W]) -> Iterator[Alone[W]]:
    """``cls`` built from fresh services and installed while the block runs."""
    forwards: list[Watcher] = []
    built, signals = services(forwards)
    watcher = cls(**built.arguments(cls))
    forwards.append(watcher)
    patches = PatchSet()
    watcher.install(patches)
    dispatch_backward([watcher], built.state, patches)
    built.state.models.set_discovery(True)
    try:
        yield Alone(watcher, built, signals)
    finally:
        built.state.models.remove()
        patches.restore()
