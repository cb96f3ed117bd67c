"""Build and run one script watcher on its own: a real ``RunState``, no ``Context`` (a test helper).

``watching(Cls)`` builds a fresh ``RunState`` whose failures worth a replay are recorded (the
runner replays them), builds ``Cls(state)``, installs it (with the backward events,
``dispatch_backward``) with the models service's discovery on, and restores torch on exit.  This
test folder is the user code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from ampkit._util.frames import UserFrames
from ampkit.diagnose.capture import Capture
from ampkit.diagnose.script.models import ModelWatch
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.state import Failure, RunState
from ampkit.diagnose.script.watchers.base import Watcher, dispatch_backward

W = TypeVar("W", bound=Watcher)


@dataclass
class Alone(Generic[W]):
    """One watcher with its run state and the failures it led to."""

    watcher: W
    state: RunState
    failures: list[Failure] = field(default_factory=list)

    def codes(self) -> list[str]:
        """The codes of the findings in the ledger, after the deferred reads are flushed."""
        self.state.pending.flush()
        return [f.code for f in self.state.ledger.findings()]


def run_state(forwards: list[Watcher] | None = None, failures: list[Failure] | None = None) -> RunState:
    """A fresh run state; each root forward is handed to ``forwards``, each failure appended to ``failures``."""
    frames = UserFrames([Path(__file__).parent])
    listeners = forwards if forwards is not None else []

    def on_root_forward(cap: Capture) -> None:
        for w in listeners:
            w.on_root_forward(cap)

    models = ModelWatch(on_root_forward=on_root_forward, locate=frames.caller, user_frame=frames.caller_frame)
    return RunState(frames=frames, models=models, on_failure=None if failures is None else failures.append)


@contextmanager
def watching(cls: type[W]) -> Iterator[Alone[W]]:
    """``cls`` built on a fresh run state and installed while the block runs."""
    forwards: list[Watcher] = []
    failures: list[Failure] = []
    state = run_state(forwards, failures)
    watcher = cls(state)
    forwards.append(watcher)
    patches = PatchSet()
    watcher.install(patches)
    dispatch_backward([watcher], state, patches)
    state.models.set_discovery(True)
    try:
        yield Alone(watcher, state, failures)
    finally:
        state.models.remove()
        patches.restore()
