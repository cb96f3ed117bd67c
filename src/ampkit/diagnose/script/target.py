"""What ``ampkit doctor`` runs: the script or ``-m MODULE`` (checked to exist), run as ``__main__``, and
which tasks a script defines.

A script runs the way ``coverage run`` runs it (``run_as_main``): ``runpy.run_path`` with
``sys.argv = [SCRIPT, *ARGS]`` and ``sys.path[0]`` set to the script's folder (``-m``:
``runpy.run_module`` with ``sys.path[0]`` the working directory).  The doctor and preflight's step
capture (``script.first_steps``) both run scripts through it.

A file that defines a Task is meant for ``ampkit doctor FILE:attr``; run as a script it usually
trains nothing, and the doctor then names the attribute to use.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ampkit.tasks import Task, TaskBase

__all__ = ["ScriptTarget", "defined_tasks", "require_module", "run_as_main", "script_target"]


@dataclass(frozen=True)
class ScriptTarget:
    """A training script, or a module to run as ``python -m`` does, checked to exist (``script_target``)."""

    name: str
    """As given: the script's path, or the module's name."""
    path: Path | None
    """The script's resolved path; None for a module."""
    folder: Path
    """``sys.path[0]`` while it runs, and where the user's code lives: the script's folder, or for a module
    the working directory (only that: the working directory often holds a virtualenv)."""

    @property
    def module(self) -> bool:
        """Run as ``python -m name``."""
        return self.path is None

    @property
    def label(self) -> str:
        """How reports name it: the script's path, or ``-m name``."""
        return str(self.path) if self.path is not None else f"-m {self.name}"


def script_target(target: str | os.PathLike[str], *, module: bool) -> ScriptTarget:
    """``target`` checked to be a script (or, with ``module``, a module ``python -m`` finds).

    Raises:
        FileNotFoundError: ``target`` is not an existing file (``module=False``).
        ModuleNotFoundError: ``python -m target`` would find no module (``module=True``).
    """
    name = os.fspath(target)
    if module:
        require_module(name)
        return ScriptTarget(name=name, path=None, folder=Path.cwd())
    if not Path(name).is_file():
        raise FileNotFoundError(f"no such script: {name!r}")
    path = Path(name).resolve()
    return ScriptTarget(name=name, path=path, folder=path.parent)


def run_as_main(script: ScriptTarget, args: Sequence[str]) -> dict[str, Any]:
    """Run ``script`` as ``__main__`` with ``sys.argv[1:] = args``; its globals.  ``sys.argv``,
    ``sys.path[0]`` and ``sys.modules["__main__"]`` are put back afterwards, also when it raised."""
    with _as_main(script, args):
        if script.path is None:
            return runpy.run_module(script.name, run_name="__main__", alter_sys=True)
        return runpy.run_path(str(script.path), run_name="__main__")


@contextmanager
def _as_main(script: ScriptTarget, args: Sequence[str]) -> Iterator[None]:
    argv, path0 = sys.argv[:], sys.path[0] if sys.path else None
    main = sys.modules.get("__main__")
    sys.argv = [str(script.path) if script.path is not None else script.name, *args]
    root = str(script.folder)
    if sys.path:
        sys.path[0] = root
    else:
        sys.path.append(root)
    try:
        yield
    finally:
        sys.argv = argv
        if path0 is not None:
            sys.path[0] = path0
        if main is not None:
            sys.modules["__main__"] = main


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
