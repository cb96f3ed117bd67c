"""The verify plan's types: what was asked (``VerifyConfig``), what will run (``Plan``), and the error.

They sit in a module of their own, below everything that reads them: the harness builds a
``Plan`` from a ``VerifyConfig`` (``ampkit.verify.harness.plan``), ``ampkit.verify.shape`` fills in
its steps and moves it along a task's size ladder, ``ampkit.verify.runner`` runs one precision of it
and ``ampkit.verify.probe`` budgets it.  None of those imports another for these names, so the
verify modules import each other without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ampkit.precision import PrecisionName
from ampkit.verify.compare import Tolerances
from ampkit.verify.noise import NOISE_K

if TYPE_CHECKING:
    from ampkit.tasks import Task

__all__ = ["Plan", "VerifyConfig", "VerifyError"]


class VerifyError(ValueError):
    """A verify configuration that cannot run; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """What ``ampkit verify`` was asked to do; ``None`` fields take the task's defaults."""

    task: str = "tinygpt"
    """Built-in name, ``path/to/file.py[:attr]`` or ``package.module:attr``."""
    precisions: tuple[str, ...] | None = None
    """Precisions to run, as the user spelled them (any name ``Precision.parse`` accepts; ``plan`` checks
    them); fp32 is always added as the baseline.  None: ``default_precisions``."""
    device: str = "auto"
    """Device for every run (``auto``: cuda, xpu, mps, then cpu)."""
    steps: int | None = None
    """Optimizer steps per run."""
    warmup: int | None = None
    """Steps excluded from throughput (and from the loss-curve distance)."""
    eval_every: int | None = None
    """Evaluate every N steps (and always at the end)."""
    seed: int = 0
    """Seed for the initial weights and the data order, shared by every run."""
    tolerances: Tolerances = field(default_factory=Tolerances)
    """Pass/fail thresholds."""
    measure_env: bool = True
    """Measure matmul throughput per dtype for the environment record (about a second per device)."""
    nproc: int | None = None
    """Ranks per precision under torchrun with DDP (the task's batch split over them); None: one plain process."""
    scaling_baseline: bool = True
    """With ``nproc`` > 1, also run each precision on 1 rank for the scaling efficiency."""
    time_budget: float | None = None
    """Seconds for the probe and the runs together (``--time-budget``): fewer steps, equal for all, and a smaller
    task where it offers a size ladder (``ampkit.verify.shape``); None: no limit."""
    noise_band: bool = True
    """Measure the fp32 noise band with a second fp32 run (``ampkit.verify.noise``); False: single-run verdicts."""
    noise_k: float = NOISE_K
    """A difference must exceed k noise bands to fail, and k bands must fit the tolerance to pass."""
    size: str | None = None
    """A rung of the task's size ladder (``--size``); None: the task as loaded (``--time-budget`` may pick one)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A resolved, validated configuration."""

    task: Task
    task_ref: str
    device: torch.device
    precisions: tuple[PrecisionName, ...]
    """Canonical names, fp32 (the baseline) first."""
    steps: int
    warmup: int
    eval_every: int
    seed: int
    notes: tuple[str, ...] = ()
    nproc: int | None = None
    scaling_baseline: bool = True
    noise_band: bool = True
    size: str | None = None
    """The task size the runs use (a rung of the task's ladder: ``ampkit.verify.shape``), None: the task as loaded."""

    @property
    def parts(self) -> int:
        """Runs per precision: 2 when a 1-rank baseline is run for the scaling efficiency."""
        return 2 if self.nproc is not None and self.nproc > 1 and self.scaling_baseline else 1
