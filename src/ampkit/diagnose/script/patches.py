"""Reversible patches: everything the script doctor installs into torch, undone in reverse order.

Everything the doctor installs into torch goes through a ``PatchSet`` so that ``restore()``
puts back exactly what was there (class ``__dict__`` entries, module attributes, hook handles),
in reverse order, even when the observed script crashed.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
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
