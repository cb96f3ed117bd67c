"""The autocast regions service: the outermost ``torch.autocast`` block each thread is in (the scope of
autocast's weight-cast cache), and where an optimizer stepped inside it.

The autocast watcher opens and closes regions; the optimizer watcher marks a step inside one; the
autocast watcher then reports STALE_WEIGHT_CACHE for a forward that followed.  Autocast is
thread-local in torch, so is a region.
"""

from __future__ import annotations

import threading

import torch

from ampkit._util.threads import PerThread, thread_values

__all__ = ["AutocastRegions"]


class AutocastRegions:
    """This thread's autocast nesting depth and the region it is in."""

    depth = PerThread(int)
    region_location: PerThread[str | None] = PerThread(lambda: None)
    region_stepped: PerThread[str | None] = PerThread(lambda: None)
    """Where an optimizer stepped inside this thread's current region (its cached casts are stale)."""

    def __init__(self) -> None:
        self.enabled_in: dict[int, tuple[threading.Thread, str | None]] = {}
        """Thread ident -> (thread, location) of each thread now inside an enabled outermost autocast
        block: what another thread's forward would wrongly expect to inherit."""

    # enter and exit run on every training step: per-thread writes go through ``thread_values``
    # (no Python frame each), and a thread's name is read only when a finding needs it.
    def enter(self, location: str | None, *, enabled: bool = True) -> None:
        """An autocast block was entered at ``location``; the outermost one opens a region."""
        mine = thread_values(self)
        mine.depth += 1
        if mine.depth == 1:
            mine.region_stepped = None
            mine.region_location = location
            if enabled:
                self.enabled_in[threading.get_ident()] = (threading.current_thread(), location)

    def exit(self) -> None:
        mine = thread_values(self)
        mine.depth = max(0, mine.depth - 1)
        if mine.depth == 0:
            self.enabled_in.pop(threading.get_ident(), None)

    def enabled_elsewhere(self) -> tuple[str, str | None] | None:
        """(thread name, location) of another thread inside an enabled autocast block, if this one is in none."""
        me = threading.get_ident()
        if me in self.enabled_in:
            return None
        return next(((t.name, where) for ident, (t, where) in list(self.enabled_in.items()) if ident != me), None)

    @staticmethod
    def any_enabled() -> bool:
        """Autocast is on for a device type in this thread."""
        return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d))
