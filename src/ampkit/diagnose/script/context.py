"""All script watchers behind one ``Context``: the run state, the watchers, install and finish.

``Context`` builds the ``RunState`` (``script.state``: the models service, the services, the
ledger, the counters), then each watcher with it, in a literal list whose order is the install
order (it matters only where two watchers hook the same event: the scaler watcher's optimizer
pre-step hook runs before the optimizer watcher's, so that a direct ``optimizer.step()`` is
reported before that step's gradients are checked, a check that may replay the step).  The
watchers report step events to ``script.failures``, which hands failures worth a replay to
``on_failure``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from ampkit._util.frames import UserFrames
from ampkit._util.overrides import overrides
from ampkit.diagnose.capture import Capture
from ampkit.diagnose.script import failures
from ampkit.diagnose.script.models import ModelWatch
from ampkit.diagnose.script.patches import PatchSet
from ampkit.diagnose.script.state import Failure, RunState, Sampler
from ampkit.diagnose.script.watchers.autocast import AutocastWatch
from ampkit.diagnose.script.watchers.backward import BackwardWatch
from ampkit.diagnose.script.watchers.base import Watcher, dispatch_backward
from ampkit.diagnose.script.watchers.casts import CastWatch
from ampkit.diagnose.script.watchers.compile import CompileWatch
from ampkit.diagnose.script.watchers.engine import EngineWatch
from ampkit.diagnose.script.watchers.fork import ForkWatch
from ampkit.diagnose.script.watchers.frameworks import FrameworkWatch
from ampkit.diagnose.script.watchers.io import CheckpointWatch
from ampkit.diagnose.script.watchers.optim import OptimWatch
from ampkit.diagnose.script.watchers.penalty import GradPenaltyWatch
from ampkit.diagnose.script.watchers.scaler import ScalerWatch
from ampkit.diagnose.step.compiled import COMPILE_HOOK_WARNING

__all__ = ["Context"]


class Context:
    """The run state and one of each watcher.  ``install(patches)`` hooks torch; ``patches.restore()`` undoes it."""

    def __init__(self, code: UserFrames, *, on_failure: Callable[[Failure], None] | None = None,
                 sampler: Sampler | None = None, on_step: Callable[[list[Capture]], None] | None = None) -> None:
        self._lock = threading.Lock()
        models = ModelWatch(on_root_forward=self._on_root_forward, on_root_enter=lambda: self.state.tapes.pause(),
                            locate=code.caller, user_frame=code.caller_frame)
        self.state = RunState(frames=code, models=models, sampler=sampler or Sampler(), on_failure=on_failure,
                              on_step=on_step)
        state = self.state
        # The watchers whose records the rules and the runner read, by name; the list is the install order.
        self.autocast = AutocastWatch(state)
        self.casts = CastWatch(state)
        self.optim = OptimWatch(state)
        self.compiles = CompileWatch(state)
        self.forks = ForkWatch(state)
        self.watchers: list[Watcher] = [
            self.autocast, self.casts, FrameworkWatch(state), ScalerWatch(state), self.optim, BackwardWatch(state),
            GradPenaltyWatch(state), CheckpointWatch(state), self.compiles, EngineWatch(state), self.forks,
        ]
        self._forward_watchers = [w for w in self.watchers if overrides(w, Watcher, "on_root_forward")]
        """The watchers called on every forward (the others' no-op would cost a call each)."""

    def install(self, patches: PatchSet) -> None:
        for watch in self.watchers:
            watch.install(patches)
        dispatch_backward(self.watchers, self.state, patches)
        tapes = self.state.tapes
        patches.on_restore(register_optimizer_step_pre_hook(lambda *_: tapes.stop()).remove)
        models = self.state.models
        models.set_discovery(True)
        patches.on_restore(models.remove)
        # torch.compile warns about global module hooks; the doctor's are no-ops inside compiled code.
        warnings.filterwarnings("ignore", message=COMPILE_HOOK_WARNING)
        entry = warnings.filters[0]
        patches.on_restore(lambda: _drop_filter(entry))

    def finish(self) -> None:
        """The run ended: each watcher adds its end-of-run findings (after the pending reads are flushed)."""
        failures.close_loss_trace(self.state, final=True)
        self.state.tapes.end()
        for watch in self.watchers:
            watch.finish()

    def _on_root_forward(self, cap: Capture) -> None:
        state = self.state
        with self._lock:  # forwards of several threads: the counters must not lose an increment
            state.forwards.count(cap, state.regions)
        failures.open_loss_trace(state)
        if state.loss_trace is None and not state.models.paused:  # the traced iteration has its trace
            state.tapes.resume(state.step, cap.low_precision is not None)
        for watch in self._forward_watchers:
            watch.on_root_forward(cap)


def _drop_filter(entry: Any) -> None:
    filters: list[Any] = warnings.filters  # type: ignore[assignment]
    if entry in filters:
        filters.remove(entry)
        warnings._filters_mutated()  # type: ignore[attr-defined]
