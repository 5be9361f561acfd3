"""The one bounded memory of kernel_ext: "remember this for a while, at most so many".

:class:`BoundedMap` is an insertion-ordered map with a size bound and an optional time to
live on an injectable monotonic clock. Everything in kernel_ext that remembers something for
a while — terminals a sender still owes, terminals a relay emitted or holds for late joiners,
a relay's Redis re-publishes, streams a relay ended for a gone worker — is one of these, so
the rules live here once:

* Bounded: at most ``max_size`` entries; adding one more forgets the oldest first (reason
  ``"overflow"``).
* Timed: with a ``ttl``, an entry is forgotten ``ttl`` seconds after it was added (reason
  ``"expired"``), whether or not it was read meanwhile; expired entries are never returned.
  :meth:`BoundedMap.set` of a key already present updates its value and keeps its place and
  its deadline, unless ``refresh=True`` (then it becomes the newest, with a new deadline).
* Every entry forgotten by a bound (not by :meth:`pop`/:meth:`clear`) is reported to
  ``on_forget(key, value, reason)``, so owners can count and log it.
* Cheap: entries are kept in deadline order (a constant ``ttl`` and a monotonic clock), so
  expiry looks at the oldest entries only; every operation is O(1) amortized.

Not thread-safe: each owner uses it from one thread or under its own lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from kernel_ext.errors import check_positive_ints, check_positive_numbers

__all__ = ["EXPIRED", "OVERFLOW", "BoundedMap"]

K = TypeVar("K")
V = TypeVar("V")

EXPIRED = "expired"
OVERFLOW = "overflow"


class BoundedMap(Generic[K, V]):
    """An insertion-ordered map with a size bound and an optional time to live (module
    docstring for the rules).

    Args:
        max_size: entries kept at most (the oldest is forgotten beyond).
        ttl: seconds an entry is kept after it was added; ``None``: no time limit.
        clock: the monotonic clock of ``ttl`` (tests pass a fake).
        on_forget: called as ``on_forget(key, value, reason)`` for each entry a bound
            forgot (``"overflow"`` or ``"expired"``); it must not raise.

    Raises:
        ConfigError: ``max_size`` is not a positive int, or ``ttl`` not a positive number.
    """

    __slots__ = ("_clock", "_entries", "_on_forget", "max_size", "ttl")

    def __init__(
        self,
        max_size: int,
        ttl: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_forget: Callable[[K, V, str], None] | None = None,
    ) -> None:
        check_positive_ints(max_size=max_size)
        if ttl is not None:
            check_positive_numbers(ttl=ttl)
        self.max_size = max_size
        self.ttl = None if ttl is None else float(ttl)
        self._clock = clock
        self._on_forget = on_forget
        # key -> (forget at, value), oldest first. An OrderedDict, not a dict: its oldest
        # key is found in O(1) however many were removed before it (a dict's first key is
        # found by scanning past the holes its removals left, until it is resized).
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def set(self, key: K, value: V, *, refresh: bool = False) -> None:
        """Remember ``value`` under ``key`` (see the module docstring for place and
        deadline); forget the oldest entries beyond ``max_size``."""
        entries = self._entries
        found = entries.get(key)
        if found is not None and not refresh:
            entries[key] = (found[0], value)
            return
        if found is not None:
            del entries[key]
        ttl = self.ttl
        entries[key] = (self._clock() + ttl if ttl is not None else 0.0, value)
        while len(entries) > self.max_size:
            oldest, (_, forgotten) = entries.popitem(last=False)
            self._forget(oldest, forgotten, OVERFLOW)

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key``, or ``default`` when it is absent or expired."""
        found = self._entries.get(key)
        if found is None:
            return default
        if self.ttl is not None and found[0] <= self._clock():
            self.expire()
            return default
        return found[1]

    def __contains__(self, key: object) -> bool:
        found = self._entries.get(key)  # type: ignore[arg-type]
        if found is None:
            return False
        if self.ttl is not None and found[0] <= self._clock():
            self.expire()
            return False
        return True

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Forget ``key`` (not reported); its value, or ``default`` when it was absent or
        expired."""
        found = self._entries.pop(key, None)
        if found is None:
            return default
        if self.ttl is not None and found[0] <= self._clock():
            self._forget(key, found[1], EXPIRED)
            return default
        return found[1]

    def expire(self) -> int:
        """Forget every expired entry now; how many there were."""
        if self.ttl is None:
            return 0
        entries = self._entries
        now = self._clock()
        forgotten = 0
        while entries:
            key = next(iter(entries))
            deadline, value = entries[key]
            if deadline > now:
                break
            del entries[key]
            forgotten += 1
            self._forget(key, value, EXPIRED)
        return forgotten

    def items(self) -> list[tuple[K, V]]:
        """The live entries, oldest first (a snapshot; expired ones are forgotten first)."""
        self.expire()
        return [(key, value) for key, (_, value) in self._entries.items()]

    def values(self) -> list[V]:
        """The live values, oldest first (a snapshot)."""
        return [value for _, value in self.items()]

    def take(self) -> list[tuple[K, V]]:
        """Every live entry, oldest first, and forget them all (not reported)."""
        taken = self.items()
        self._entries.clear()
        return taken

    def clear(self) -> None:
        """Forget everything (not reported)."""
        self._entries.clear()

    def __len__(self) -> int:
        """Entries held right now, expired ones not yet forgotten included (cheap)."""
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        return iter([key for key, _ in self.items()])

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __repr__(self) -> str:
        return f"BoundedMap(size={len(self._entries)}, max_size={self.max_size}, ttl={self.ttl})"

    def _forget(self, key: K, value: V, reason: str) -> None:
        if self._on_forget is not None:
            self._on_forget(key, value, reason)
