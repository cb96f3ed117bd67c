"""PerThread: one value per thread, defaults made in each thread, inherited declarations."""

from __future__ import annotations

import threading

from ampkit._util.threads import PerThread


class Base:
    seen: PerThread[list[int]] = PerThread(list)


class Child(Base):
    depth = PerThread(int)


def test_per_thread_values_are_separate_and_defaults_are_fresh_in_each_thread() -> None:
    obj = Child()
    obj.seen.append(1)
    obj.depth = 3
    other: list[tuple[list[int], int]] = []

    def work() -> None:
        other.append((list(obj.seen), obj.depth))
        obj.seen.append(2)
        obj.depth = 7

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert other == [([], 0)]  # the inherited and the own attribute start from their defaults there
    assert obj.seen == [1] and obj.depth == 3  # and the other thread's writes stay there


def test_per_thread_values_belong_to_their_object() -> None:
    a, b = Child(), Child()
    a.depth = 5
    assert b.depth == 0 and a.depth == 5
