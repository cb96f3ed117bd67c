"""The fork watcher: a script that calls ``os.fork()`` itself (FORKED_CHILD_UNOBSERVED).

The doctor observes the process it started.  A forked child inherits its watchers but not its
report: the child's findings would only replace the parent's ``--json`` / ``--html`` with a report
of the wrong process.  So the child marks itself (``child``; ``ScriptReport.forked_child``), and
``ampkit doctor`` writes nothing for it, while the parent's report says, as an info finding, that
a child trained unobserved.  Only forks called from the script's own code count: the workers a
library forks (a ``DataLoader``, ``multiprocessing``) end with ``os._exit`` and train nothing.

``os.register_at_fork`` cannot be undone, so the process registers its two callbacks once, on
the first install, and they call the watchers installed now (``_INSTALLED``, held weakly): an
install adds its watcher there and ``PatchSet.restore`` takes it out.  A process that runs the
doctor many times (a test suite, a notebook) keeps two callbacks, not two per run.  Cost: nothing
per step; one stack walk per fork.
"""

from __future__ import annotations

import functools
import os
import sys
import types
import weakref
from dataclasses import dataclass

from typing_extensions import override

from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.state import RunState
from ampkit.diagnose.script.watchers.base import Watcher
from ampkit.findings import Finding

__all__ = ["ForkEvent", "ForkWatch"]


@dataclass(frozen=True)
class ForkEvent:
    """One ``os.fork()`` of the script."""

    location: str | None
    """The user's ``file:line`` that forked."""
    step: int
    """The optimizer step in progress when it forked, counted from 1."""


class ForkWatch(Watcher):
    """Forks of the script (``forks``, in the parent) and whether this process is such a child (``child``)."""

    def __init__(self, state: RunState) -> None:
        super().__init__(state)
        self.forks: list[ForkEvent] = []
        self.child = False
        """This process is a child the script forked: its report is not the run's."""

    @override
    def install(self, patches: PatchSet) -> None:
        if not hasattr(os, "register_at_fork"):
            return  # no fork on this platform
        _register_once()
        ref = weakref.ref(self)
        _INSTALLED.append(ref)
        patches.on_restore(lambda: _INSTALLED.remove(ref))

    def _after_fork(self, *, in_parent: bool) -> None:
        if not in_parent:
            self.child = True  # whoever forked: a child never writes the parent's report
            return
        caller = _fork_caller()
        if caller is None or not self.state.frames.is_user(caller.f_code.co_filename):
            return  # a library's worker process
        self.forks.append(ForkEvent(self.state.frames.caller(), self.state.step))

    @override
    def finish(self) -> None:
        if self.child or not self.forks:
            return
        first, n = self.forks[0], len(self.forks)
        forked = (f"a child process at {first.location} (step {first.step})" if n == 1 else
                  f"{n} child processes (the first at {first.location}, step {first.step})")
        self.state.ledger.add(Finding(
            code="FORKED_CHILD_UNOBSERVED", severity="info", location=first.location, step=first.step,
            message=(f"the script forked {forked}: ampkit doctor observes only the process it started, so what "
                     f"{'the child trains' if n == 1 else 'the children train'} is not diagnosed and writes no "
                     "report; this report is the parent's"),
            fix=("to diagnose a child's training, run it in a process of its own under the doctor (a script that "
                 "calls the child's training function), or run that work in the parent"),
            evidence={"forks": len(self.forks), "locations": [f.location for f in self.forks[:8]]},
        ), key="fork")


_INSTALLED: list[weakref.ReferenceType[ForkWatch]] = []
"""The fork watchers installed now (in install order); the at-fork callbacks call each."""


@functools.cache
def _register_once() -> None:
    """Register the process's at-fork callbacks (the first call only: they cannot be unregistered)."""
    os.register_at_fork(after_in_parent=lambda: _call_installed(in_parent=True),
                        after_in_child=lambda: _call_installed(in_parent=False))


def _call_installed(*, in_parent: bool) -> None:
    for ref in list(_INSTALLED):
        watch = ref()
        if watch is not None:
            watch._after_fork(in_parent=in_parent)


def _fork_caller() -> types.FrameType | None:
    """The frame that called ``os.fork()`` (the at-fork callbacks run right on top of it)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame
