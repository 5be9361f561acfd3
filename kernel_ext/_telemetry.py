"""Cheap helpers for hot paths (private to kernel_ext).

* :class:`RareLog` logs a recurring fault on its 1st, 2nd, 4th, 8th … occurrence, so a flood
  of one bad input costs a handful of log lines, while every occurrence is counted.
* :class:`BatchedCount` adds to an OpenTelemetry counter in batches: with an SDK meter
  provider one ``Counter.add`` costs about 5 µs, too much for the publish path.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Mapping
from typing import TypeVar

from opentelemetry.metrics import Counter

from kernel_ext import _fork
from kernel_ext.errors import check_positive_ints

__all__ = ["BatchedCount", "RareLog", "is_rare"]

_T = TypeVar("_T")


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
        _fork.reset_in_child(self)

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
                    message + " [%s; seen %d times]",
                    *args,
                    reason,
                    seen,
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

    :meth:`add_one` is one ``next()`` on an ``itertools.count`` (atomic under the GIL) and,
    every ``batch``-th time, one ``Counter.add(batch)``. :meth:`flush` adds what has not
    been added yet. Totals are exact, except for an increment that races a flush.
    Never raises.
    """

    __slots__ = ("__weakref__", "_attributes", "_batch", "_counter", "_last", "_lock", "_ticks")

    def __init__(self, counter: Counter, attributes: Mapping[str, str], batch: int = 64) -> None:
        check_positive_ints(batch=batch)
        self._counter = counter
        self._attributes = dict(attributes)
        self._batch = batch
        self._last = batch - 1
        self._ticks = itertools.count()
        self._lock = threading.Lock()
        _fork.reset_in_child(self)

    def _reset_after_fork(self) -> None:
        """In a forked child: a new lock; the parent's uncounted occurrences are its own."""
        self._lock = threading.Lock()
        self._ticks = itertools.count()

    def add_one(self) -> None:
        """Count one occurrence."""
        if next(self._ticks) % self._batch == self._last:
            with contextlib.suppress(Exception):
                self._counter.add(self._batch, self._attributes)

    def flush(self) -> None:
        """Add the occurrences counted since the last full batch."""
        with self._lock:
            ticks, self._ticks = self._ticks, itertools.count()
        # ``next`` returns how many ticks were taken; full batches were added already.
        rest = next(ticks) % self._batch
        if rest:
            with contextlib.suppress(Exception):
                self._counter.add(rest, self._attributes)
