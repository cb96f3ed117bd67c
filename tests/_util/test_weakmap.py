"""WeakIdentityMap: weak keys, identity comparison, and an entry's removal that a reused id cannot undo."""

from __future__ import annotations

import gc
import weakref

from ampkit._util.weakmap import WeakIdentityMap


class _Key:
    pass


class _EqualToAll:
    """Equal to every other instance, with one hash: a WeakKeyDictionary would merge them."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _EqualToAll)

    def __hash__(self) -> int:
        return 7


def test_objects_equal_by_value_stay_separate_entries() -> None:
    a, b = _EqualToAll(), _EqualToAll()
    m: WeakIdentityMap[_EqualToAll, str] = WeakIdentityMap()
    m[a] = "a"
    m[b] = "b"
    assert (m.get(a), m.get(b), len(m)) == ("a", "b", 2)


def test_a_dead_object_leaves_the_map_and_keeps_nothing_alive() -> None:
    m: WeakIdentityMap[_Key, int] = WeakIdentityMap()
    kept, dropped = _Key(), _Key()
    m[kept] = 1
    m[dropped] = 2
    del dropped
    gc.collect()
    assert m.items() == [(kept, 1)]
    assert m.objects() == [kept]
    assert len(m._entries) == 1  # the dead entry itself is gone, not just filtered


def test_an_unknown_object_with_a_dead_objects_id_is_not_found() -> None:
    m: WeakIdentityMap[_Key, int] = WeakIdentityMap()
    first = _Key()
    m[first] = 1
    ref_of_first = m._entries[id(first)][0]
    # Simulate id reuse: an entry stays under an id whose object is another one.
    stranger = _Key()
    m._entries[id(stranger)] = (ref_of_first, 1)
    assert m.get(stranger) is None
    assert stranger not in m


def test_a_late_callback_does_not_remove_the_entry_that_reused_the_id() -> None:
    m: WeakIdentityMap[_Key, str] = WeakIdentityMap()
    old, new = _Key(), _Key()
    m[old] = "old"
    old_ref = m._entries[id(old)][0]
    forget = old_ref.__callback__
    assert forget is not None
    # The old object died and a new one got its id before the old reference's callback ran.
    m._entries[id(old)] = (weakref.ref(new), "new")
    forget(old_ref)
    assert m._entries[id(old)][1] == "new"
    forget(m._entries[id(old)][0])  # the entry's own reference does remove it
    assert id(old) not in m._entries
