"""overrides (ampkit._util.overrides): whether a subclass replaces a base class's own method."""

from __future__ import annotations

from ampkit._util.overrides import overrides
from ampkit.hooks import EngineHook


class _Base:
    def ping(self) -> None:
        pass

    def pong(self) -> None:
        pass


class _Child(_Base):
    def ping(self) -> None:
        pass


class _Grandchild(_Child):
    pass


def test_overrides_is_decided_by_the_class_against_the_given_base() -> None:
    assert overrides(_Child(), _Base, "ping") and not overrides(_Child(), _Base, "pong")
    assert overrides(_Grandchild(), _Base, "ping")  # inherited from a subclass that replaced it
    child = _Child()
    child.pong = lambda: None  # type: ignore[method-assign]  # an instance attribute is not a class's method
    assert not overrides(child, _Base, "pong")


def test_overrides_tells_an_engine_hook_that_reduces_found_inf() -> None:
    class Reducer(EngineHook):
        def reduce_found_inf(self, engine, found_inf):  # type: ignore[no-untyped-def]
            return found_inf

    assert overrides(Reducer(), EngineHook, "reduce_found_inf") and not overrides(Reducer(), EngineHook, "on_event")
