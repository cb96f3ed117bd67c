"""The contract of a script watcher: one thing ``ampkit doctor SCRIPT`` observes.

A watcher is a subclass of ``Watcher`` listed in ``watchers.WATCHERS``.  Its constructor
declares the services it needs as parameters named after the fields of ``script.services.Services``
(``state``, ``scalers``, ``optimizers``, ``regions``, ``casts``) and annotated with their types; the
``Context`` builds the services first and passes each watcher exactly the ones it names.  A
watcher never holds another watcher: what two watchers share is a service.  It overrides the
methods below that it needs, each marked ``@override``; the others stay no-ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ampkit.diagnose.script.models import Capture
    from ampkit.diagnose.script.patches import PatchSet

__all__ = ["Watcher", "overrides"]


class Watcher:
    """Base of the script doctor's watchers; every method is a no-op until a subclass overrides it.

    Calls, in order: ``install`` once before the script starts; ``on_root_forward`` after each
    forward of a model of the script while it runs (in the thread that ran it); ``finish`` once
    after it ended, when the deferred device reads are flushed.  Nothing undoes ``install``
    explicitly: every change goes through the ``PatchSet``, whose ``restore()`` undoes it.
    """

    def install(self, patches: PatchSet) -> None:
        """Wrap or hook what this watcher observes, each change through ``patches`` (``wrap``, ``replace``,
        ``handle``, ``after_import``) so that ``patches.restore()`` puts torch back."""

    def on_root_forward(self, cap: Capture) -> None:
        """A model of the script returned from its forward; ``cap`` is that forward's capture.  Runs on
        every forward, in the hot path: only watchers that override it are called, and it must not
        read device values."""

    def finish(self) -> None:
        """The script ended: add the findings judged over the whole run to ``state.ledger``."""


def overrides(watcher: Watcher, method: str) -> bool:
    """True when ``watcher``'s class replaces ``Watcher``'s own ``method``.

    >>> class Counter(Watcher):
    ...     def finish(self): pass
    >>> overrides(Counter(), "finish"), overrides(Counter(), "install")
    (True, False)
    """
    return getattr(type(watcher), method) is not getattr(Watcher, method)
