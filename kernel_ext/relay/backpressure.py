"""Back-pressure (docs/operations.md, "Back-pressure"): :class:`BackPressure` is the
relay's one home of what each browser of this process may have queued (packets and bytes
python-engineio holds for it, live blocks and catch-up together), of a frame's
acknowledgement paced by its rooms' browsers, and of catch-up bytes in flight in all, as
:mod:`kernel_ext._shared.compat` meters them. The rules: docs/contracts.md, "The relay's
back-pressure".
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kernel_ext._shared import compat as _compat
from kernel_ext.errors import ConfigError, check_positive_ints, check_positive_numbers
from kernel_ext.observability.count_names import (
    ACK_PACE_TIMEOUTS,
    BROWSER_QUEUE_FULL,
    BROWSER_QUEUE_LONGEST,
    BROWSER_QUEUE_LONGEST_BYTES,
    BROWSER_QUEUE_PEAK,
    BROWSER_QUEUE_PEAK_BYTES,
    BROWSER_QUEUED,
    BROWSER_QUEUED_BYTES,
    BROWSERS_STALLED,
    CATCH_UP_INFLIGHT,
    CATCH_UP_INFLIGHT_PEAK,
    CATCH_UP_POOL_WAITS,
    PACED_ACKS,
)
from kernel_ext.protocol import DEFAULT_MAX_BLOCK_BYTES
from kernel_ext.relay._log import rare

__all__ = [
    "DEFAULT_BROWSER_QUEUE_BYTES",
    "DEFAULT_BROWSER_STALL_TIMEOUT",
    "DEFAULT_CATCH_UP_INFLIGHT_BYTES",
    "BackPressure",
]

DEFAULT_BROWSER_QUEUE_BYTES = 8 << 20
"""``browser_queue_bytes``' default: 8 MiB queued for one browser."""
DEFAULT_CATCH_UP_INFLIGHT_BYTES = 32 << 20
"""``catch_up_inflight_bytes``' default: 32 MiB of catch-ups queued on this process."""
DEFAULT_BROWSER_STALL_TIMEOUT = 60.0
"""``browser_stall_timeout``'s default: a minute at a bound without reading."""

_PACE_POLL = 0.005
"""Seconds between two looks at the browsers' queues while acknowledgements wait; one
task looks for every waiting acknowledgement."""

_NO_BOUND = 1 << 62


