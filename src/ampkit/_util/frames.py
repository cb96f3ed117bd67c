"""The user-frame classifier: tells the user's code from library code on a Python stack.

One rule for every doctor (the step tracer's op locations, the script watchers' ``file:line``,
warnings re-attributed to the user's line, exception explanations):

* ``<string>``-style pseudo files are never the user's;
* files under torch, ampkit, the standard library or site-packages are library code — except
  ampkit's built-in task models (``ampkit/tasks``), which are the user's model in ``ampkit
  doctor TASK``;
* with ``user_roots`` (the script doctor passes the script's folder) a file is the user's only
  when it lies under one of them; without, every other file is (``diagnose_step`` on a model
  defined anywhere).

Library roots win over user roots: a virtualenv inside the working directory stays library
code.  Answers are cached per file name, so a stack walk costs a few dict look-ups per frame.

>>> frames = UserFrames()
>>> frames.is_user(__file__), frames.is_user("<string>"), frames.is_user("/home/me/train.py")
(False, False, True)
>>> UserFrames(["/home/me/project"]).is_user("/home/me/other/train.py")
False
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ampkit._util.version import PACKAGE_DIR

__all__ = ["UserFrames"]


def _library_dirs() -> tuple[str, ...]:
    dirs = {str(Path(torch.__file__).resolve().parent), str(Path(PACKAGE_DIR).resolve())}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if key in paths:
            dirs.add(str(Path(paths[key]).resolve()))
    dirs.update(str(Path(p).resolve()) for p in sys.path if p and "site-packages" in p)
    return tuple(sorted(dirs, key=len, reverse=True))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class UserFrames:
    """Finds the user's frames and ``file:line`` on a stack (see the module docstring for the rule)."""

    def __init__(self, user_roots: Iterable[str | os.PathLike[str]] = ()) -> None:
        self.user_roots = tuple(str(Path(r).resolve()) for r in user_roots)
        self._libs = _library_dirs()
        self._tasks = str((Path(PACKAGE_DIR) / "tasks").resolve())
        self._cache: dict[str, bool] = {}
        self._reissued: set[tuple[Any, ...]] = set()
        self._shown: dict[str, str] = {}

    def is_user(self, filename: str) -> bool:
        known = self._cache.get(filename)
        if known is None:
            known = self._cache[filename] = self._classify(filename)
        return known

    def _classify(self, filename: str) -> bool:
        if filename.startswith("<"):
            return False
        path = os.path.realpath(filename)
        if any(_under(path, lib) for lib in self._libs) and not _under(path, self._tasks):
            return False
        if self.user_roots:
            return any(_under(path, r) for r in self.user_roots)
        return "site-packages" not in path and "dist-packages" not in path

    def location(self, depth: int = 1, *, stop: types.FrameType | None = None) -> str | None:
        """``file:line`` (the path as the code object has it) of the innermost user frame, starting
        ``depth`` frames above this call; with ``stop``, only frames above that one count."""
        frame = self.caller_frame(depth + 1, stop=stop)
        return None if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"

    def format(self, filename: str, lineno: int) -> str:
        shown = self._shown.get(filename)
        if shown is None:  # relpath is slow: once per file
            try:
                rel = os.path.relpath(filename)
            except ValueError:  # another drive on Windows
                rel = filename
            shown = self._shown[filename] = filename if rel.startswith("..") else rel
        return f"{shown}:{lineno}"

    def caller(self, skip: int = 1) -> str | None:
        """The innermost user ``file:line`` on the current stack (``skip`` frames above this one)."""
        frame: types.FrameType | None = sys._getframe(skip)
        while frame is not None:
            if self.is_user(frame.f_code.co_filename):
                return self.format(frame.f_code.co_filename, frame.f_lineno)
            frame = frame.f_back
        return None

    def caller_frame(self, skip: int = 1, *, stop: types.FrameType | None = None) -> types.FrameType | None:
        """The innermost frame on the current stack that runs user code; with ``stop``, None when
        the walk reaches that frame first (the user's frames below it called the code being
        observed, they are not its place)."""
        frame: types.FrameType | None = sys._getframe(skip)
        while frame is not None and frame is not stop and not self.is_user(frame.f_code.co_filename):
            frame = frame.f_back
        return None if frame is stop else frame

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, with the warnings it raises re-attributed to the user's line.

        torch warns with ``stacklevel=2``, which would point at the doctor's wrapper instead of
        the script; the warnings are caught and re-issued at the innermost user frame, through
        the normal filters and that module's once-per-location registry.
        """
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return fn(*args, **kwargs)
        finally:
            self._reissue(caught)

    def _reissue(self, caught: list[warnings.WarningMessage]) -> None:
        if not caught:
            return
        frame = self.caller_frame(2)
        for w in caught:
            filename, lineno = (w.filename, w.lineno) if frame is None else (frame.f_code.co_filename, frame.f_lineno)
            key = (str(w.message), w.category, filename, lineno)
            # catch_warnings resets the registries' "already shown" state, so repeats are dropped
            # here: the default filter's once-per-location behaviour.
            if key in self._reissued:
                continue
            self._reissued.add(key)
            warnings.warn_explicit(w.message, w.category, filename, lineno,
                                   module=frame.f_globals.get("__name__") if frame is not None else None)

    def user_frames(self, tb: types.TracebackType | None) -> list[types.FrameType]:
        """The traceback's frames that run user code, outermost first."""
        frames = []
        while tb is not None:
            if self.is_user(tb.tb_frame.f_code.co_filename):
                frames.append(tb.tb_frame)
            tb = tb.tb_next
        return frames

    def call_chain(self, tb: types.TracebackType | None = None, *, skip: int = 1) -> list[str]:
        """The user's frames as ``file:line function()`` (``file:line`` at module level), outermost
        first and innermost last: those of ``tb`` when given, else those of the current stack from
        ``skip`` frames above this call.

        >>> frames = UserFrames(["/home/me"])
        >>> ns = {"frames": frames}
        >>> exec(compile("def train(): return frames.call_chain()", "/home/me/train.py", "exec"), ns)
        >>> ns["train"]()
        ['/home/me/train.py:1 train()']
        """
        spots: list[tuple[types.CodeType, int]] = []
        if tb is not None:
            while tb is not None:
                spots.append((tb.tb_frame.f_code, tb.tb_lineno))
                tb = tb.tb_next
        else:
            frame: types.FrameType | None = sys._getframe(skip)
            while frame is not None:
                spots.append((frame.f_code, frame.f_lineno))
                frame = frame.f_back
            spots.reverse()
        return [self._link(code, line) for code, line in spots if self.is_user(code.co_filename)]

    def _link(self, code: types.CodeType, lineno: int) -> str:
        at = self.format(code.co_filename, lineno)
        # Python 3.11+: Trainer.step rather than step; a nested function reads outer.inner
        name = getattr(code, "co_qualname", code.co_name).replace("<locals>.", "")
        return at if name == "<module>" else f"{at} {name}()"

    def traceback_location(self, tb: types.TracebackType | None) -> str | None:
        """``file:line`` of the innermost user frame of ``tb`` (the line that raised, as the user sees it)."""
        last = None
        while tb is not None:
            if self.is_user(tb.tb_frame.f_code.co_filename):
                last = self.format(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
            tb = tb.tb_next
        return last
