"""The terminals a relay emitted: a re-send is not shown twice, a late joiner still gets it.

:class:`EmittedTerminals` keeps two bounded memories
(:class:`~kernel_ext._shared.bounded.BoundedMap`):

* **Sent.** Each terminal ``(callId, taskId)`` emitted recently — at most ``remember`` of
  them, each for ``remember_ttl`` seconds — with the browsers (sids) it went to. The same
  terminal again (a sender re-sending after a lost acknowledgement) is a duplicate and is
  not emitted — unless every browser it went to has disconnected since (this process was
  frozen: it emitted into connections that were already dead); then it goes out again
  (counted ``terminal_reemitted``) and is remembered anew.
* **Held.** A terminal emitted into a room with no browser connected to this process
  (typically: the web process restarted, and the worker re-sent the terminal before the
  browsers re-joined) is kept — at most ``hold`` of them, each for ``hold_ttl`` seconds,
  counted ``held_terminals`` — and sent to each browser that joins that room meanwhile,
  once.

A bound of 0 (or less) turns that memory off. Used from the event loop's thread only. The
relay's options ``dedup_terminals`` and ``hold_terminals`` set the two; the worker side's
terminals still to deliver are :class:`~kernel_ext.emit.owed_terminals.OwedTerminals`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

from kernel_ext._shared.bounded import BoundedMap
from kernel_ext.observability.count_names import HELD_TERMINALS, TERMINAL_REEMITTED

__all__ = ["EmittedTerminals"]


class EmittedTerminals:
    """What a relay remembers of the terminals it emitted (module docstring); ``count`` is
    the relay's counter, ``clock`` the monotonic clock of the ttls (tests pass a fake).

    Raises:
        ConfigError: a ttl that is not a positive number, for a memory that is on.
    """

    def __init__(
        self,
        *,
        remember: int,
        remember_ttl: float,
        hold: int,
        hold_ttl: float,
        count: Callable[[str, int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # (callId, taskId) -> the sids it was emitted to.
        self._sent: BoundedMap[tuple[Any, Any], tuple[str, ...]] | None = (
            BoundedMap(remember, remember_ttl, clock=clock) if remember > 0 else None
        )
        # (room, callId, taskId) -> (the block, the sids it was sent to since).
        self._held: BoundedMap[tuple[str, Any, Any], tuple[Any, set[str]]] | None = (
            BoundedMap(hold, hold_ttl, clock=clock) if hold > 0 else None
        )
        self._count = count

    @property
    def remembered(self) -> int:
        """Terminals remembered as sent, now."""
        return len(self._sent) if self._sent is not None else 0

    @property
    def held(self) -> int:
        """Terminals held for late joiners, now."""
        return len(self._held) if self._held is not None else 0

    def admit(
        self,
        raw: Mapping[str, Any],
        room: str,
        listeners: Iterable[str],
        connected: Container[str],
    ) -> bool:
        """Whether to emit the terminal ``raw`` to ``room`` now; ``listeners`` are the sids
        of the room's browsers on this process, ``connected`` every browser connected to
        it. ``False`` for a duplicate; otherwise it is remembered as sent to
        ``listeners`` and, when there are none, held for late joiners."""
        key = (raw.get("callId"), raw.get("taskId"))
        sids = tuple(listeners)
        sent = self._sent
        if sent is not None:
            went_to = sent.get(key)
            if went_to is not None:
                if not went_to or any(sid in connected for sid in went_to):
                    return False
                self._count(TERMINAL_REEMITTED, 1)  # every connection it went to was dead
            sent.set(key, sids, refresh=True)
            sent.expire()
        held = self._held
        if held is not None and not sids:
            held.set((room, *key), (raw, set()), refresh=True)
            held.expire()
            self._count(HELD_TERMINALS, 1)
        return True

    def emitted(self, key: tuple[Any, Any]) -> bool:
        """Whether a terminal of stream ``key`` (``(callId, taskId)``) is remembered as
        emitted (the sent memory; always ``False`` with it off)."""
        return self._sent is not None and key in self._sent

    def caught_up(self, raw: Mapping[str, Any], sid: str) -> None:
        """The terminal ``raw`` went to the browser ``sid`` by a catch-up: a re-send of it
        is a duplicate while that browser is connected."""
        sent = self._sent
        key = (raw.get("callId"), raw.get("taskId"))
        if sent is not None and key in sent:
            sent.set(key, (*(sent.get(key) or ()), sid))

    def late(self, sid: str, room: str) -> list[Any]:
        """The held terminals of ``room`` not yet sent to the browser ``sid``, oldest first
        (marked as sent to it)."""
        if self._held is None:
            return []
        late = []
        for (held_room, _, _), (raw, served) in self._held.items():
            if held_room == room and sid not in served:
                served.add(sid)
                late.append(raw)
        return late
