"""Helpers of the distributed tests: launching the scenario module and reading its outputs."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ampkit.distributed import TorchrunResult, launch_torchrun

HERE = Path(__file__).parent
NPROC = 2
LAUNCH_TIMEOUT_S = 240.0

Loader = Callable[[str, int], Any]


def launch(module: str, args: list[str], log_dir: Path, timeout: float = LAUNCH_TIMEOUT_S) -> TorchrunResult:
    """``launch_torchrun`` on 2 gloo ranks with this folder importable and one thread per rank."""
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return launch_torchrun(
        NPROC, module, args, timeout, env={"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}, log_dir=log_dir,
        backend="gloo",
    )


def loader(out: Path) -> Loader:
    """``load(name, rank)``: the object scenario ``name`` saved on ``rank``."""

    def load(name: str, rank: int) -> Any:
        return torch.load(out / f"{name}.rank{rank}.pt", weights_only=True)

    return load


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that differ in any bit, dtype or shape, or exist on one side only."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
