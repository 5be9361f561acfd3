"""Back-pressure: what each browser of this process may have queued, and acknowledgements
paced by it (docs/operations.md, "Back-pressure").

:class:`BackPressure` is the relay's one home of those bounds: which browsers a frame's
running blocks skip (:meth:`BackPressure.reserve`), and when a frame's acknowledgement may
go (:meth:`BackPressure.pace`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from kernel_ext.ledger import ACK_PACE_TIMEOUTS, BROWSER_QUEUE_FULL, PACED_ACKS
from kernel_ext.relay._log import rare

__all__ = ["BackPressure"]

_PACE_POLL = 0.005
"""Seconds between two looks at the browsers' queues while acknowledgements wait (the
queues are python-engineio's ``asyncio.Queue``: nothing to wait on below a level); one
task looks for every waiting acknowledgement."""


class BackPressure:
    """The bounds of one relay's browsers on this process (``browser_queue_max``:
    :class:`~kernel_ext.relay.ChatRelay`), and the acknowledgements waiting for them."""

    def __init__(
        self,
        namespace: str,
        count: Callable[..., None],
        *,
        browser_queue_max: int | None,
        ack_pace_timeout: float,
    ) -> None:
        self.namespace = namespace
        self._count = count
        self.browser_queue_max = browser_queue_max
        self.ack_pace_timeout = ack_pace_timeout
        self.server: Any = None  # the relay's server, once it is mounted (attach)
        self._lagging: set[str] = set()  # browsers (sids) an acknowledgement gave up on
        # Running blocks on their way into a browser's queue (a frame's emits not yet
        # returned; they overlap: _emit_in_order), so the queue alone would undercount.
        self._sending: dict[str, int] = {}
        # Acknowledgements waiting for their rooms' browsers: (rooms, waiter, deadline).
        self._pacing: list[tuple[list[str], asyncio.Future[None], float]] = []
        self._pacer: asyncio.Task[None] | None = None

    def attach(self, server: Any) -> None:
        """The relay is mounted on ``server``."""
        self.server = server

    def forget(self, sid: str) -> None:
        """The browser ``sid`` is gone."""
        self._lagging.discard(sid)

    async def aclose(self) -> None:
        """Send the acknowledgements that wait for the browsers now. Idempotent."""
        pacer, self._pacer = self._pacer, None
        if pacer is not None:
            pacer.cancel()
        paced, self._pacing = self._pacing, []
        for _, waiter, _ in paced:  # acknowledge them now
            if not waiter.done():
                waiter.set_result(None)

    def _queued(self, eio_sid: str) -> int:
        """Packets python-engineio holds for one browser's connection, not yet written."""
        socket = self.server.eio.sockets.get(eio_sid)
        return socket.queue.qsize() if socket is not None else 0

    def _behind(self, rooms: list[str], level: int) -> list[str]:
        """The browsers of ``rooms`` on this process with ``level`` or more packets queued,
        but for those given up on (forgotten here once below ``level``)."""
        behind = []
        lagging = self._lagging
        for room in dict.fromkeys(rooms):
            for sid, eio_sid in self.server.manager.get_participants(self.namespace, room):
                if self._queued(eio_sid) < level:
                    lagging.discard(sid)
                elif sid not in lagging:
                    behind.append(sid)
        return behind

    async def pace(self, rooms: list[str]) -> None:
        """Return once the browsers of ``rooms`` have room (:meth:`on_kx_blocks`)."""
        assert self.browser_queue_max is not None
        if not self._behind(rooms, self.browser_queue_max // 4):
            return
        self._count(PACED_ACKS)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._pacing.append((rooms, waiter, loop.time() + self.ack_pace_timeout))
        if self._pacer is None or self._pacer.done():
            self._pacer = loop.create_task(self._pace_all())
        await waiter

    async def _pace_all(self) -> None:
        """Release each waiting acknowledgement once its rooms' browsers have room, or at its
        deadline (counted ``ack_pace_timeouts``; the browsers behind are given up on)."""
        assert self.browser_queue_max is not None
        level = self.browser_queue_max // 4
        loop = asyncio.get_running_loop()
        while self._pacing:
            await asyncio.sleep(_PACE_POLL)  # polling with deadlines (docstring of _PACE_POLL)
            now = loop.time()
            waiting = []
            for rooms, waiter, deadline in self._pacing:
                if waiter.done():  # its handler is gone
                    continue
                behind = self._behind(rooms, level)
                if behind and now < deadline:
                    waiting.append((rooms, waiter, deadline))
                    continue
                if behind:
                    self._count(ACK_PACE_TIMEOUTS)
                    self._lagging.update(behind)
                    rare(
                        "ack_pace_timeout",
                        "relay: %d browser(s) read slower than blocks arrive; running blocks "
                        "to them are skipped past %d queued packets",
                        len(behind),
                        self.browser_queue_max,
                    )
                waiter.set_result(None)
            self._pacing = waiting

    def reserve(
        self, blocks: list[tuple[Any, bytes | None]], room: str
    ) -> tuple[list[list[str] | None], dict[str, int]]:
        """Which browsers of ``room`` on this process each of a frame's blocks skips: a
        browser gets the section's running blocks only up to ``browser_queue_max`` packets
        queued or on their way (the rest skip it, counted ``browser_queue_full``, one per
        block and browser); terminals skip no one. Returns the skips per block and what was
        reserved per browser (:meth:`release` it once the emits returned)."""
        bound = self.browser_queue_max
        assert bound is not None
        skips: list[list[str] | None] = [None] * len(blocks)
        reserved: dict[str, int] = {}
        running = [i for i, (raw, _) in enumerate(blocks) if raw.get("state") == "running"]
        if not running:
            return skips, reserved
        sending = self._sending
        for sid, eio_sid in self.server.manager.get_participants(self.namespace, room):
            going = min(len(running), max(0, bound - self._queued(eio_sid) - sending.get(sid, 0)))
            if going:
                sending[sid] = sending.get(sid, 0) + going
                reserved[sid] = going
            if going < len(running):
                self._count(BROWSER_QUEUE_FULL, len(running) - going)
                for i in running[going:]:
                    skip = skips[i]
                    if skip is None:
                        skips[i] = [sid]
                    else:
                        skip.append(sid)
        return skips, reserved

    def release(self, reserved: dict[str, int]) -> None:
        sending = self._sending
        for sid, n in reserved.items():
            left = sending.get(sid, 0) - n
            if left > 0:
                sending[sid] = left
            else:
                sending.pop(sid, None)

    def browser_queues(self, browsers: Iterable[str]) -> dict[str, int]:
        """Packets queued now for this process's browsers: ``browser_queued`` in all and
        ``browser_queue_longest`` (the most for one browser)."""
        manager = self.server.manager
        sizes = [
            self._queued(eio_sid)
            for sid in browsers
            if (eio_sid := manager.eio_sid_from_sid(sid, self.namespace)) is not None
        ]
        return {"browser_queued": sum(sizes), "browser_queue_longest": max(sizes, default=0)}
