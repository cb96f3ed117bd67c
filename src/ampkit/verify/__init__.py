"""``ampkit verify``: the FP32-baseline protocol (harness, worker, comparison, report, charts, launch).

The submodules import torch-heavy and optional pieces (matplotlib, rich) lazily, so importing
``ampkit.verify`` itself stays cheap: the CLI imports ``ampkit.verify.compare`` (pure Python)
to build its parser without paying for torch.  The task protocol it runs lives in
``ampkit.tasks``; ``Task``, ``TaskBase``, ``TaskLoadError`` and ``load_task`` are re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ampkit._util.lazy import lazy_attributes

if TYPE_CHECKING:
    from ampkit.tasks import Task, TaskBase, TaskLoadError, load_task

__all__ = ["Task", "TaskBase", "TaskLoadError", "load_task"]

__getattr__, __dir__ = lazy_attributes(__name__, dict.fromkeys(__all__, "ampkit.tasks"))
