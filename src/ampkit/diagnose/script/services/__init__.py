"""The services the script watchers share, below the watchers: a watcher imports services, never
another watcher.

``Services`` holds one of each.  A watcher declares what it needs as constructor parameters named
after its fields; ``Services.arguments(cls)`` hands exactly those in (``Context`` builds every
watcher this way, a test builds one alone the same way).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from ampkit.diagnose.script.services.autocast import AutocastRegions
from ampkit.diagnose.script.services.casts import CastSite, CastSites
from ampkit.diagnose.script.services.frameworks import FrameworkRequest, Frameworks
from ampkit.diagnose.script.services.optimizers import OptimizerRegistry, OptInfo
from ampkit.diagnose.script.services.scalers import ScaledSource, ScalerInfo, ScalerRegistry
from ampkit.diagnose.script.state import WatchState

__all__ = [
    "AutocastRegions", "CastSite", "CastSites", "FrameworkRequest", "Frameworks", "OptInfo", "OptimizerRegistry",
    "ScaledSource", "ScalerInfo", "ScalerRegistry", "Services",
]


@dataclass(frozen=True, kw_only=True)
class Services:
    """One instance of each shared service, built before any watcher."""

    state: WatchState
    """Step counters, the findings ledger, deferred reads, the sampler, the user frames, the models."""
    optimizers: OptimizerRegistry
    """The script's optimizers and each thread's primary one."""
    scalers: ScalerRegistry
    """The loss scalers (GradScalers, ampkit engines) and their update window."""
    regions: AutocastRegions
    """The autocast region each thread is in."""
    casts: CastSites
    """Where parameters became fp16/bf16."""
    frameworks: Frameworks
    """The training frameworks the script drives and the precision asked of them."""

    @classmethod
    def build(cls, state: WatchState) -> Services:
        """Fresh services around ``state`` (each service's own dependencies first)."""
        optimizers = OptimizerRegistry()
        return cls(state=state, optimizers=optimizers, scalers=ScalerRegistry(state, optimizers),
                   regions=AutocastRegions(), casts=CastSites(), frameworks=Frameworks())

    def arguments(self, watcher: type) -> dict[str, Any]:
        """The keyword arguments that build ``watcher``: the services its constructor names.

        Raises:
            TypeError: the constructor names a parameter that is no service.
        """
        names = [p for p in inspect.signature(watcher).parameters]
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = [n for n in names if n not in fields]
        if unknown:
            raise TypeError(f"{watcher.__qualname__}() asks for {', '.join(unknown)}, which is no service; a watcher's "
                            f"constructor takes only services, by these names: {', '.join(sorted(fields))}")
        return {n: getattr(self, n) for n in names}
