"""Deprecated: the task protocol and its loader live in ``ampkit.tasks`` now.

``from ampkit.verify.task import TaskBase`` keeps working for one version and warns with a
``DeprecationWarning``; import from ``ampkit.tasks`` (or use ``ampkit.TaskBase``) instead.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from ampkit.verify.task import load_task
>>> import ampkit.tasks
>>> load_task is ampkit.tasks.load_task, caught[0].category.__name__
(True, 'DeprecationWarning')
"""

from __future__ import annotations

import warnings
from typing import Any

from ampkit import tasks

__all__ = list(tasks.__all__)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'ampkit.verify.task' has no attribute {name!r}")
    warnings.warn(f"ampkit.verify.task.{name} moved to ampkit.tasks.{name}; import it from ampkit.tasks "
                  "(ampkit.verify.task is removed in the next version)", DeprecationWarning, stacklevel=2)
    return getattr(tasks, name)
