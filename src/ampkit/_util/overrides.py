"""``overrides``: whether an object's class replaces a base class's own method.

Extensions of one kind share a base whose methods are documented no-ops (``EngineHook``, the script
doctor's ``Watcher``); their callers skip the objects that keep the no-op, so a hot path pays no
call for an event nobody handles.  Decided per class: an attribute set on an instance is not an
override.
"""

from __future__ import annotations

__all__ = ["overrides"]


def overrides(obj: object, base: type, method: str) -> bool:
    """True when ``obj``'s class replaces ``base``'s own ``method``.

    >>> class Base:
    ...     def ping(self): pass
    >>> class Child(Base):
    ...     def ping(self): pass
    >>> overrides(Child(), Base, "ping"), overrides(Base(), Base, "ping")
    (True, False)
    """
    return getattr(type(obj), method) is not getattr(base, method)
