"""``ampkit verify``: the FP32-baseline protocol (task, harness, comparison, report).

The submodules import torch-heavy and optional pieces (matplotlib, rich) lazily, so importing
``ampkit.verify`` itself stays cheap: the CLI imports ``ampkit.verify.compare`` (pure Python)
to build its parser without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampkit.verify.task import Task, TaskBase, TaskLoadError, load_task

__all__ = ["Task", "TaskBase", "TaskLoadError", "load_task"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'ampkit.verify' has no attribute {name!r}")
    value = getattr(importlib.import_module("ampkit.verify.task"), name)
    globals()[name] = value
    return value
