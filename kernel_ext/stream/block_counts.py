"""What the stream layer counts, in three words: admitted, delivered, dropped (the names:
:mod:`kernel_ext.observability.count_names`).

* **admitted** — a block the hub's rules let through (attributed, within the throttle and
  the bounds) and queued for the sender; counted on its call too.
* **delivered** — a block the sender saw leave the process (acknowledged by the relay, or
  published to at least one web process through Redis).
* **dropped** — a block that will not reach a browser, by ``reason``: before admission (the
  rules: ``throttled``, ``closed``, …) or after it (the sender: ``disconnected``,
  ``rejected``, …); counted on its call too while the hub holds the call.

An admitted block is later either delivered or dropped (or still queued). A terminal that
had to be rebuilt to be sent is also counted ``degraded`` (not a drop). :class:`Counts`
keeps the totals and adds them to the OpenTelemetry counter ``kernel_ext.blocks``
(``outcome`` = ``admitted`` | ``delivered`` | ``dropped`` | ``degraded``, and ``reason``
for drops) in batches, off the publishing path.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable

from kernel_ext.observability import otel_metrics
from kernel_ext.observability.count_names import (
    ADMITTED,
    CALL_LIMIT,
    CLOSED,
    DEGRADED,
    DELIVERED,
    DROPPED,
    DUPLICATE_TERMINAL,
    ERROR,
    EXPIRED,
    INVALID,
    NO_ROOM,
    NO_SENDER,
    NO_TASK_ID,
    QUEUE_FULL,
    STREAM_LIMIT,
    THROTTLED,
    TOO_LARGE,
    UNATTRIBUTED,
    UNFLUSHED,
)

__all__ = [
    "ADMITTED",
    "CALL_LIMIT",
    "CLOSED",
    "DEGRADED",
    "DELIVERED",
    "DUPLICATE_TERMINAL",
    "ERROR",
    "EXPIRED",
    "INVALID",
    "NO_ROOM",
    "NO_SENDER",
    "NO_TASK_ID",
    "QUEUE_FULL",
    "STREAM_LIMIT",
    "THROTTLED",
    "TOO_LARGE",
    "UNATTRIBUTED",
    "UNFLUSHED",
    "Counts",
]

# The names are the ledger's (kernel_ext.observability.count_names: every count name, once);
# re-exported here for the stream layer. Senders count more reasons of their own;
# docs/operations.md lists them all.
_NOT_DROPS = frozenset({ADMITTED, DELIVERED, DEGRADED})


class Counts:
    """Totals by outcome and drop reason since the hub was made.

    :meth:`add` is for callers that do not hold the hub's lock, :meth:`add_locked` for
    those that do (the lock is the hub's, passed in). Two counts take no call, for the
    publishing path: :attr:`admitted`, a plain int the hub adds to under its lock, and
    :meth:`tick_throttled`, the one lock-free count (the throttle's drop path: an increment
    that races a snapshot may be lost, every other one is counted once).
    """

    __slots__ = (
        "_flushed",
        "_lock",
        "_ticks",
        "_ticks_seen",
        "admitted",
        "tick_throttled",
        "totals",
    )

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.admitted = 0
        self.totals: Counter[str] = Counter()
        self._ticks = itertools.count()
        self._ticks_seen = 0
        self.tick_throttled: Callable[[], int] = self._ticks.__next__
        """Count one ``throttled`` drop without the lock (a C call: no Python frame)."""
        self._flushed: Counter[str] = Counter()

    def add(self, what: str, n: int = 1) -> None:
        """Count ``n`` of ``what`` (takes the lock)."""
        with self._lock:
            self.totals[what] += n

    def add_locked(self, what: str, n: int = 1) -> None:
        """Count ``n`` of ``what``; the lock is held by the caller."""
        self.totals[what] += n

    def snapshot(self) -> dict[str, int]:
        """The totals now (lock held by the caller)."""
        now = next(self._ticks)  # the ticks so far, plus one per snapshot taken before
        if now > self._ticks_seen:
            self.totals[THROTTLED] += now - self._ticks_seen
        self._ticks_seen = now + 1
        if self.admitted:
            self.totals[ADMITTED] = self.admitted
        return dict(self.totals)

    def flush_metrics(self) -> None:
        """Add what was counted since the last flush to ``kernel_ext.blocks``. Never raises."""
        try:
            with self._lock:
                totals = self.snapshot()
            for what, total in totals.items():
                delta = total - self._flushed[what]
                if delta <= 0:
                    continue
                self._flushed[what] = total
                if what in _NOT_DROPS:
                    otel_metrics.blocks.add(delta, {"outcome": what})
                else:
                    otel_metrics.blocks.add(delta, {"outcome": DROPPED, "reason": what})
        except Exception:
            pass