class BackPressure:
    """The bounds of one relay's browsers on this process and of its catch-ups in all
    (module docstring); the relay's options of the same names
    (:class:`~kernel_ext.relay.ChatRelay`)."""

    def __init__(
        self,
        namespace: str,
        count: Callable[..., None],
        *,
        browser_queue_max: int | None = 2_000,
        ack_pace_timeout: float = 1.0,
        browser_queue_bytes: int | None = DEFAULT_BROWSER_QUEUE_BYTES,
        browser_stall_timeout: float | None = DEFAULT_BROWSER_STALL_TIMEOUT,
        catch_up_inflight_bytes: int = DEFAULT_CATCH_UP_INFLIGHT_BYTES,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    ) -> None:
        if browser_queue_max is not None:
            check_positive_ints(browser_queue_max=browser_queue_max)
            if browser_queue_max < 4:
                raise ConfigError(f"browser_queue_max must be at least 4, got {browser_queue_max}")
        check_positive_numbers(ack_pace_timeout=ack_pace_timeout)
        if browser_stall_timeout is not None:
            check_positive_numbers(browser_stall_timeout=browser_stall_timeout)
        check_positive_ints(catch_up_inflight_bytes=catch_up_inflight_bytes)
        if browser_queue_bytes is not None:
            check_positive_ints(browser_queue_bytes=browser_queue_bytes)
        for name, value in (
            ("browser_queue_bytes", browser_queue_bytes),
            ("catch_up_inflight_bytes", catch_up_inflight_bytes),
        ):
            if value is not None and value < max_block_bytes:
                raise ConfigError(
                    f"{name} must hold one block (max_block_bytes, {max_block_bytes}), got {value}"
                )
        self.namespace = namespace
        self._count = count
        self.browser_queue_max = browser_queue_max
        self.browser_queue_bytes = browser_queue_bytes
        self.ack_pace_timeout = float(ack_pace_timeout)
        self.browser_stall_timeout = (
            None if browser_stall_timeout is None else float(browser_stall_timeout)
        )
        self.catch_up_inflight_bytes = catch_up_inflight_bytes
        self._packets_bound = _NO_BOUND if browser_queue_max is None else browser_queue_max
        # Without browser_queue_max, browsers have no bound at all (the relay before
        # back-pressure).
        self._bytes_bound = (
            _NO_BOUND
            if browser_queue_bytes is None or browser_queue_max is None
            else browser_queue_bytes
        )
        self.server: Any = None  # the relay's server, once it is mounted (attach)
        self._metered = False
        self._lagging: set[str] = set()  # browsers (sids) an acknowledgement gave up on
        # Running blocks on their way into a browser's queue (a frame's emits not yet
        # returned; they overlap: _emit_in_order), so the queue alone would undercount:
        # packets and bytes per browser.
        self._sending: dict[str, list[int]] = {}
        # Acknowledgements waiting for their rooms' browsers: (rooms, waiter, deadline).
        self._pacing: list[tuple[list[str], asyncio.Future[None], float]] = []
        self._pacer: asyncio.Task[None] | None = None
        # Browsers a running block skipped, watched until they drain (or stall).
        self._watched: dict[str, asyncio.Task[bool]] = {}
        # Catch-ups in all: bytes queued to browsers (the queues report them) and reserved
        # for a send under way; the catch-ups waiting their turn, first come first served.
        self._inflight = 0
        self._reserved = 0
        self._peak = 0
        self._turns: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def bounded(self) -> bool:
        """Whether browsers have a bound (packets or bytes)."""
        return self._packets_bound < _NO_BOUND or self._bytes_bound < _NO_BOUND

    def attach(self, server: Any) -> None:
        """The relay is mounted on ``server``: its new connections' queues are metered."""
        self.server = server
        self._metered = _compat.meter_queues(server.eio, self._catch_up_queued)

    def forget(self, sid: str) -> None:
        """The browser ``sid`` is leaving: when its connection is closing, what was queued
        for it is let go (its catch-up bytes too)."""
        self._lagging.discard(sid)
        watch = self._watched.pop(sid, None)
        if watch is not None and watch is not asyncio.current_task():  # not the one closing
            watch.cancel()
        eio_sid = self._eio_sid(sid)
        if eio_sid is not None:
            _compat.release_closed(self.server.eio, eio_sid)

    async def aclose(self) -> None:
        """Send the acknowledgements that wait for the browsers now; stop watching the
        browsers. Idempotent."""
        pacer, self._pacer = self._pacer, None
        if pacer is not None:
            pacer.cancel()
        paced, self._pacing = self._pacing, []
        for _, waiter, _ in paced:  # acknowledge them now
            if not waiter.done():
                waiter.set_result(None)
        watched, self._watched = self._watched, {}
        for watch in watched.values():
            watch.cancel()

    def _eio_sid(self, sid: str) -> str | None:
        eio_sid: str | None = self.server.manager.eio_sid_from_sid(sid, self.namespace)
        return eio_sid

    # -- one browser --------------------------------------------------------------------

    def _queued(self, eio_sid: str) -> tuple[int, int]:
        """Packets and bytes python-engineio holds for one browser's connection, not yet
        written."""
        return _compat.queued(self.server.eio, eio_sid)

    def _over(self, eio_sid: str, packets_level: int, bytes_level: int) -> bool:
        packets, size = self._queued(eio_sid)
        return packets >= packets_level or size >= bytes_level

    def _levels(self) -> tuple[int, int]:
        """A quarter of each bound: below both, a browser has room again."""
        return max(1, self._packets_bound // 4), max(1, self._bytes_bound // 4)

    def has_room(self, eio_sid: str) -> bool:
        """Whether the connection ``eio_sid`` holds under a quarter of each bound."""
        return not self.bounded or not self._over(eio_sid, *self._levels())

    async def drained(self, sid: str) -> bool:
        """Return once the browser ``sid`` held under a quarter of each bound: ``True`` (it
        may hold more again by the time the caller runs); ``False`` when it is gone, or when
        it did not get there within
        ``browser_stall_timeout`` seconds — then it is disconnected (counted
        ``browsers_stalled``)."""
        eio_sid = self._eio_sid(sid)
        if eio_sid is None:
            return False
        queue = _compat.connection_queue(self.server.eio, eio_sid)
        if queue is None:
            return False
        if not isinstance(queue, _compat.MeteredQueue) or not self.bounded:
            return True
        packets_level, bytes_level = self._levels()
        if queue.packets < packets_level and queue.bytes < bytes_level:
            return True
        try:
            await asyncio.wait_for(
                queue.below(packets_level, bytes_level), self.browser_stall_timeout
            )
        except asyncio.TimeoutError:  # not the built-in TimeoutError before Python 3.11
            await self._stalled(sid, eio_sid)
            return False
        # Another sender may have filled it again meanwhile: the caller looks again.
        return _compat.connection_queue(self.server.eio, eio_sid) is queue

    async def _stalled(self, sid: str, eio_sid: str) -> None:
        socket_queue = _compat.connection_queue(self.server.eio, eio_sid)
        if socket_queue is None:
            return
        self._count(BROWSERS_STALLED)
        rare(
            "browser_stalled",
            "relay: disconnected browser %s: it read nothing for %.0f s with its bound "
            "(%s packets, %s bytes) reached",
            sid,
            self.browser_stall_timeout,
            self.browser_queue_max,
            self.browser_queue_bytes,
        )
        await _compat.close_connection(self.server.eio, eio_sid)

    def _watch(self, sid: str) -> None:
        """Watch a browser a running block skipped until it drains (:meth:`drained`)."""
        if self.browser_stall_timeout is None or sid in self._watched or not self._metered:
            return
        task = asyncio.get_running_loop().create_task(self.drained(sid))
        self._watched[sid] = task
        task.add_done_callback(lambda done: self._unwatch(sid, done))

    def _unwatch(self, sid: str, task: asyncio.Task[bool]) -> None:
        if self._watched.get(sid) is task:
            del self._watched[sid]

    # -- acknowledgements ---------------------------------------------------------------

    def _behind(self, rooms: list[str], levels: tuple[int, int]) -> list[str]:
        """The browsers of ``rooms`` on this process at ``levels`` (packets, bytes) or over,
        but for those given up on (forgotten here once below)."""
        behind = []
        lagging = self._lagging
        for room in dict.fromkeys(rooms):
            for sid, eio_sid in self.server.manager.get_participants(self.namespace, room):
                if not self._over(eio_sid, *levels):
                    lagging.discard(sid)
                elif sid not in lagging:
                    behind.append(sid)
        return behind

    async def pace(self, rooms: list[str]) -> None:
        """Return once the browsers of ``rooms`` have room (module docstring)."""
        assert self.browser_queue_max is not None
        if not self._behind(rooms, self._levels()):
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
        levels = self._levels()
        loop = asyncio.get_running_loop()
        while self._pacing:
            await asyncio.sleep(_PACE_POLL)  # polling with deadlines (docstring of _PACE_POLL)
            now = loop.time()
            waiting = []
            for rooms, waiter, deadline in self._pacing:
                if waiter.done():  # its handler is gone
                    continue
                behind = self._behind(rooms, levels)
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

    # -- live blocks ----------------------------------------------------------------------

    def reserve(
        self, blocks: list[tuple[Any, bytes | None]], room: str
    ) -> tuple[list[list[str] | None], dict[str, list[int]]]:
        """Which browsers of ``room`` on this process each of a frame's blocks skips: a
        browser gets the section's running blocks, in order, only while they keep it within
        ``browser_queue_max`` packets and ``browser_queue_bytes`` bytes queued or on their
        way (the rest skip it, counted ``browser_queue_full``, one per block and browser;
        the browser is watched until it drains: :meth:`drained`); terminals skip no one.
        A block's bytes are its compact JSON's. Returns the skips per block and what was
        reserved per browser (:meth:`release` it once the emits returned)."""
        skips: list[list[str] | None] = [None] * len(blocks)
        reserved: dict[str, list[int]] = {}
        running = [i for i, (raw, _) in enumerate(blocks) if raw.get("state") == "running"]
        if not running:
            return skips, reserved
        # The bytes of the first n running blocks, for n = 1, 2, ...
        ends = list(itertools.accumulate(len(blocks[i][1] or b"") for i in running))
        packets_bound, bytes_bound = self._packets_bound, self._bytes_bound
        sending = self._sending
        for sid, eio_sid in self.server.manager.get_participants(self.namespace, room):
            packets, size = self._queued(eio_sid)
            on_way = sending.get(sid)
            if on_way is not None:
                packets += on_way[0]
                size += on_way[1]
            going = min(
                len(running),
                max(0, packets_bound - packets),
                bisect.bisect_right(ends, bytes_bound - size),
            )
            if going:
                taken = [going, ends[going - 1]]
                reserved[sid] = taken
                if on_way is None:
                    sending[sid] = list(taken)
                else:
                    on_way[0] += going
                    on_way[1] += taken[1]
            if going < len(running):
                self._count(BROWSER_QUEUE_FULL, len(running) - going)
                self._watch(sid)
                for i in running[going:]:
                    skip = skips[i]
                    if skip is None:
                        skips[i] = [sid]
                    else:
                        skip.append(sid)
        return skips, reserved

    def release(self, reserved: dict[str, list[int]]) -> None:
        """The emits of :meth:`reserve`'s blocks returned: they are queued (or dropped)."""
        sending = self._sending
        for sid, (packets, size) in reserved.items():
            on_way = sending.get(sid)
            if on_way is None:
                continue
            on_way[0] -= packets
            on_way[1] -= size
            if on_way[0] <= 0:
                del sending[sid]

    # -- catch-ups in all -----------------------------------------------------------------

    def _catch_up_queued(self, delta: int) -> None:
        """A connection's queue took (``delta > 0``) or let go of catch-up bytes."""
        self._inflight += delta
        if delta < 0:
            self._next_turns()

    def _fits(self, size: int) -> bool:
        held = self._inflight + self._reserved
        return held == 0 or held + size <= self.catch_up_inflight_bytes

    def _take(self, size: int) -> None:
        self._reserved += size
        self._peak = max(self._peak, self._inflight + self._reserved)

    def _next_turns(self) -> None:
        turns = self._turns
        while turns:
            size, turn = turns[0]
            if turn.done():  # its catch-up is gone
                turns.popleft()
                continue
            if not self._fits(size):
                return
            turns.popleft()
            self._take(size)
            turn.set_result(None)

    async def acquire(self, size: int) -> None:
        """Return once a catch-up block of ``size`` bytes may be sent within
        ``catch_up_inflight_bytes`` (waiting its turn, counted ``catch_up_pool_waits``);
        call :meth:`sent` with the same size right after its send (no await between)."""
        if not self._turns and self._fits(size):
            self._take(size)
            return
        self._count(CATCH_UP_POOL_WAITS)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._turns.append((size, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.sent(size)  # its turn came as it was cancelled
            raise

    def sent(self, size: int) -> None:
        """The send of an :meth:`acquire`'d block returned: its bytes are queued (counted by
        the queue) or were dropped with their connection."""
        self._reserved -= size
        self._next_turns()

    # -- sizes ----------------------------------------------------------------------------

    def browser_queues(self, browsers: Iterable[str]) -> dict[str, int]:
        """What this process's browsers hold now, not yet written: ``browser_queued``
        packets and ``browser_queued_bytes`` in all, ``browser_queue_longest`` packets and
        ``browser_queue_longest_bytes`` the most for one browser, ``browser_queue_peak`` and
        ``browser_queue_peak_bytes`` the most one of them held at once since it connected;
        ``catch_up_inflight`` the catch-up bytes of :meth:`acquire`'s bound now and
        ``catch_up_inflight_peak`` the most since start."""
        eio = self.server.eio
        packets: list[int] = []
        sizes: list[int] = []
        peak = peak_bytes = 0
        for sid in browsers:
            eio_sid = self._eio_sid(sid)
            queue = _compat.connection_queue(eio, eio_sid) if eio_sid is not None else None
            if queue is None:
                continue
            if isinstance(queue, _compat.MeteredQueue):
                packets.append(queue.packets)
                sizes.append(queue.bytes)
                peak = max(peak, queue.peak_packets)
                peak_bytes = max(peak_bytes, queue.peak_bytes)
            else:
                packets.append(queue.qsize())
        return {
            BROWSER_QUEUED: sum(packets),
            BROWSER_QUEUE_LONGEST: max(packets, default=0),
            BROWSER_QUEUED_BYTES: sum(sizes),
            BROWSER_QUEUE_LONGEST_BYTES: max(sizes, default=0),
            BROWSER_QUEUE_PEAK: peak,
            BROWSER_QUEUE_PEAK_BYTES: peak_bytes,
            CATCH_UP_INFLIGHT: self._inflight + self._reserved,
            CATCH_UP_INFLIGHT_PEAK: self._peak,
        }
