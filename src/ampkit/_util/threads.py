"""Per-thread attributes: an object shared by threads that keeps some of its state per thread.

``PerThread(default)`` declared in a class body makes an attribute whose value each thread sees
and sets on its own (``threading.local`` underneath, one per instance), starting from
``default()``.  Observers of a training loop need it where the loop's own state is per thread:
autocast is thread-local in torch, and two threads that each train a model have their own step,
forward in progress and loss.  Cost: one dictionary lookup and one ``getattr`` per access.

>>> import threading
>>> class Counter:
...     n = PerThread(int)
>>> c = Counter()
>>> c.n += 1
>>> seen = []
>>> t = threading.Thread(target=lambda: seen.append(c.n)); t.start(); t.join()
>>> c.n, seen
(1, [0])
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

__all__ = ["PerThread"]

T = TypeVar("T")

_SLOT = "_ampkit_per_thread"


class PerThread(Generic[T]):
    """An attribute with one value per thread (see the module docstring)."""

    def __init__(self, default: Callable[[], T]) -> None:
        self._default = default
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @staticmethod
    def _local(obj: Any) -> threading.local:
        # dict.setdefault is atomic under the GIL: two threads that race here get the same local.
        local: threading.local = obj.__dict__.setdefault(_SLOT, threading.local())
        return local

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> PerThread[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> T | PerThread[T]:
        if obj is None:
            return self
        local = self._local(obj)
        try:
            value: T = getattr(local, self._name)
        except AttributeError:
            value = self._default()
            setattr(local, self._name, value)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(self._local(obj), self._name, value)
