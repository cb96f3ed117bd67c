"""Plumbing shared by the script observers: reversible patches, user-code locations, a findings
ledger and deferred device reads.

Everything the doctor installs into torch goes through a ``PatchSet`` so that ``restore()``
puts back exactly what was there (class ``__dict__`` entries, module attributes, hook handles),
in reverse order, even when the observed script crashed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ampkit.findings import CODES, SEVERITY_ORDER, Finding, Severity

__all__ = ["CodeFilter", "Ledger", "PatchSet", "Pending"]

_MISSING = object()


class PatchSet:
    """Attribute replacements and hook handles, undone in reverse order by ``restore``.

    >>> import math
    >>> p = PatchSet()
    >>> p.replace(math, "tau", 6.0)
    >>> math.tau
    6.0
    >>> p.restore()
    >>> round(math.tau, 3)
    6.283
    """

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any] | Any] = []

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``; for classes the owner's own ``__dict__`` entry is saved."""
        saved = vars(owner).get(name, _MISSING) if isinstance(owner, (type, types.ModuleType)) else _MISSING
        if saved is _MISSING and not isinstance(owner, type):
            saved = getattr(owner, name, _MISSING)
        self._undo.append((owner, name, saved))
        setattr(owner, name, value)

    def wrap(self, owner: type | types.ModuleType, name: str,
             make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace ``owner.name`` with ``make(original)`` (``original`` as looked up on ``owner``)."""
        original = getattr(owner, name)
        wrapped = make(original)
        try:
            wrapped.__wrapped__ = original  # type: ignore[attr-defined]
            wrapped.__name__ = getattr(original, "__name__", name)
            wrapped.__doc__ = getattr(original, "__doc__", None)
        except (AttributeError, TypeError):
            pass
        self.replace(owner, name, wrapped)

    def handle(self, handle: Any) -> None:
        """Keep a ``RemovableHandle`` (or anything with ``remove()``) to remove on restore."""
        self._undo.append(handle)

    def restore(self) -> None:
        while self._undo:
            item = self._undo.pop()
            if isinstance(item, tuple):
                owner, name, saved = item
                if saved is _MISSING:
                    with contextlib.suppress(AttributeError):
                        delattr(owner, name)
                else:
                    setattr(owner, name, saved)
            else:
                item.remove()

    def __len__(self) -> int:
        return len(self._undo)


def _library_dirs() -> tuple[str, ...]:
    from ampkit._util.version import PACKAGE_DIR

    dirs = {str(Path(torch.__file__).resolve().parent), str(PACKAGE_DIR)}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if key in paths:
            dirs.add(str(Path(paths[key]).resolve()))
    dirs.update(str(Path(p).resolve()) for p in sys.path if p and "site-packages" in p)
    return tuple(sorted(dirs, key=len, reverse=True))


class CodeFilter:
    """Tells the user's code from library code, and finds the user's ``file:line`` on a stack.

    A file is the user's when it lies under one of ``user_roots`` (the script's folder, the
    working directory) and not under torch, ampkit, the standard library or site-packages.
    Answers are cached per file name, so a stack walk costs a few dict look-ups per frame.
    """

    def __init__(self, user_roots: Iterable[str | os.PathLike[str]]) -> None:
        self.user_roots = tuple(str(Path(r).resolve()) for r in user_roots)
        self._libs = _library_dirs()
        self._cache: dict[str, bool] = {}
        self._reissued: set[tuple[Any, ...]] = set()
        self._shown: dict[str, str] = {}

    def is_user(self, filename: str) -> bool:
        known = self._cache.get(filename)
        if known is None:
            path = os.path.realpath(filename) if not filename.startswith("<") else ""
            known = bool(path) and any(_under(path, r) for r in self.user_roots) and not any(
                _under(path, lib) for lib in self._libs
            )
            self._cache[filename] = known
        return known

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

    def caller_frame(self, skip: int = 1) -> types.FrameType | None:
        """The innermost frame on the current stack that runs user code."""
        frame: types.FrameType | None = sys._getframe(skip)
        while frame is not None and not self.is_user(frame.f_code.co_filename):
            frame = frame.f_back
        return frame

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

    def traceback_location(self, tb: types.TracebackType | None) -> str | None:
        """``file:line`` of the innermost user frame of ``tb`` (the line that raised, as the user sees it)."""
        last = None
        while tb is not None:
            if self.is_user(tb.tb_frame.f_code.co_filename):
                last = self.format(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
            tb = tb.tb_next
        return last


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass
class _Entry:
    code: str
    severity: Severity
    message: str
    fix: str
    module: str | None
    op: str | None
    location: str | None
    step: int | None
    evidence: dict[str, Any]
    count: int = 1
    steps: list[int] = field(default_factory=list)


class Ledger:
    """Findings keyed by ``(code, key)``: the first occurrence is kept, later ones are counted.

    >>> led = Ledger()
    >>> [led.add("CLIP_BEFORE_UNSCALE", message="clipped scaled gradients", fix="unscale first", step=s)
    ...  for s in range(3)]
    [True, False, False]
    >>> [(f.code, f.step, f.evidence["occurrences"]) for f in led.findings()]
    [('CLIP_BEFORE_UNSCALE', 0, 3)]
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, Any], _Entry] = {}

    def add(self, code: str, *, message: str, fix: str, key: Any = None, severity: Severity | None = None,
            module: str | None = None, op: str | None = None, location: str | None = None,
            step: int | None = None, evidence: dict[str, Any] | None = None) -> bool:
        """Record a finding; returns True when it is the first of its ``(code, key)``."""
        if code not in CODES:
            raise ValueError(f"unknown finding code {code!r}")
        entry = self._entries.get((code, key))
        if entry is not None:
            entry.count += 1
            if step is not None and len(entry.steps) < 32:
                entry.steps.append(step)
            if severity is not None and SEVERITY_ORDER[severity] < SEVERITY_ORDER[entry.severity]:
                entry.severity = severity
            return False
        self._entries[(code, key)] = _Entry(
            code=code, severity=severity or CODES[code], message=message, fix=fix, module=module, op=op,
            location=location, step=step, evidence=dict(evidence or {}),
            steps=[step] if step is not None else [],
        )
        return True

    def has(self, code: str) -> bool:
        return any(c == code for c, _ in self._entries)

    def discard(self, code: str) -> None:
        for k in [k for k in self._entries if k[0] == code]:
            del self._entries[k]

    def findings(self) -> list[Finding]:
        out = []
        for e in self._entries.values():
            evidence = dict(e.evidence)
            evidence["occurrences"] = e.count
            if len(e.steps) > 1:
                evidence["steps"] = e.steps
            out.append(Finding(code=e.code, severity=e.severity, message=e.message, fix=e.fix, module=e.module,
                               op=e.op, location=e.location, step=e.step, evidence=evidence))
        return out

    def __len__(self) -> int:
        return len(self._entries)


