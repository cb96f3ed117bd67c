"""Reversible patches: everything the script doctor installs into torch, undone in reverse order.

Everything the doctor installs into torch goes through a ``PatchSet`` so that ``restore()``
puts back exactly what was there (class ``__dict__`` entries, module attributes, hook handles),
in reverse order, even when the observed script crashed.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PatchSet"]

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
        self.wrapped: dict[types.CodeType, set[types.CodeType]] = {}
        """Each wrapper's code -> the codes of the Python functions it wrapped (kept after ``restore``):
        a traceback through a wrapper that only passed the call on leaves it out (``tracebacks``)."""

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
        outer, inner = _code(wrapped), _code(original)
        if outer is not None and inner is not None:
            self.wrapped.setdefault(outer, set()).add(inner)

    def after_import(self, name: str, patch: Callable[[types.ModuleType], None]) -> None:
        """Call ``patch(module)`` once module ``name`` is imported: now when it already is, else right
        after the script imports it (a finder at the head of ``sys.meta_path``, removed on restore).
        A library the script never imports is never imported by the doctor.  Cost: one dict look-up
        per import statement of the script that loads a new module."""
        loaded = sys.modules.get(name)
        if loaded is not None:
            patch(loaded)
            return
        finder = _AfterImport(name, patch)
        sys.meta_path.insert(0, finder)
        self._undo.append(_Remover(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None))

    def handle(self, handle: Any) -> None:
        """Keep a ``RemovableHandle`` (or anything with ``remove()``) to remove on restore."""
        self._undo.append(handle)

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Call ``undo()`` on restore, in its place in the reverse order (for a change without a handle)."""
        self._undo.append(_Remover(undo))

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


def _code(fn: Any) -> types.CodeType | None:
    """The code a call of ``fn`` runs first (a bound method's function's); None for C functions."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code if isinstance(code, types.CodeType) else None


class _Remover:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.remove = fn


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` with the finders after it and wraps its loader to call ``patch`` after the module ran."""

    def __init__(self, name: str, patch: Callable[[types.ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self.patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, patch: Callable[[types.ModuleType], None]) -> None:
        self._inner, self._patch = inner, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._inner  # source look-ups (linecache, inspect) go to the real loader
        self._inner.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
