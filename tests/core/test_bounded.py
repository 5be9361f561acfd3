"""kernel_ext._shared.bounded.BoundedMap: the one bounded, timed memory (its rules at their
edges)."""

from __future__ import annotations

import pytest
from support.timing import FakeClock

from kernel_ext._shared.bounded import BoundedMap
from kernel_ext.errors import ConfigError


def test_at_the_size_bound_nothing_is_forgotten_and_one_more_forgets_the_oldest() -> None:
    forgotten: list[tuple[str, int, str]] = []
    memory: BoundedMap[str, int] = BoundedMap(3, on_forget=lambda *e: forgotten.append(e))
    for i, key in enumerate("abc"):
        memory.set(key, i)
    assert memory.items() == [("a", 0), ("b", 1), ("c", 2)]
    assert forgotten == []
    memory.set("d", 3)
    assert list(memory) == ["b", "c", "d"]
    assert forgotten == [("a", 0, "overflow")]


def test_an_entry_lives_exactly_ttl_seconds_after_it_was_added() -> None:
    clock = FakeClock(100.0)
    forgotten: list[tuple[str, str, str]] = []
    memory: BoundedMap[str, str] = BoundedMap(
        10, ttl=30, clock=clock, on_forget=lambda *e: forgotten.append(e)
    )
    memory.set("k", "v")
    clock.now += 29.999
    assert memory.get("k") == "v"
    assert "k" in memory
    memory.set("k", "w")  # an update keeps its deadline
    clock.now += 0.001  # exactly ttl
    assert memory.get("k") is None
    assert "k" not in memory
    assert forgotten == [("k", "w", "expired")]
    assert len(memory) == 0


def test_refresh_makes_an_entry_the_newest_with_a_new_deadline() -> None:
    clock = FakeClock(100.0)
    memory: BoundedMap[str, int] = BoundedMap(2, ttl=10, clock=clock)
    memory.set("a", 1)
    clock.now += 5
    memory.set("b", 2)
    memory.set("a", 3, refresh=True)
    assert list(memory) == ["b", "a"]
    clock.now += 6  # "b" (added at +5) lives until +15; "a" refreshed at +5 as well
    assert memory.items() == [("b", 2), ("a", 3)]
    memory.set("c", 4)  # overflow forgets the oldest: "b"
    assert list(memory) == ["a", "c"]


def test_pop_and_take_forget_without_reporting_and_skip_what_expired() -> None:
    clock = FakeClock(100.0)
    forgotten: list[object] = []
    memory: BoundedMap[int, str] = BoundedMap(
        5, ttl=1, clock=clock, on_forget=lambda *e: forgotten.append(e)
    )
    memory.set(1, "one")
    memory.set(2, "two")
    assert memory.pop(1) == "one"
    assert memory.pop(1, "gone") == "gone"
    clock.now += 1
    memory.set(3, "three")
    assert memory.pop(2) is None  # expired: reported, not returned
    assert memory.take() == [(3, "three")]
    assert len(memory) == 0
    assert forgotten == [(2, "two", "expired")]


def test_none_values_are_entries_too() -> None:
    memory: BoundedMap[str, None] = BoundedMap(2)
    memory.set("x", None)
    assert "x" in memory
    assert "y" not in memory


@pytest.mark.parametrize(("size", "ttl"), [(0, None), (True, None), (1, 0), (1, -1.0)])
def test_bad_bounds_are_refused_at_construction(size: int, ttl: float | None) -> None:
    with pytest.raises(ConfigError):
        BoundedMap(size, ttl)


def test_a_long_run_stays_within_its_bound() -> None:
    clock = FakeClock(100.0)
    memory: BoundedMap[int, int] = BoundedMap(100, ttl=5, clock=clock)
    for i in range(100_000):
        memory.set(i, i)
        clock.now += 0.001
    assert len(memory) == 100
    clock.now += 5
    assert memory.expire() == 100
    assert len(memory) == 0
