"""The autocast regions service: the outermost ``torch.autocast`` block each thread is in (the scope of
autocast's weight-cast cache), and where an optimizer stepped inside it.

The autocast watcher opens and closes regions; the optimizer watcher marks a step inside one; the
autocast watcher then reports STALE_WEIGHT_CACHE for a forward that followed.  Autocast is
thread-local in torch, so is a region.
"""

from __future__ import annotations

import torch

from ampkit._util.threads import PerThread

__all__ = ["AutocastRegions"]


class AutocastRegions:
    """This thread's autocast nesting depth and the region it is in."""

    depth = PerThread(int)
    region_location: PerThread[str | None] = PerThread(lambda: None)
    region_stepped: PerThread[str | None] = PerThread(lambda: None)
    """Where an optimizer stepped inside this thread's current region (its cached casts are stale)."""

    def __init__(self) -> None:
        self.region = 0
        """Outermost regions entered so far, all threads."""

    def enter(self, location: str | None) -> None:
        """An autocast block was entered at ``location``; the outermost one opens a region."""
        self.depth += 1
        if self.depth == 1:
            self.region += 1
            self.region_stepped = None
            self.region_location = location

    def exit(self) -> None:
        self.depth = max(0, self.depth - 1)

    @staticmethod
    def any_enabled() -> bool:
        """Autocast is on for a device type in this thread."""
        return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d))
