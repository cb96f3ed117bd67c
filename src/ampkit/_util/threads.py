"""Per-thread attributes: an object shared by threads that keeps some of its state per thread.

``PerThread(default)`` declared in a class body makes an attribute whose value each thread sees
and sets on its own (``threading.local`` underneath, one per instance), starting from
``default()``.  Observers of a training loop need it where the loop's own state is per thread:
autocast is thread-local in torch, and two threads that each train a model have their own step,
forward in progress and loss.  Cost: two C attribute lookups per read, one Python call per write;
``thread_values(obj)`` hands out the namespace itself, for hot paths whose writes must run no frame.

>>> import threading
>>> class Counter:
...     n = PerThread(int)
>>> c = Counter()
>>> c.n += 1
>>> seen = []
>>> t = threading.Thread(target=lambda: seen.append(c.n)); t.start(); t.join()
>>> c.n, seen
(1, [0])
>>> thread_values(c).n = 5
>>> c.n
5
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Generic, TypeVar, overload

__all__ = ["PerThread", "thread_values"]

T = TypeVar("T")

_SLOT = "_ampkit_per_thread"


class _Local(threading.local):
    """An object's per-thread values; ``threading.local`` runs ``__init__`` again in each new thread."""

    def __init__(self, defaults: dict[str, Callable[[], Any]]) -> None:
        for name, make in defaults.items():
            setattr(self, name, make())


class _Slot:
    """The class attribute behind an object's ``_Local``: it builds the local on the object's first
    access and stores it in the object's ``__dict__``, which answers every later access directly."""

    def __init__(self) -> None:
        self.defaults: dict[str, Callable[[], Any]] = {}

    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        defaults: dict[str, Callable[[], Any]] = {}
        for klass in reversed(type(obj).__mro__):
            slot = vars(klass).get(_SLOT)
            if isinstance(slot, _Slot):
                defaults.update(slot.defaults)
        # dict.setdefault is atomic under the GIL: two threads that race here get the same local.
        return obj.__dict__.setdefault(_SLOT, _Local(defaults))


thread_values: Callable[[object], Any] = attrgetter(_SLOT)
"""``obj``'s namespace of per-thread values (this thread's): ``thread_values(obj).name = v`` is a C
``setattr``, where assigning the ``PerThread`` property runs one Python frame.  For the observers'
per-step hooks, which write a few of these on every training step."""


class PerThread(Generic[T]):
    """An attribute with one value per thread (see the module docstring).

    Declared in a class body, it turns into a ``property`` whose getter is an ``operator.attrgetter``
    of the object's thread-local namespace: a read is two C attribute lookups and runs no Python
    frame (the observers read these in every hook call of a training step); a write runs one.
    """

    def __init__(self, default: Callable[[], T]) -> None:
        self._default = default

    def __set_name__(self, owner: type, name: str) -> None:
        slot = vars(owner).get(_SLOT)
        if not isinstance(slot, _Slot):
            slot = _Slot()
            setattr(owner, _SLOT, slot)
        slot.defaults[name] = self._default

        def set_value(obj: object, value: Any) -> None:
            setattr(getattr(obj, _SLOT), name, value)

        setattr(owner, name, property(attrgetter(f"{_SLOT}.{name}"), set_value, doc=f"{name}, per thread"))

    # For type checkers only: at run time the class holds the property built above.
    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> PerThread[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type | None = None) -> T | PerThread[T]:
        raise AssertionError("replaced by a property in __set_name__")  # pragma: no cover

    def __set__(self, obj: object, value: T) -> None:
        raise AssertionError("replaced by a property in __set_name__")  # pragma: no cover