class Pending:
    """Device scalars whose values are needed later, read in one batch per device.

    Reading a CPU tensor costs nothing (CPU kernels are synchronous), so CPU values are
    delivered at once; values on an accelerator wait for ``flush()``, which stacks them and
    makes one host transfer per device instead of one sync per value.
    """

    def __init__(self) -> None:
        self._queue: list[tuple[torch.Tensor, Callable[[float], None]]] = []

    def read(self, value: torch.Tensor, then: Callable[[float], None], *, now: bool = False) -> None:
        """Deliver ``float(value)`` to ``then``: at once on CPU or when ``now`` (a sync), else at ``flush``."""
        if now or value.device.type == "cpu":
            then(float(value))
        else:
            self._queue.append((value.detach().reshape(()).float(), then))

    def flush(self) -> None:
        queue, self._queue = self._queue, []
        by_device: dict[torch.device, list[tuple[torch.Tensor, Callable[[float], None]]]] = {}
        for t, cb in queue:
            by_device.setdefault(t.device, []).append((t, cb))
        for items in by_device.values():
            # One device->host copy for the whole batch: the only sync this class makes.
            values = torch.stack([t for t, _ in items]).tolist()
            for (_, cb), v in zip(items, values):
                cb(float(v))

    def __len__(self) -> int:
        return len(self._queue)
