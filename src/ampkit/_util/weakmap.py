"""A map from objects, held weakly and compared by identity, to records, for per-step lookups.

The script doctor keeps a record per GradScaler and per optimizer without keeping the object
alive (a scaler built in a function dies with it).  ``weakref.WeakKeyDictionary`` does that, but
iterating it runs a Python generator under an iteration guard (about 2 µs per pass), and the
observers iterate the scalers and optimizers several times on every training step.  Here the
entries live in a plain dict keyed by ``id(obj)``, each holding a weak reference that removes it
when the object dies; ``items()`` and ``objects()`` are lists built in one comprehension.

Keys are compared by identity, never by ``__eq__``: two equal optimizers are two optimizers.

>>> class Scaler: pass
>>> a, b = Scaler(), Scaler()
>>> m = WeakIdentityMap()
>>> m[a] = "first"; m[b] = "second"
>>> m.get(a), len(m), a in m
('first', 2, True)
>>> del b
>>> [v for _, v in m.items()]
['first']
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["WeakIdentityMap"]

K = TypeVar("K")
V = TypeVar("V")


class WeakIdentityMap(Generic[K, V]):
    """``{obj: record}`` with ``obj`` held weakly and compared by identity (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ReferenceType[Any], V]] = {}

    def _forget(self, key: int) -> Callable[[weakref.ReferenceType[Any]], None]:
        entries = self._entries

        def forget(ref: weakref.ReferenceType[Any]) -> None:
            # A dead object's id may already be reused by a new entry: remove only this reference's.
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        return forget

    def __setitem__(self, obj: K, value: V) -> None:
        self._entries[id(obj)] = (weakref.ref(obj, self._forget(id(obj))), value)

    def get(self, obj: object) -> V | None:
        """The record of ``obj``, or None."""
        entry = self._entries.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def __contains__(self, obj: object) -> bool:
        entry = self._entries.get(id(obj))
        return entry is not None and entry[0]() is obj

    def __len__(self) -> int:
        return sum(1 for ref, _ in list(self._entries.values()) if ref() is not None)

    def items(self) -> list[tuple[K, V]]:
        """``(obj, record)`` of every live object, in insertion order."""
        return [(obj, value) for ref, value in list(self._entries.values()) if (obj := ref()) is not None]

    def objects(self) -> list[K]:
        """Every live object, in insertion order."""
        return [obj for ref, _ in list(self._entries.values()) if (obj := ref()) is not None]
