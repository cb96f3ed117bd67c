"""``ampkit verify``: the FP32-baseline protocol (task, harness, comparison, report).

The submodules import torch-heavy and optional pieces (matplotlib, rich) lazily, so importing
``ampkit.verify`` itself stays cheap.
"""

from ampkit.verify.task import Task, TaskBase, TaskLoadError, load_task

__all__ = ["Task", "TaskBase", "TaskLoadError", "load_task"]
