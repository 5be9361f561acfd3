"""Helpers for testing code that uses kernel_ext, and for demos: parts that stand in for the
real ones in process, with no network. Nothing in the library itself imports this package.

* :class:`MemoryEmitter` — a sender that records what it would send, in order;
* :mod:`kernel_ext.testing.a2a_peer` — a scripted A2A colleague (a real a2a-sdk server);
* :mod:`kernel_ext.testing.browser` — driving the reference renderer in a real Chromium.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from kernel_ext.emit import Emitter
from kernel_ext.emit.base import remembers_arguments
from kernel_ext.protocol import CHAT_EVENT, TOOL_EVENT_STREAM
from kernel_ext.stream import Outgoing, OutgoingBlock, OutgoingChatEvent, StreamHub

__all__ = ["MemoryEmitter", "Record"]

Record = tuple[str, dict[str, Any]]
"""``(room, block or event)``: one thing a :class:`MemoryEmitter` recorded."""


class MemoryEmitter(Emitter):
    """Records what it would send, in order, for tests: ``records`` holds
    ``(room, block)`` pairs (the block as its wire dict), ``chat_events`` the
    ``(room, event)`` pairs of ``chat_event`` snapshots, ``order`` both as
    ``(event name, room, data)``. Always healthy.

    Wait for something with :meth:`wait_for`; on the emitter's own loop only.
    """

    sender = "memory"

    @remembers_arguments
    def __init__(self, *, hub: StreamHub | None = None, batch_max: int = 256) -> None:
        super().__init__(hub=hub, batch_max=batch_max)
        self.records: list[Record] = []
        self.chat_events: list[Record] = []
        self.order: list[tuple[str, str, dict[str, Any]]] = []
        self._changed = asyncio.Event()

    async def _send(self, items: list[Outgoing]) -> None:
        consumer = self.port
        sent = 0
        for item in items:
            if isinstance(item, OutgoingBlock):
                self.records.append((item.room, item.block))
                self.order.append((TOOL_EVENT_STREAM, item.room, item.block))
                sent += 1
            elif isinstance(item, OutgoingChatEvent):
                self.chat_events.append((item.room, item.event))
                self.order.append((CHAT_EVENT, item.room, item.event))
        if sent:
            consumer.delivered(sent)
        if items:
            self._changed.set()

    def blocks(self, room: str | None = None) -> list[dict[str, Any]]:
        """The recorded blocks (of ``room`` when given), in order."""
        return [block for r, block in self.records if room is None or r == room]

    def terminals(self, room: str | None = None) -> list[dict[str, Any]]:
        """The recorded terminal blocks (``done``/``aborted``), in order."""
        return [b for b in self.blocks(room) if b.get("state") in ("done", "aborted")]

    def clear(self) -> None:
        """Forget what was recorded."""
        self.records.clear()
        self.chat_events.clear()
        self.order.clear()

    async def wait_for(
        self, predicate: Callable[[list[Record]], bool], timeout: float = 5.0
    ) -> list[Record]:
        """Wait until ``predicate(records)`` is true; return the records.

        Raises ``TimeoutError`` (the builtin) after ``timeout`` seconds, naming how many
        records there were.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if predicate(self.records):
                return self.records
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(
                    f"MemoryEmitter.wait_for: condition not met within {timeout} s "
                    f"({len(self.records)} blocks recorded)"
                )
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
