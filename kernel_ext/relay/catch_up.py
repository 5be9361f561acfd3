"""A browser's join with catch-up: what it lacks of a conversation's held streams, sent as
its connection drains, within a budget per connection, then the live blocks.

:class:`CatchUp` is the relay's one home of that (docs/contracts.md, "Catch-up";
docs/operations.md, "Catch-up"). Guarantees:

* **Exactly once per join.** The browser enters the room in the same step as the last look
  at the memory finds nothing more to send: a block is held in the same step as the live
  emit that picks its browsers, so every block reaches it once, by the catch-up or live,
  and the catch-up comes first.
* **Back-pressure** (:class:`~kernel_ext.relay.backpressure.BackPressure`): each block
  waits until the browser holds under a quarter of its bounds, and its turn within the
  process's bound on catch-ups in flight. A held block is encoded once, and that packet is
  shared by every catch-up that sends it meanwhile.
* **A budget per connection** (``catch_up_budget`` bytes a minute, refilled continuously,
  shared by the connection's catch-ups as they send, concurrent ones included): a block
  that does not fit what is left is not sent, nor anything after it; the browser
  still enters the room, and the acknowledgement says ``"limited": true``, with what it
  lacks in ``missing`` (counted ``catch_up_limited``). A join of a room the connection is
  in already, without ``have``, sends nothing (counted ``rejoins``): it had everything since
  it entered. A renderer that rejoins with ``have`` gets only what it lacks.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from kernel_ext._shared import compat as _compat
from kernel_ext.errors import ConfigError, check_positive_ints
from kernel_ext.observability.count_names import (
    CATCH_UP_LIMITED,
    CATCH_UP_WAITS,
    REPLAY_BLOCKS,
    REPLAY_MISSING,
)
from kernel_ext.protocol import TOOL_EVENT_STREAM
from kernel_ext.relay._send import event_text
from kernel_ext.relay.backpressure import BackPressure
from kernel_ext.relay.emitted_terminals import EmittedTerminals
from kernel_ext.relay.replay import Cursors, ReplayMemory, StreamKey

__all__ = ["DEFAULT_CATCH_UP_BUDGET", "CatchUp"]

DEFAULT_CATCH_UP_BUDGET = 16 << 20
"""``catch_up_budget``'s default: 16 MiB a minute per connection (four whole conversations
at their default bound)."""

_ROUNDS = 8
"""Rounds a catch-up takes at most to find nothing more to send before the browser enters
the room (each sends what arrived during the one before)."""
_MINUTE = 60.0

Enter = Callable[[], Awaitable[Any]]


class CatchUp:
    """The catch-ups of one relay's joins (module docstring).

    Args:
        memory: the held streams (the relay's catch-up memory).
        back_pressure: the bounds the catch-ups keep to.
        terminals: told of each terminal a catch-up sent.
        count: the relay's counter (``count(name, n)``).
        budget: bytes a connection's catch-ups may send a minute (``None``: no budget).
    """

    def __init__(
        self,
        memory: ReplayMemory,
        back_pressure: BackPressure,
        terminals: EmittedTerminals,
        count: Callable[..., None],
        *,
        budget: int | None = DEFAULT_CATCH_UP_BUDGET,
    ) -> None:
        if budget is not None:
            check_positive_ints(catch_up_budget=budget)
            if budget < memory.conversation_bytes:
                raise ConfigError(
                    "catch_up_budget must hold one conversation "
                    f"(replay_conversation_bytes, {memory.conversation_bytes}), got {budget}"
                )
        self.memory = memory
        self.back_pressure = back_pressure
        self.budget = budget
        self._terminals = terminals
        self._count = count
        # Per connection: [bytes left, when], shared by its catch-ups as they send.
        self._budgets: dict[str, list[float]] = {}
        self._text: Callable[[bytes], str] | None = None
        # The packets of held blocks the running catch-ups sent, by the block's compact JSON,
        # shared by every catch-up meanwhile; let go when none runs, or past the memory's size.
        self._packets: dict[bytes, Any] = {}
        self._packet_bytes = 0
        self._running = 0

    def forget(self, sid: str) -> None:
        """The connection ``sid`` is gone."""
        self._budgets.pop(sid, None)

    def _take(self, account: list[float] | None, size: int) -> bool:
        """Take ``size`` bytes from a connection's budget (refilled up to now), if it has
        them."""
        budget = self.budget
        if account is None or budget is None:
            return True
        now = time.monotonic()
        left = min(float(budget), account[0] + (now - account[1]) * budget / _MINUTE)
        account[1] = now
        if size > left:
            account[0] = left
            return False
        account[0] = left - size
        return True

    async def join(
        self,
        sid: str,
        room: str,
        cursors: Cursors,
        *,
        rejoin: bool,
        have: bool,
        enter: Enter,
        leave: Enter,
    ) -> dict[str, Any] | None:
        """Catch the browser ``sid`` up on ``room`` and put it into the room (``enter``);
        ``rejoin``: it is in the room already (``leave`` takes it out first, unless it sent
        no ``have``: then nothing is sent and ``None`` returned). The acknowledgement's
        ``replay``: ``blocks`` and ``streams`` sent, ``missing`` per stream, and
        ``"limited": true`` when the budget stopped it."""
        if rejoin:
            if not have:
                return None
            await leave()
        server = self.back_pressure.server
        eio = server.eio
        namespace = self.back_pressure.namespace
        eio_sid = server.manager.eio_sid_from_sid(sid, namespace)
        if self._text is None:
            self._text = event_text(server, namespace, TOOL_EVENT_STREAM)
        account = None
        if self.budget is not None and eio_sid is not None:
            # Made here, dropped by forget(): one a live connection's joins share.
            account = self._budgets.setdefault(sid, [float(self.budget), time.monotonic()])
        sent = 0
        streams: set[StreamKey] = set()
        missing: dict[StreamKey, int] = {}
        cursors = dict(cursors)
        limited = entered = gone = False
        self._running += 1
        try:
            for round_ in range(_ROUNDS):
                held, _, lost = self.memory.catch_up_held(room, cursors)
                if not held or limited or round_ == _ROUNDS - 1:
                    # Nothing more (or blocks keep coming: the last of them go after the
                    # entry; or the budget is spent: the rest is missing).
                    await enter()  # no await before it since catch_up_held()
                    entered = True
                for key, n in lost.items():
                    missing.setdefault(key, n)
                unsent = held
                if not limited:
                    for index, (key, seq, data, terminal) in enumerate(held):
                        if not self._take(account, len(data)):
                            limited = True
                            unsent = held[index:]
                            break
                        if not await self._send(sid, eio, eio_sid, data):
                            gone = True
                            break
                        sent += 1
                        streams.add(key)
                        cursor, ended = cursors.get(key, (-1, False))
                        cursors[key] = (max(cursor, seq), ended or terminal)
                        if terminal:
                            self._terminals.caught_up({"callId": key[0], "taskId": key[1]}, sid)
                    else:
                        unsent = []
                if gone:
                    break
                if entered:
                    for key, *_ in unsent:
                        missing[key] = missing.get(key, 0) + 1
                    break
        finally:
            self._running -= 1
            if not self._running:
                self._packets.clear()
                self._packet_bytes = 0
        if sent:
            self._count(REPLAY_BLOCKS, sent)
        if missing:
            self._count(REPLAY_MISSING, len(missing))
        replay: dict[str, Any] = {
            "blocks": sent,
            "streams": len(streams),
            "missing": [
                {"callId": call_id, "taskId": task_id, "blocks": n}
                for (call_id, task_id), n in missing.items()
            ],
        }
        if limited:
            self._count(CATCH_UP_LIMITED)
            replay["limited"] = True
        return replay

    def _packet(self, data: bytes) -> Any:
        """The Engine.IO packet of a held block, made once while catch-ups run."""
        packet = self._packets.get(data)
        if packet is None:
            assert self._text is not None
            if self._packet_bytes > self.memory.total_bytes:
                self._packets.clear()
                self._packet_bytes = 0
            packet = self._packets[data] = _compat.catch_up_packet(self._text(data))
            self._packet_bytes += len(data)
        return packet

    async def _send(self, sid: str, eio: Any, eio_sid: str | None, data: bytes) -> bool:
        """Queue one held block to the browser once it has room (per browser and in all);
        whether its connection is still there."""
        back_pressure = self.back_pressure
        if eio_sid is None:
            return False
        size = len(data)
        while True:
            if not back_pressure.has_room(eio_sid):
                self._count(CATCH_UP_WAITS)
                if not await back_pressure.drained(sid):
                    return False
            await back_pressure.acquire(size)
            if back_pressure.has_room(eio_sid):
                break  # no await from here to the send
            back_pressure.sent(size)  # another catch-up filled it meanwhile: wait again
        try:
            if _compat.connection_queue(eio, eio_sid) is None:
                return False
            await _compat.send_packet(eio, eio_sid, self._packet(data))
        finally:
            back_pressure.sent(size)
        return True
