"""The optimizer registry: the script's optimizers, which one is each thread's primary, and the
``found_inf`` of the last guarded step of each (read by the scheduler rule).

The optimizer watcher registers optimizers as they are built; the GradScaler and engine watchers
ask which optimizer is primary (its steps are the thread's steps) and which ones hold a parameter.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ampkit._util.threads import PerThread
from ampkit._util.weakmap import WeakIdentityMap

__all__ = ["OptInfo", "OptimizerRegistry"]


@dataclass
class OptInfo:
    location: str | None
    checked: int = -1
    last_found: tuple[torch.Tensor, int] | None = None
    """(found_inf, step) of the last scaler.step on this optimizer (None: stepped directly)."""


class OptimizerRegistry:
    """Optimizers by object (weakly held), with each thread's primary optimizer."""

    primary: PerThread[weakref.ReferenceType[torch.optim.Optimizer] | None] = PerThread(lambda: None)
    """This thread's primary optimizer, the first that stepped: its steps are the thread's steps."""

    def __init__(self) -> None:
        self.optimizers: WeakIdentityMap[torch.optim.Optimizer, OptInfo] = WeakIdentityMap()
        self._param_ids: dict[int, tuple[int, set[int]]] = {}

    def __len__(self) -> int:
        return len(self.optimizers)

    def add(self, opt: torch.optim.Optimizer, location: str | None) -> None:
        """``opt`` was built at ``location`` (kept: the first record of an optimizer wins)."""
        if opt not in self.optimizers:
            self.optimizers[opt] = OptInfo(location=location)

    def info(self, opt: torch.optim.Optimizer) -> OptInfo:
        """The record of ``opt``; one built before the doctor started is added now."""
        info = self.optimizers.get(opt)
        if info is None:
            info = self.optimizers[opt] = OptInfo(location=None)
        return info

    def get(self, opt: object) -> OptInfo | None:
        """The record of ``opt``, or None when it is no optimizer of the run."""
        return self.optimizers.get(opt)

    def is_primary(self, opt: torch.optim.Optimizer) -> bool:
        if self.primary is None or self.primary() is None:
            self.primary = weakref.ref(opt)
        return self.primary() is opt

    def owners(self, params: list[torch.Tensor]) -> list[torch.optim.Optimizer]:
        """The optimizers holding any of ``params`` (parameter-id sets cached per optimizer)."""
        ids = {id(p) for p in params}
        out = []
        for opt in self.optimizers.objects():
            count = sum(len(g["params"]) for g in opt.param_groups)
            cached = self._param_ids.get(id(opt))
            if cached is None or cached[0] != count:
                cached = self._param_ids[id(opt)] = (count, {id(p) for g in opt.param_groups for p in g["params"]})
            if not ids.isdisjoint(cached[1]):
                out.append(opt)
        return out
