"""What ``ampkit doctor`` runs: whether ``-m MODULE`` exists, and which tasks a script defines.

A file that defines a Task is meant for ``ampkit doctor FILE:attr``; run as a script it usually
trains nothing, and the doctor then names the attribute to use.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from ampkit.tasks import Task, TaskBase

__all__ = ["defined_tasks", "require_module"]


def defined_tasks(namespace: dict[str, Any]) -> list[str]:
    """The script's global names bound to a Task instance or to a Task class it defines itself;
    instances first (``FILE:attr`` needs no constructor arguments for them)."""
    instances = [name for name, v in namespace.items()
                 if not name.startswith("_") and not isinstance(v, type) and _is_task(v)]
    classes = [name for name, v in namespace.items()
               if isinstance(v, type) and v.__module__ == "__main__" and v is not TaskBase
               and (issubclass(v, TaskBase) or all(callable(getattr(v, m, None)) for m in _TASK_METHODS))]
    return instances + classes


_TASK_METHODS = ("build_model", "build_optimizer", "batches", "loss", "evaluate")


def _is_task(value: Any) -> bool:
    try:
        return isinstance(value, Task)
    except Exception:  # the protocol check reads attributes; an odd object may raise on any of them
        return False


def require_module(name: str) -> None:
    """Raise ModuleNotFoundError when ``python -m name`` would find no module to run.

    Searched as ``-m`` does, the working directory first.  Finding a submodule imports its parent
    packages, as ``python -m`` does too; when such an import fails for another reason, the run
    itself reproduces the error under observation.
    """
    saved = sys.path[:]
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        is_package = spec is not None and spec.submodule_search_locations is not None
        if is_package and importlib.util.find_spec(f"{name}.__main__") is None:
            raise ModuleNotFoundError(f"{name!r} is a package without a __main__ module; run one of its "
                                          "modules (-m package.module)", name=name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(f"{exc.name}.")):
            return  # the module exists; something it imports does not: the run shows that
        if exc.name == name:
            raise
        raise ModuleNotFoundError(f"no module named {exc.name!r}, so none named {name!r} (searched the working "
                                  "directory and sys.path)", name=exc.name) from None
    except Exception:
        return
    finally:
        sys.path[:] = saved
    if spec is None:
        raise ModuleNotFoundError(f"no module named {name!r} (searched the working directory and sys.path)",
                                  name=name)
