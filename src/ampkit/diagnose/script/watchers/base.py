"""The contract of a script watcher: one thing ``ampkit doctor SCRIPT`` observes.

A watcher is a subclass of ``Watcher``, built by the ``Context`` (its literal list) with the one
``RunState`` (``script.state``), whose fields it reads and writes: the services two watchers share
(``state.scalers``, ``state.optimizers``, ``state.regions``, ``state.casts``, ``state.frameworks``), the
ledger, the step counters.  A watcher never holds another watcher: what two watchers share is a
field of the state, and a step event is a call of ``script.failures``.  It overrides the methods
below that it needs, each marked ``@override``; the others stay no-ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ampkit._util.autograd import note_backward_roots
from ampkit._util.overrides import overrides

if TYPE_CHECKING:
    from ampkit.diagnose.capture import Capture
    from ampkit.diagnose.script.patches import PatchSet
    from ampkit.diagnose.script.state import RunState

__all__ = ["Watcher", "dispatch_backward"]


class Watcher:
    """Base of the script doctor's watchers; every method is a no-op until a subclass overrides it.

    Calls, in order: ``install`` once before the script starts; ``on_root_forward`` after each
    forward of a model of the script while it runs (in the thread that ran it);
    ``before_backward`` / ``after_backward`` around each backward of the script (one wrapper of
    ``torch.autograd.backward`` calls every watcher that overrides them, ``dispatch_backward``);
    ``finish`` once after it ended, when the deferred device reads are flushed.  Nothing undoes ``install``
    explicitly: every change goes through the ``PatchSet``, whose ``restore()`` undoes it.
    """

    def __init__(self, state: RunState) -> None:
        self.state = state

    def install(self, patches: PatchSet) -> None:
        """Wrap or hook what this watcher observes, each change through ``patches`` (``wrap``, ``replace``,
        ``handle``, ``after_import``) so that ``patches.restore()`` puts torch back."""

    def on_root_forward(self, cap: Capture) -> None:
        """A model of the script returned from its forward; ``cap`` is that forward's capture.  Runs on
        every forward, in the hot path: only watchers that override it are called, and it must not
        read device values."""

    def before_backward(self, tensors: list[torch.Tensor]) -> None:
        """A backward of the script is about to run (``torch.autograd.backward``, which ``Tensor.backward``
        calls) on ``tensors`` (the non-None roots, at least one).  Not called while the doctor itself runs
        a model (a replay, a checkup)."""

    def after_backward(self, tensors: list[torch.Tensor]) -> None:
        """That backward returned (not called when it raised)."""

    def finish(self) -> None:
        """The script ended: add the findings judged over the whole run to ``self.state.ledger``."""


def dispatch_backward(watchers: list[Watcher], state: RunState, patches: PatchSet) -> None:
    """Wrap ``torch.autograd.backward`` once, calling the watchers that override ``before_backward`` or
    ``after_backward`` around each backward of the script, in ``watchers`` order.

    One wrapper for all of them: each watcher wrapping it itself would nest one Python frame per
    watcher in every backward and leave their relative order to the install order.  A watcher is
    called only for the events it overrides (the base class's no-op would cost a frame a backward)."""
    before = [w.before_backward for w in watchers if overrides(w, Watcher, "before_backward")]
    after = [w.after_backward for w in watchers if overrides(w, Watcher, "after_backward")]
    if not before and not after:
        return

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if state.models.paused:
                return orig(tensors, *args, **kwargs)
            flat = [tensors] if isinstance(tensors, torch.Tensor) else [t for t in tensors if t is not None]
            if not flat:
                return orig(tensors, *args, **kwargs)
            for call in before:
                call(flat)
            try:
                out = orig(tensors, *args, **kwargs)
            except Exception as exc:  # which graph raised: a dtype error's explanation walks it
                note_backward_roots(exc, flat)
                raise
            for call in after:
                call(flat)
            return out
        return backward

    patches.wrap(torch.autograd, "backward", wrap)
