"""What goes out of the relay to the rooms: a frame's blocks (past the gone-worker and
terminal checks, within back-pressure, by the delivery), chat events, and a gone worker's
``aborted`` blocks. The namespace hands each job here
(:class:`~kernel_ext.relay.ordering.InternalSender` runs them in arrival order).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from kernel_ext.observability.count_names import BLOCKS_EMITTED, CHAT_EVENTS, DUPLICATE_TERMINAL
from kernel_ext.protocol import CHAT_EVENT, TERMINAL_STATES
from kernel_ext.relay._log import rare
from kernel_ext.relay.backpressure import BackPressure
from kernel_ext.relay.delivery import Delivery, deliver
from kernel_ext.relay.emitted_terminals import EmittedTerminals
from kernel_ext.relay.gone_workers import GoneWorkers
from kernel_ext.relay.ordering import InternalSender

__all__ = ["Outbound"]


class Outbound:
    """Emits the relay's jobs to the rooms. ``browsers``: this process's browsers (sid →
    identity, the namespace's own map); ``delivery``: set when the namespace is
    registered."""

    def __init__(
        self,
        *,
        back_pressure: BackPressure,
        terminals: EmittedTerminals,
        workers: GoneWorkers,
        browsers: dict[str, Any],
        count: Callable[..., None],
    ) -> None:
        self.back_pressure = back_pressure
        self.terminals = terminals
        self.workers = workers
        self.browsers = browsers
        self._count = count
        self.delivery: Delivery | None = None

    def _delivery(self) -> Delivery:
        delivery = self.delivery
        assert delivery is not None  # set when the namespace is registered
        return delivery

    def listeners(self, room: str) -> Iterator[str]:
        """The sids of ``room``'s browsers on this process."""
        delivery = self._delivery()
        manager = delivery.server.manager
        return (sid for sid, _ in manager.get_participants(delivery.namespace, room))

    async def run(self, conn: InternalSender, kind: str, room: str, payload: Any) -> int:
        """Emit one job: a frame's valid blocks by room (``kind == "blocks"``, ``payload``
        its (room, blocks) sections) or a chat event; how many blocks went out."""
        delivery = self._delivery()
        if kind != "blocks":
            try:
                await delivery.emit(CHAT_EVENT, payload, room=room)
                self._count(CHAT_EVENTS)
            except asyncio.CancelledError:
                raise
            except Exception:
                rare("emit_failed", "relay: emitting to room %r failed", room, exc_info=True)
            return 0
        # On Redis, the frame's publishes go as one pipeline, in order, once it is emitted
        # here (a round trip per frame, not per block): the delivery's frame().
        async with delivery.frame():
            return await self._emit_sections(conn, payload)

    async def _emit_sections(self, conn: InternalSender, payload: Any) -> int:
        """Emit a frame's (room, blocks) sections in order; how many blocks went out."""
        emitted = 0
        for room, raws in payload:
            blocks = []
            for raw, data in raws:
                if not self.workers.note(conn.worker, raw, room):
                    continue
                if raw.get("state") in TERMINAL_STATES and not self.terminals.admit(
                    raw, room, self.listeners(room), self.browsers
                ):
                    self._count(DUPLICATE_TERMINAL)
                    continue
                blocks.append((raw, data))
            try:
                await self._emit_in_order(blocks, room)
            except asyncio.CancelledError:
                raise
            except Exception:
                rare("emit_failed", "relay: emitting to room %r failed", room, exc_info=True)
                continue
            emitted += len(blocks)
            self._count(BLOCKS_EMITTED, len(blocks))
        return emitted

    async def _emit_in_order(self, blocks: list[tuple[Any, bytes | None]], room: str) -> None:
        """One ``tool_event_stream`` per block, in order, by the server's delivery
        (:mod:`kernel_ext.relay.delivery`), each block held for catch-up by it; a browser
        that is behind skips running blocks where the delivery lets back-pressure skip."""
        delivery = self._delivery()
        if not self.back_pressure.bounded or not delivery.reserves:
            skips: list[list[str] | None] = [None] * len(blocks)
            reserved: dict[str, list[int]] = {}
        else:
            skips, reserved = self.back_pressure.reserve(blocks, room)
        try:
            await deliver(delivery, blocks, room, skips)
        finally:
            self.back_pressure.release(reserved)

    async def emit_ended(self, room: str, raw: dict[str, Any]) -> bool:
        """Emit one ``aborted`` block of a gone worker's stream; whether it went out."""
        if not self.terminals.admit(raw, room, self.listeners(room), self.browsers):
            return False  # its terminal went out already (another connection re-sent it)
        try:
            await self._delivery().block(raw, room)
        except asyncio.CancelledError:
            raise
        except Exception:
            rare("emit_failed", "relay: emitting to room %r failed", room, exc_info=True)
            return False
        return True
