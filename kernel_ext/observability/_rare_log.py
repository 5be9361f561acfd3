"""Cheap helpers for hot paths (private to kernel_ext).

* :class:`RareLog` logs a recurring fault on its 1st, 2nd, 4th, 8th … occurrence, so a flood
  of one bad input costs a handful of log lines, while every occurrence is counted;
  :func:`plural` words a count in its lines ("seen 1 time", "seen 2 times").
* :class:`BatchedCount` adds to an OpenTelemetry counter in batches: with an SDK meter
  provider one ``Counter.add`` per block is too dear for the publish path.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from opentelemetry.metrics import Counter

from kernel_ext.errors import check_positive_ints
from kernel_ext.worker import _fork

__all__ = ["BatchedCount", "RareLog", "is_rare", "plural"]

_T = TypeVar("_T")


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, the noun with an ``s`` unless the count is exactly one:
    ``plural(1, "time")`` is ``"1 time"``, ``plural(0, "time")`` ``"0 times"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def is_rare(seen: int) -> bool:
    """Whether a fault's ``seen``-th occurrence is one to log: the 1st, 2nd, 4th, 8th …"""
    return seen > 0 and seen & (seen - 1) == 0


class RareLog:
    """Counts faults by reason and logs each reason's 1st, 2nd, 4th, 8th … occurrence.

    Reasons should come from a small fixed set (they are dictionary keys). Never raises.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        _fork.reset_in_child(self._reset_after_fork)

    def _reset_after_fork(self) -> None:
        """In a forked child: a new lock (another thread of the parent may have held it)."""
        self._lock = threading.Lock()

    def __call__(
        self,
        reason: str,
        message: str,
        *args: object,
        level: int = logging.WARNING,
        exc_info: bool = False,
    ) -> int:
        """Count one ``reason``; log ``message % args`` when the count is a power of two.

        Returns the number of times ``reason`` has been seen, this one included.
        """
        seen = self.note(reason)
        if is_rare(seen):
            with contextlib.suppress(Exception):  # a broken handler must not reach the caller
                self._logger.log(
                    level,
                    message + " [%s; seen %s]",
                    *args,
                    reason,
                    plural(seen, "time"),
                    exc_info=exc_info,
                )
        return seen

    def note(self, reason: str) -> int:
        """Count one ``reason`` without logging; the number of times it has been seen, this
        one included (:func:`is_rare` says whether to log it)."""
        with self._lock:
            seen = self._counts.get(reason, 0) + 1
            self._counts[reason] = seen
        return seen

    def counts(self) -> dict[str, int]:
        """A snapshot of the occurrences seen so far, by reason."""
        with self._lock:
            return dict(self._counts)


class BatchedCount:
    """Adds one to an OpenTelemetry counter per :meth:`add_one`, ``batch`` at a time.

    Every ``batch``-th :meth:`add_one` adds what was counted and not yet added (``batch``,
    unless a :meth:`flush` came between); :meth:`flush` adds the rest. Totals are exact.
    Never raises.

    :meth:`add_one` runs no Python code on ``batch - 1`` calls of ``batch``: it is the
    ``__next__`` of ``map(next, cycle([ticks] * (batch - 1) + [self]))``, so each call
    advances an ``itertools.count`` (C, atomic under the GIL) and every ``batch``-th one calls
    :meth:`__next__` here, which adds: the publishing path runs no Python frame per block
    for it. The count of ticks is read by advancing it too (:meth:`_ticks_now`).
    """

    __slots__ = (
        "__weakref__",
        "_added",
        "_attributes",
        "_counter",
        "_lock",
        "_reads",
        "_ticks",
        "add_one",
    )

    def __init__(self, counter: Counter, attributes: Mapping[str, str], batch: int = 64) -> None:
        check_positive_ints(batch=batch)
        self._counter = counter
        self._attributes = dict(attributes)
        self._ticks = itertools.count()
        self._reads = 0  # advances of _ticks that were readings, not occurrences
        self._added = 0  # occurrences added to the counter so far
        self._lock = threading.Lock()
        ticker: list[Iterator[object]] = [self._ticks] * (batch - 1)
        ticker.append(self)
        self.add_one: Callable[[], object] = map(next, itertools.cycle(ticker)).__next__
        """Count one occurrence."""
        _fork.reset_in_child(self._reset_after_fork)

    def _reset_after_fork(self) -> None:
        """In a forked child: a new lock; the parent's occurrences are its own (counted as
        added, never added again)."""
        self._lock = threading.Lock()
        self._added = self._ticks_now()

    def _ticks_now(self) -> int:
        """Occurrences counted so far (lock held). Reading advances the count: noted."""
        ticks = next(self._ticks) - self._reads
        self._reads += 1
        return ticks

    def __iter__(self) -> BatchedCount:
        return self

    def __next__(self) -> None:
        """The ``batch``-th occurrence (through :attr:`add_one`): count it, add what is
        outstanding."""
        with self._lock:
            total = next(self._ticks) + 1 - self._reads
            outstanding, self._added = total - self._added, total
        if outstanding > 0:
            with contextlib.suppress(Exception):
                self._counter.add(outstanding, self._attributes)

    def flush(self) -> None:
        """Add the occurrences counted and not yet added."""
        with self._lock:
            total = self._ticks_now()
            outstanding, self._added = total - self._added, total
        if outstanding > 0:
            with contextlib.suppress(Exception):
                self._counter.add(outstanding, self._attributes)
