"""A browser's entry into a conversation's room, once the namespace has checked the join
(the browser's, its admission, the application's hook): inside the delivery's ``joining``
(Redis: the room subscribed, its log read) it enters with catch-up
(:class:`~kernel_ext.relay.catch_up.CatchUp`) or, without catch-up, gets the terminals held
for late joiners (:class:`~kernel_ext.relay.emitted_terminals.EmittedTerminals`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from kernel_ext.observability.count_names import (
    BAD_CURSOR,
    IGNORED_CURSORS,
    JOINS,
    LATE_TERMINALS,
    REJOINS,
)
from kernel_ext.protocol import JOIN_EVENT
from kernel_ext.relay.catch_up import CatchUp
from kernel_ext.relay.emitted_terminals import EmittedTerminals
from kernel_ext.relay.replay import read_cursors

__all__ = ["Entry"]

Count = Callable[..., None]
Reject = Callable[[str, str, str], None]
RoomStep = Callable[[str, str], Awaitable[None]]


class Entry:
    """Puts browsers into rooms, caught up (module docstring). ``enter``, ``leave``: the
    namespace's own (sid, room); ``send_to``: emit ``tool_event_stream`` to one sid;
    ``in_room``: whether a sid is in a room on this process."""

    def __init__(
        self,
        *,
        catch_up: CatchUp | None,
        terminals: EmittedTerminals,
        max_cursors: int,
        enter: RoomStep,
        leave: RoomStep,
        send_to: Callable[[Any, str], Awaitable[None]],
        in_room: Callable[[str, str], bool],
        count: Count,
        reject: Reject,
    ) -> None:
        self.catch_up = catch_up
        self.terminals = terminals
        self.max_cursors = max_cursors
        self._enter = enter
        self._leave = leave
        self._send_to = send_to
        self._in_room = in_room
        self._count = count
        self._reject = reject

    async def enter(
        self,
        sid: str,
        room: str,
        data: Any,
        joining: contextlib.AbstractAsyncContextManager[Any],
    ) -> dict[str, Any]:
        """Put ``sid`` into ``room`` within ``joining``; the join's acknowledgement."""
        if self.catch_up is None:
            async with joining:
                await self._enter(sid, room)
            self._count(JOINS)
            late = self.terminals.late(sid, room)
            for raw in late:
                await self._send_to(raw, sid)
            if late:
                self._count(LATE_TERMINALS, len(late))
            return {"ok": True}
        cursors, ignored = read_cursors(data.get("have"), self.max_cursors)
        if ignored:  # counted and rarely logged; the join itself goes on
            self._reject(sid, BAD_CURSOR, f"{ignored} cursor(s) of {JOIN_EVENT}")
            self._count(IGNORED_CURSORS, ignored)
        async with joining:
            rejoin = self._in_room(sid, room)
            sent = await self.catch_up.join(
                sid,
                room,
                cursors,
                rejoin=rejoin,
                have="have" in data,
                enter=lambda: self._enter(sid, room),
                leave=lambda: self._leave(sid, room),
            )
        self._count(JOINS)
        if sent is None:
            self._count(REJOINS)
            return {"ok": True}
        # What the catch-up sent is told to a browser that asked (it sent ``have``, an empty
        # list included) and to any whose catch-up was limited; any other gets the
        # acknowledgement it always got.
        return {"ok": True, "replay": sent} if "have" in data or "limited" in sent else {"ok": True}
