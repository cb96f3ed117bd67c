"""Tasks: what ``ampkit verify`` and ``ampkit doctor TASK`` train, and how a reference is loaded.

``Task`` is the protocol, ``TaskBase`` a convenience base, ``load_task`` resolves a built-in
name, ``path/to/file.py[:attr]`` or ``package.module:attr`` (``ampkit.tasks.base``).  The
built-in tasks are real models on data that ships with Python or scikit-learn (no downloads):
``tinygpt`` (``ampkit.tasks.tinygpt``) and ``digits`` (``ampkit.tasks.digits``).
"""

from __future__ import annotations

from ampkit.tasks.base import (
    BUILTIN_TASKS,
    Task,
    TaskBase,
    TaskLoadError,
    TaskSize,
    check_task,
    load_task,
    split_task_ref,
)

__all__ = ["BUILTIN_TASKS", "Task", "TaskBase", "TaskLoadError", "TaskSize", "check_task", "load_task", "split_task_ref"]
