"""Senders: take what a :class:`~kernel_ext.stream.StreamHub` lets through and deliver it.

* :class:`LoopbackEmitter` — a python-socketio ``AsyncClient`` on the web process's
  ``/chat`` namespace (internal credential), batching blocks into ``kx_blocks`` frames.
* :class:`RedisEmitter` — python-socketio's write-only ``AsyncRedisManager``: emits
  ``tool_event_stream`` into the room through Redis, with no web process on this machine.
* :class:`MemoryEmitter` — records in process, for tests.

Every emitter runs one asyncio task on one event loop and is the hub's only consumer while
it runs. Common guarantees: blocks of one stream leave in publish order; a kernel
``chat_event`` leaves before blocks published after it; nothing here ever raises into tool
code (the hub is enqueue-only); :meth:`Emitter.stop` flushes within a timeout, then
detaches.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import copy
import functools
import json
import logging
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from kernel_ext._telemetry import RareLog
from kernel_ext.errors import (
    BlockTooLargeError,
    ConfigError,
    check_positive_ints,
    check_positive_numbers,
)
from kernel_ext.protocol import (
    CHAT_EVENT,
    KX_BLOCKS,
    KX_CHAT_EVENT,
    NAMESPACE,
    TOOL_EVENT_STREAM,
    WORKER_HEARTBEAT,
    WORKER_ID_PATTERN,
    WORKER_TAG,
    encode_wire,
    fallback_terminal,
)
from kernel_ext.stream import (
    UNFLUSHED,
    HubConsumer,
    Outgoing,
    OutgoingBlock,
    OutgoingChatEvent,
    StreamHub,
    get_default_hub,
)

__all__ = [
    "CHAT_EVENT",
    "DEFAULT_NAMESPACE",
    "KX_BLOCKS",
    "KX_CHAT_EVENT",
    "TOOL_EVENT_STREAM",
    "Emitter",
    "LoopbackEmitter",
    "MemoryEmitter",
    "RedisEmitter",
]

logger = logging.getLogger(__name__)
_rare = RareLog(logger)

DEFAULT_NAMESPACE = NAMESPACE

# Drop reasons counted by the senders (``kernel_ext.blocks`` outcome ``dropped``).
DISCONNECTED = "disconnected"
REJECTED = "rejected"
TERMINAL_EXPIRED = "terminal_expired"
TERMINAL_OVERFLOW = "terminal_overflow"
REDIS_DOWN = "redis_down"
NO_LISTENER = "no_listener"

Record = tuple[str, dict[str, Any]]


def _worker_id(given: str | None) -> str:
    """``given`` (checked against ``protocol.WORKER_ID_PATTERN``), else a random id.

    Deliberately not read from the environment: the id must differ from one process run to
    the next. A process restarted under its predecessor's id would be taken for the old one
    reconnecting, and the streams the old one left open would stay open for as long as the
    new one lives; under a new id it can still end them (the relay hands a stream to whoever
    sends its next block), and the rest are ended after the grace period.
    """
    if given is None:
        return uuid.uuid4().hex
    if not isinstance(given, str) or re.fullmatch(WORKER_ID_PATTERN, given) is None:
        raise ConfigError(
            "worker_id must be 1-128 characters of letters, digits and ._:@- (starting with "
            f"a letter or digit), got {given!r}"
        )
    return given


class Emitter(abc.ABC):
    """Base of the senders: one task that takes batches from the hub and sends them.

    Args:
        hub: the hub to consume (default: :func:`~kernel_ext.stream.get_default_hub` at
            :meth:`attach` time).
        batch_max: items taken from the hub at once.

    Subclasses implement :meth:`_send` (and optionally :meth:`_open`, :meth:`_close`,
    :meth:`_pending`).
    """

    def __init__(self, *, hub: StreamHub | None = None, batch_max: int = 256) -> None:
        check_positive_ints(batch_max=batch_max)
        self._hub = hub
        self.batch_max = batch_max
        self._consumer: HubConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    @property
    def hub(self) -> StreamHub:
        """The hub this emitter consumes."""
        if self._hub is None:
            self._hub = get_default_hub()
        return self._hub

    @property
    def running(self) -> bool:
        """Whether the send task is running."""
        return self._task is not None and not self._task.done()

    @property
    def healthy(self) -> bool:
        """Whether the transport is usable right now (always true in the base class)."""
        return True

    def attach(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Become the hub's consumer on ``loop`` (default: the running loop), so blocks are
        queued from now on, before :meth:`start` runs. May be called from any thread."""
        if self._consumer is None or self._consumer.closed:
            self._loop = loop if loop is not None else asyncio.get_running_loop()
            self._consumer = self.hub.consumer(self._loop)

    async def start(self) -> None:
        """Attach (if not yet) and start the send task on the running loop. Idempotent."""
        if self.running:
            return
        self._stopping = False
        self.attach(asyncio.get_running_loop())
        await self._open()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def start_soon(self) -> asyncio.Task[None]:
        """Attach now and :meth:`start` in a task of the running loop (for sync code running
        on the loop); :meth:`stop` waits for that start before it flushes."""
        self.attach(asyncio.get_running_loop())
        self._starting = asyncio.get_running_loop().create_task(self.start())
        return self._starting

    async def stop(self, timeout: float = 5.0) -> bool:
        """Send what is queued (terminals awaiting acknowledgement included) for up to
        ``timeout`` seconds, then stop the task, detach from the hub and close the
        transport. Returns whether everything was sent (and acknowledged) in time; what was
        not is dropped, counted ``unflushed`` and logged at ERROR when it holds terminals —
        also when this is cancelled (the event loop closing). Idempotent."""
        flushed = True
        try:
            starting, self._starting = self._starting, None
            if starting is not None and not starting.done():
                await asyncio.wait_for(asyncio.shield(starting), timeout)
            if self._task is not None and not self._task.done():
                flushed = await self.flush(timeout)
        finally:
            if self._give_up("stopped") and flushed:
                flushed = False
            self._flushed_at_stop = flushed
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.exception("emitter task failed")
        await self._close()
        return flushed

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the hub's queue is empty and nothing awaits an acknowledgement;
        ``True`` when that happened within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            consumer = self._consumer
            queued = consumer.hub.queue_size if consumer is not None else 0
            if not queued and not self._busy and not self._pending():
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.005)  # polling with a deadline

    def _give_up(self, why: str) -> int:
        """Stop taking from the hub; drop (count ``unflushed``) what is queued and what awaits
        delivery. Returns how many blocks that was."""
        self._stopping = True
        lost = 0
        consumer = self._consumer
        if consumer is not None and not consumer.closed:
            lost += consumer.hub.queue_size
            consumer.close(UNFLUSHED)  # the hub counts what was queued, logs its terminals
        pending = self._abandon_pending()
        if pending:
            self.hub.record_dropped(UNFLUSHED, pending)
            logger.error(
                "emitter %s: %d terminal(s) not confirmed delivered are given up", why, pending
            )
        return lost + pending

    async def __aenter__(self) -> Emitter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    _busy = False
    _flushed_at_stop = True  # what the last stop() returned
    _starting: asyncio.Task[None] | None = None  # start_soon()'s task

    async def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        # Until the transport's first attempt is over, blocks wait in the hub's bounded
        # queue instead of being dropped as "disconnected".
        try:
            await self._ready()
            while not consumer.closed:
                items = await consumer.get(self.batch_max)
                self._busy = True
                try:
                    await self._send(items)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    _rare("send_error", "emitter: sending a batch failed", exc_info=True)
                finally:
                    self._busy = False
        except asyncio.CancelledError:
            if not self._stopping:  # not stop(): the event loop is ending under the sender
                logger.error(
                    "emitter: its event loop is closing while it runs; what is queued is "
                    "lost — await kernel_ext.adisable() (or emitter.stop()) before the loop "
                    "ends"
                )
                self._give_up("cancelled")
            raise

    # -- for subclasses -------------------------------------------------------------------

    @abc.abstractmethod
    async def _send(self, items: list[Outgoing]) -> None:
        """Deliver ``items`` (publish order); ``[]`` means "woken, check your state"."""

    async def _open(self) -> None:
        """Start the transport (called by :meth:`start`, before the send task)."""
        return None  # optional hook: nothing to do by default

    async def _close(self) -> None:
        """Close the transport (called by :meth:`stop`)."""
        return None  # optional hook: nothing to do by default

    def _pending(self) -> int:
        """Items held back by the transport (e.g. terminals awaiting acknowledgement)."""
        return 0

    def _abandon_pending(self) -> int:
        """Forget what :meth:`_pending` counts (at stop); return how many."""
        return 0

    async def _ready(self) -> None:
        """Return once the transport's first connection attempt is over (either way)."""
        return None  # optional hook: nothing to do by default


class MemoryEmitter(Emitter):
    """Records what it would send, in order, for tests: ``records`` holds
    ``(room, block)`` pairs (the block as its wire dict), ``chat_events`` the
    ``(room, event)`` pairs of ``chat_event`` snapshots.

    Wait for something with :meth:`wait_for`; on the emitter's own loop only.
    """

    def __init__(self, *, hub: StreamHub | None = None, batch_max: int = 256) -> None:
        super().__init__(hub=hub, batch_max=batch_max)
        self.records: list[Record] = []
        self.chat_events: list[Record] = []
        self.order: list[tuple[str, str, dict[str, Any]]] = []
        self._changed = asyncio.Event()

    async def _send(self, items: list[Outgoing]) -> None:
        hub = self.hub
        sent = 0
        for item in items:
            if isinstance(item, OutgoingBlock):
                self.records.append((item.room, item.block))
                self.order.append(("tool_event_stream", item.room, item.block))
                sent += 1
            elif isinstance(item, OutgoingChatEvent):
                self.chat_events.append((item.room, item.event))
                self.order.append(("chat_event", item.room, item.event))
        if sent:
            hub.record_delivered(sent)
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


def _jittered(delay: float) -> float:
    return delay * (0.75 + random.random() * 0.5)


class _Held:
    """A terminal block kept until its delivery is confirmed (bounded in count and time);
    ``level`` counts how often a refusal made it degrade (:func:`_degrade`)."""

    __slots__ = ("attempts", "first", "item", "level")

    def __init__(self, item: OutgoingBlock, now: float) -> None:
        self.item = item
        self.first = now
        self.attempts = 0
        self.level = 0


class _Terminals:
    """The terminals a sender still owes: bounded count, bounded age, bounded attempts."""

    def __init__(
        self, hub: Callable[[], StreamHub], max_count: int, max_age: float, max_attempts: int
    ) -> None:
        self._hub = hub
        self.max_count = max_count
        self.max_age = max_age
        self.max_attempts = max_attempts
        self.held: list[_Held] = []

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, entry: _Held) -> None:
        """Keep ``entry`` for a later attempt (or drop it, counted, when over a bound)."""
        if entry.attempts >= self.max_attempts or _now() - entry.first > self.max_age:
            self._expire(entry, TERMINAL_EXPIRED)
            return
        self.held.append(entry)
        while len(self.held) > self.max_count:
            self._expire(self.held.pop(0), TERMINAL_OVERFLOW)

    def take(self) -> list[_Held]:
        """Every held entry still within its bounds (the rest is dropped, counted)."""
        held, self.held = self.held, []
        now = _now()
        fresh = []
        for entry in held:
            if entry.attempts >= self.max_attempts or now - entry.first > self.max_age:
                self._expire(entry, TERMINAL_EXPIRED)
            else:
                fresh.append(entry)
        return fresh

    def _expire(self, entry: _Held, reason: str) -> None:
        item = entry.item
        self._hub().record_dropped(reason, 1, item.call_id)
        _rare(
            reason,
            "emitter: terminal of (%s, %s) given up after %d attempt(s) (%s)",
            item.call_id,
            item.task_id,
            entry.attempts,
            reason,
            level=logging.ERROR,
        )


def _now() -> float:
    return time.monotonic()


class LoopbackEmitter(Emitter):
    """Sends blocks to the web process's relay over a python-socketio ``AsyncClient``.

    Connects to ``url`` (e.g. ``http://127.0.0.1:8000``), namespace ``/chat``, with auth
    ``{"internal": secret, "worker": worker_id}``. ``worker_id`` (default: a random id per
    emitter; unique per process run) names this sender to the relay, which
    ends the sender's open streams with ``aborted`` when it stays disconnected longer than
    the relay's grace period; a sender that reconnects within it resumes. Guarantees:

    * Blocks of one stream are sent in order, batched per room into ``kx_blocks`` frames
      of at most ``frame_max_blocks`` blocks / about ``frame_max_chars`` characters.
    * A frame holding a terminal is sent with an acknowledgement request; a terminal is
      held and re-sent after a reconnect until the relay acknowledges it, at most
      ``terminal_max_attempts`` times and for ``terminal_max_age`` seconds, at most
      ``max_pending_terminals`` at once (beyond: dropped, counted, logged at ERROR). No
      acknowledgement within ``ack_timeout`` seconds (a frozen server) forces a reconnect.
    * Running blocks are fire-and-forget: while disconnected they are dropped and counted
      (``disconnected``); nothing is kept (T3).
    * Reconnects with jittered exponential backoff from ``reconnect_delay`` to
      ``reconnect_delay_max`` seconds. The relay keeps nothing per connection that a new
      connection (new sid) does not rebuild by authenticating again.
    * ``chat_event`` snapshots go as ``kx_chat_event`` in publish order with the blocks.
    * ``on_health(connected)`` is called on every connection state change.
    """

    def __init__(
        self,
        url: str,
        secret: str,
        *,
        hub: StreamHub | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        socketio_path: str = "socket.io",
        transports: list[str] | None = None,
        batch_max: int = 512,
        frame_max_blocks: int = 256,
        frame_max_chars: int = 256 * 1024,
        ack_timeout: float = 10.0,
        terminal_max_attempts: int = 10,
        terminal_max_age: float = 300.0,
        max_pending_terminals: int = 10_000,
        reconnect_delay: float = 0.1,
        reconnect_delay_max: float = 5.0,
        connect_timeout: float = 5.0,
        on_health: Callable[[bool], None] | None = None,
        worker_id: str | None = None,
    ) -> None:
        super().__init__(hub=hub, batch_max=batch_max)
        if not isinstance(url, str) or not url:
            raise ConfigError("url must be the relay's http(s) URL")
        if not isinstance(secret, str) or not secret:
            raise ConfigError("secret must be a non-empty string")
        check_positive_ints(
            frame_max_blocks=frame_max_blocks,
            frame_max_chars=frame_max_chars,
            terminal_max_attempts=terminal_max_attempts,
            max_pending_terminals=max_pending_terminals,
        )
        check_positive_numbers(
            ack_timeout=ack_timeout,
            terminal_max_age=terminal_max_age,
            reconnect_delay=reconnect_delay,
            reconnect_delay_max=reconnect_delay_max,
            connect_timeout=connect_timeout,
        )
        self.url = url
        self._secret = secret
        self.worker_id = _worker_id(worker_id)
        self.namespace = namespace
        self.socketio_path = socketio_path
        self.transports = transports if transports is not None else ["websocket"]
        self.frame_max_blocks = frame_max_blocks
        self.frame_max_chars = frame_max_chars
        self.ack_timeout = float(ack_timeout)
        self.reconnect_delay = float(reconnect_delay)
        self.reconnect_delay_max = float(reconnect_delay_max)
        self.connect_timeout = float(connect_timeout)
        self._on_health = on_health
        self._terminals = _Terminals(
            lambda: self.hub,
            max_pending_terminals,
            float(terminal_max_age),
            terminal_max_attempts,
        )
        # frame id -> (its terminals, when it was sent, its blocks in frame order)
        self._inflight: dict[int, tuple[list[_Held], float, list[OutgoingBlock]]] = {}
        self._frame_ids = 0
        self._client: Any = None
        self._connected = False
        self._connections = 0
        self._connector: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._first_attempt = asyncio.Event()
        self.counts: dict[str, int] = {}

    @property
    def healthy(self) -> bool:
        """Whether the ``/chat`` namespace is connected right now."""
        return self._connected

    @property
    def connections(self) -> int:
        """How many times a connection was established (1 + reconnects)."""
        return self._connections

    @property
    def sid(self) -> str | None:
        """The current connection's namespace sid, if connected."""
        client = self._client
        if client is None or not self._connected:
            return None
        sid: str | None = client.get_sid(self.namespace)
        return sid

    def _pending(self) -> int:
        return len(self._terminals) + sum(len(h) for h, _, _ in self._inflight.values())

    def _abandon_pending(self) -> int:
        pending = self._pending()
        self._terminals.held = []
        self._inflight = {}
        return pending

    def _bump(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    # -- the connection -------------------------------------------------------------------

    async def _ready(self) -> None:
        await self._first_attempt.wait()

    async def _open(self) -> None:
        import socketio

        self._wakeup = asyncio.Event()
        self._first_attempt = asyncio.Event()
        client = socketio.AsyncClient(reconnection=False)
        client.on("connect", self._on_connect, namespace=self.namespace)
        client.on("disconnect", self._on_disconnect, namespace=self.namespace)
        self._client = client
        self._connector = asyncio.get_running_loop().create_task(self._connect_loop())

    async def _close(self) -> None:
        self._stopping = True
        self._wakeup.set()
        task, self._connector = self._connector, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.disconnect()
        self._set_connected(False)

    def _set_connected(self, connected: bool) -> None:
        if connected == self._connected:
            return
        self._connected = connected
        if self._on_health is not None:
            try:
                self._on_health(connected)
            except Exception:
                logger.exception("emitter: on_health callback failed")

    async def _on_connect(self) -> None:
        self._connections += 1
        self._set_connected(True)
        logger.info("loopback emitter: connected to %s (sid %s)", self.url, self.sid)
        if self._consumer is not None:
            self._consumer.poke()  # re-send held terminals now

    async def _on_disconnect(self, reason: Any = None) -> None:
        was = self._connected
        self._set_connected(False)
        # Frames without an acknowledgement may or may not have arrived: hold their
        # terminals again (the relay drops a terminal it emitted already).
        inflight, self._inflight = self._inflight, {}
        for held, _, _ in inflight.values():
            for entry in held:
                self._terminals.hold(entry)
        if was and not self._stopping:
            self._bump("disconnects")
            logger.warning("loopback emitter: disconnected from %s (%s)", self.url, reason)
        self._wakeup.set()

    async def _connect_loop(self) -> None:
        delay = self.reconnect_delay
        while not self._stopping:
            client = self._client
            try:
                await client.connect(
                    self.url,
                    auth={"internal": self._secret, "worker": self.worker_id},
                    namespaces=[self.namespace],
                    transports=self.transports,
                    socketio_path=self.socketio_path,
                    wait_timeout=self.connect_timeout,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # ConnectionError, OSError, refused auth, …
                self._bump("connect_failures")
                _rare(
                    "connect_failed",
                    "loopback emitter: cannot connect to %s: %s",
                    self.url,
                    exc,
                    level=logging.WARNING,
                )
                self._terminals.held = self._terminals.take()  # expire old ones meanwhile
                self._first_attempt.set()
                await self._pause(_jittered(delay))
                delay = min(delay * 2, self.reconnect_delay_max)
                continue
            self._first_attempt.set()
            connected_at = _now()
            await self._watch()
            # A connection that dropped at once (a relay that keeps closing it) backs off
            # like a failed attempt; one that lived starts over from the shortest delay.
            if _now() - connected_at < 1.0:
                delay = min(delay * 2, self.reconnect_delay_max)
            else:
                delay = self.reconnect_delay
            if not self._stopping:
                await self._pause(_jittered(delay))

    async def _pause(self, seconds: float) -> None:
        self._wakeup.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), seconds)

    async def _watch(self) -> None:
        """While connected: force a reconnect when an acknowledgement is overdue."""
        step = min(1.0, self.ack_timeout / 4)
        while self._connected and not self._stopping:
            await self._pause(step)
            if not self._connected or self._stopping:
                return
            if self._inflight:
                oldest = min(sent for _, sent, _ in self._inflight.values())
                if _now() - oldest > self.ack_timeout:
                    self._bump("ack_timeouts")
                    logger.warning(
                        "loopback emitter: no acknowledgement from %s within %.1f s; reconnecting",
                        self.url,
                        self.ack_timeout,
                    )
                    with contextlib.suppress(Exception):
                        await self._client.disconnect()
                    if self._connected:  # the disconnect handler did not run
                        await self._on_disconnect("ack timeout")
                    return

    # -- sending --------------------------------------------------------------------------

    def _frames(
        self, items: list[Outgoing]
    ) -> list[tuple[str, list[OutgoingBlock]] | OutgoingChatEvent]:
        frames: list[tuple[str, list[OutgoingBlock]] | OutgoingChatEvent] = []
        open_frames: dict[str, tuple[int, list[int]]] = {}
        for item in items:
            if isinstance(item, OutgoingChatEvent):
                open_frames.pop(item.room, None)
                frames.append(item)
                continue
            current = open_frames.get(item.room)
            if current is not None:
                index, chars = current
                blocks = frames[index][1]  # type: ignore[index]
                if (
                    len(blocks) < self.frame_max_blocks
                    and chars[0] + item.size <= self.frame_max_chars
                ):
                    blocks.append(item)
                    chars[0] += item.size
                    continue
            open_frames[item.room] = (len(frames), [item.size])
            frames.append((item.room, [item]))
        return frames

    async def _send(self, items: list[Outgoing]) -> None:
        if self._connected and len(self._terminals):
            retry = self._terminals.take()
            if retry:
                self._bump("terminal_resends", len(retry))
                await self._send_frames(self._frames([h.item for h in retry]), retry)
        if items:
            await self._send_frames(self._frames(items), None)

    async def _send_frames(
        self,
        frames: list[tuple[str, list[OutgoingBlock]] | OutgoingChatEvent],
        retry: list[_Held] | None,
    ) -> None:
        hub = self.hub
        held_by_item = {id(h.item): h for h in retry} if retry else {}
        for frame in frames:
            if isinstance(frame, OutgoingChatEvent):
                if not self._connected:
                    hub.record_dropped(DISCONNECTED)
                    continue
                try:
                    await self._client.emit(
                        KX_CHAT_EVENT,
                        {"room": frame.room, "event": frame.event},
                        namespace=self.namespace,
                    )
                except Exception:
                    hub.record_dropped(DISCONNECTED)
                continue
            room, blocks = frame
            terminals = [held_by_item.get(id(b)) or _Held(b, _now()) for b in blocks if b.terminal]
            if not self._connected:
                self._lose(blocks, terminals)
                continue
            payload = {"v": 1, "room": room, "blocks": [b.block for b in blocks]}
            frame_id = 0
            try:
                if terminals:
                    self._frame_ids += 1
                    frame_id = self._frame_ids
                    for entry in terminals:
                        entry.attempts += 1
                    self._inflight[frame_id] = (terminals, _now(), blocks)
                    await self._client.emit(
                        KX_BLOCKS,
                        payload,
                        namespace=self.namespace,
                        callback=functools.partial(self._on_ack, frame_id, len(blocks)),
                    )
                else:
                    await self._client.emit(KX_BLOCKS, payload, namespace=self.namespace)
                    hub.record_delivered(len(blocks))
            except Exception as exc:
                _rare("emit_failed", "loopback emitter: emit failed: %s", exc)
                if terminals and self._inflight.pop(frame_id, None) is None:
                    terminals = []  # the disconnect handler holds them already
                self._lose(blocks, terminals)

    def _lose(self, blocks: list[OutgoingBlock], terminals: list[_Held]) -> None:
        """Blocks that cannot go now: running ones are dropped, terminals held."""
        hub = self.hub
        for block in blocks:
            if not block.terminal:
                hub.record_dropped(DISCONNECTED, 1, block.call_id)
        for entry in terminals:
            self._terminals.hold(entry)

    def _on_ack(self, frame_id: int, n_blocks: int, ack: Any = None) -> None:
        """A frame's acknowledgement. Running blocks the relay refused are lost (counted
        ``rejected``); a refused terminal is never counted delivered: it is degraded one
        step (:func:`_degrade`) and sent again, or dropped (counted) when both steps were
        refused. A relay that refuses blocks without saying which has each terminal of the
        frame sent again (it drops a terminal it emitted already)."""
        entry = self._inflight.pop(frame_id, None)
        if entry is None:
            return
        held, _, blocks = entry
        bound: Any = None
        if isinstance(ack, Mapping) and ack.get("ok") is True:
            self._bump("acks")
            rejected = ack.get("rejected")
            if isinstance(rejected, bool) or not isinstance(rejected, int) or rejected < 0:
                rejected = 0
            self.hub.record_delivered(n_blocks - min(rejected, n_blocks))
            if not rejected:
                return
            refused = _refused_indexes(ack.get("refused"), len(blocks))
            for index in refused:
                if not blocks[index].terminal:
                    self.hub.record_dropped(REJECTED, 1, blocks[index].call_id)
            if len(refused) < rejected:  # the relay did not say which
                self.hub.record_dropped(REJECTED, rejected - len(refused))
                again = [(h, "invalid") for h in held]
            else:
                position = {id(block): index for index, block in enumerate(blocks)}
                again = [
                    (h, refused[position[id(h.item)]])
                    for h in held
                    if position.get(id(h.item), -1) in refused
                ]
            bound = ack.get("maxBlockBytes")
        else:
            self._bump("nacks")
            _rare("nack", "loopback emitter: relay refused a frame: %r", ack)
            if isinstance(ack, Mapping) and ack.get("error") == "busy":
                for entry_ in held:
                    self._terminals.hold(entry_)
                if held and self._consumer is not None:
                    self._consumer.poke()
                return
            again = [(h, "invalid") for h in held]
        for entry_, reason in again:
            if _degrade(entry_, reason, bound if isinstance(bound, int) else None):
                self._bump("terminals_degraded")
                self._terminals.hold(entry_)
            else:
                self.hub.record_dropped(REJECTED, 1, entry_.item.call_id)
                _rare(
                    "terminal_refused",
                    "loopback emitter: the relay refused the terminal of (%s, %s) even "
                    "degraded (%s); it is lost",
                    entry_.item.call_id,
                    entry_.item.task_id,
                    reason,
                    level=logging.ERROR,
                )
        if again and self._consumer is not None:
            self._consumer.poke()


def _refused_indexes(refused: Any, n_blocks: int) -> dict[int, str]:
    """``{index: reason}`` from an acknowledgement's ``refused`` list (bad entries skipped)."""
    found: dict[int, str] = {}
    if not isinstance(refused, list):
        return found
    for entry in refused:
        if not isinstance(entry, Mapping):
            continue
        index, reason = entry.get("index"), entry.get("reason")
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < n_blocks:
            found[index] = reason if isinstance(reason, str) else "invalid"
    return found


def _degrade(entry: _Held, reason: str, relay_bound: int | None) -> bool:
    """Make a refused terminal more likely to pass, one step per refusal: first cut to the
    relay's size bound (when it was refused as too large and the relay said its bound),
    then the protocol's short fallback terminal; ``False`` when both were refused."""
    item = entry.item
    entry.level += 1
    wire = item.block
    if entry.level == 1 and reason == "too_large" and relay_bound is not None:
        cut = copy.deepcopy(wire)
        try:
            encoded = encode_wire(cut, max_bytes=relay_bound)
        except (BlockTooLargeError, KeyError, TypeError, ValueError):
            entry.level += 1
        else:
            item.block = cut
            item.size = len(encoded)
            return True
    if entry.level <= 2:
        state: Literal["done", "aborted"] = "done" if wire.get("state") == "done" else "aborted"
        envelope = wire.get("envelope")
        seq = envelope.get("seq") if isinstance(envelope, Mapping) else None
        item.block = fallback_terminal(
            item.call_id,
            str(item.task_id),
            state,
            int(time.time() * 1000),
            seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else 0,
            too_large=reason == "too_large",
        )
        item.size = len(repr(item.block))
        entry.level = 2
        return True
    return False


def _redis_manager_class() -> Any:
    import socketio

    class ReportingRedisManager(socketio.AsyncRedisManager):  # type: ignore[misc]
        """python-socketio's write-only Redis manager, recording each publish's result:
        ``last_receivers`` is Redis's receiver count, or ``None`` when the publish failed
        (python-socketio only logs that); each emit carries ``worker_id`` (key
        ``kx_worker``) when set."""

        last_receivers: int | None = None
        worker_id: str | None = None

        async def _publish(self, data: Any) -> Any:
            if self.worker_id is not None and data.get("method") == "emit":
                data[WORKER_TAG] = self.worker_id
            result = await super()._publish(data)
            self.last_receivers = result if isinstance(result, int) else None
            return result

    return ReportingRedisManager


def _safe_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


class RedisEmitter(Emitter):
    """Emits ``tool_event_stream`` into the rooms through Redis with python-socketio's
    write-only ``AsyncRedisManager``, for web processes that use an ``AsyncRedisManager``
    on the same ``channel`` (no web process needed on this machine).

    python-socketio only logs a failed publish; this emitter checks every publish and pings
    Redis every ``health_interval`` seconds, so an outage is reported: :attr:`healthy` turns
    false, ``on_health(False)`` is called, an ERROR is logged and blocks are counted
    ``redis_down``. Guarantees:

    * Running blocks that cannot be published are dropped and counted; nothing is kept.
    * A terminal is held until a publish reaches at least one web process (Redis reports
      the receivers; zero means no web process listens yet), retried while Redis is back,
      at most ``max_pending_terminals`` at once, for ``terminal_max_age`` seconds.
    * ``chat_event`` snapshots are emitted as ``chat_event`` in order with the blocks.
    * Liveness (``heartbeat_interval`` seconds, ``None`` disables): each emit carries
      ``worker_id`` (default: a random id per emitter; unique per process run) and a
      heartbeat ``{"method": "kx_worker_heartbeat", "worker", "interval", "host_id"}`` is
      published on the channel that often while Redis answers, so web processes whose
      manager is :class:`~kernel_ext.relay.RelayRedisManager` end this worker's open
      streams with ``aborted`` when it falls silent for longer than their grace period.
      python-socketio's own managers ignore both. Keep the interval at most a third of the
      web processes' grace.
    """

    def __init__(
        self,
        url: str,
        *,
        hub: StreamHub | None = None,
        channel: str = "socketio",
        namespace: str = DEFAULT_NAMESPACE,
        batch_max: int = 256,
        health_interval: float = 5.0,
        retry_interval: float = 0.25,
        retry_interval_max: float = 5.0,
        terminal_max_age: float = 300.0,
        terminal_max_attempts: int = 1_000,
        max_pending_terminals: int = 10_000,
        socket_timeout: float = 2.0,
        on_health: Callable[[bool], None] | None = None,
        redis_options: Mapping[str, Any] | None = None,
        worker_id: str | None = None,
        heartbeat_interval: float | None = 5.0,
    ) -> None:
        super().__init__(hub=hub, batch_max=batch_max)
        if not isinstance(url, str) or not url:
            raise ConfigError("url must be a redis:// URL")
        if heartbeat_interval is not None:
            check_positive_numbers(heartbeat_interval=heartbeat_interval)
        check_positive_numbers(
            health_interval=health_interval,
            retry_interval=retry_interval,
            retry_interval_max=retry_interval_max,
            terminal_max_age=terminal_max_age,
            socket_timeout=socket_timeout,
        )
        self.url = url
        self.channel = channel
        self.namespace = namespace
        self.worker_id = _worker_id(worker_id)
        self.heartbeat_interval = None if heartbeat_interval is None else float(heartbeat_interval)
        self._next_heartbeat = 0.0
        self.health_interval = float(health_interval)
        self.retry_interval = float(retry_interval)
        self.retry_interval_max = float(retry_interval_max)
        self._options = {
            "socket_connect_timeout": socket_timeout,
            "socket_timeout": socket_timeout,
            **(redis_options or {}),
        }
        self._on_health = on_health
        self._terminals = _Terminals(
            lambda: self.hub,
            max_pending_terminals,
            float(terminal_max_age),
            terminal_max_attempts,
        )
        self._healthy = True
        self._manager: Any = None
        self._ping_client: Any = None
        self._monitor: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._first_ping = asyncio.Event()
        self._retry_at = 0.0
        self._retry_delay = self.retry_interval
        self.outages = 0
        self.counts: dict[str, int] = {}

    @property
    def healthy(self) -> bool:
        """False from a failed publish or ping until a ping succeeds again."""
        return self._healthy

    def _pending(self) -> int:
        return len(self._terminals)

    def _abandon_pending(self) -> int:
        pending = len(self._terminals)
        self._terminals.held = []
        return pending

    def _bump(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    async def _open(self) -> None:
        from redis import asyncio as aioredis

        self._wakeup = asyncio.Event()
        self._manager = _redis_manager_class()(
            self.url,
            channel=self.channel,
            write_only=True,
            logger=logging.getLogger("kernel_ext.emit.redis"),
            redis_options=dict(self._options),
        )
        if self.heartbeat_interval is not None:
            self._manager.worker_id = self.worker_id
        self._next_heartbeat = 0.0
        self._ping_client = aioredis.Redis.from_url(self.url, **self._options)
        self._first_ping = asyncio.Event()
        self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def _ready(self) -> None:
        await self._first_ping.wait()

    async def _close(self) -> None:
        self._stopping = True
        self._wakeup.set()
        task, self._monitor = self._monitor, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for client in (self._ping_client, getattr(self._manager, "redis", None)):
            if client is not None:
                close = getattr(client, "aclose", None) or client.close  # redis < 5.0.1
                with contextlib.suppress(Exception):
                    await close()
        self._ping_client = None
        self._manager = None

    def _set_healthy(self, healthy: bool, why: str = "") -> None:
        if healthy == self._healthy:
            return
        self._healthy = healthy
        if healthy:
            logger.warning("redis emitter: Redis at %s is reachable again", _safe_url(self.url))
        else:
            self.outages += 1
            logger.error(
                "redis emitter: Redis at %s is unreachable (%s); running blocks are dropped "
                "and terminals held until it is back",
                _safe_url(self.url),
                why,
            )
        if self._on_health is not None:
            try:
                self._on_health(healthy)
            except Exception:
                logger.exception("emitter: on_health callback failed")

    async def _ping(self) -> bool:
        try:
            await self._ping_client.ping()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._set_healthy(False, f"ping failed: {exc}")
            return False
        self._set_healthy(True)
        return True

    async def _heartbeat(self) -> None:
        """Publish the liveness heartbeat if it is due (on the ping client: the manager's
        connection reports each emit's receivers)."""
        if self.heartbeat_interval is None or not self._healthy or _now() < self._next_heartbeat:
            return
        self._next_heartbeat = _now() + self.heartbeat_interval
        message = {
            "method": WORKER_HEARTBEAT,
            "worker": self.worker_id,
            "interval": self.heartbeat_interval,
            "host_id": self._manager.host_id,
        }
        try:
            await self._ping_client.publish(self.channel, json.dumps(message))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._set_healthy(False, f"heartbeat failed: {exc}")
            return
        self._bump("heartbeats")

    async def _watch(self) -> None:
        try:
            await self._ping()
            await self._heartbeat()
        finally:
            self._first_ping.set()
        while not self._stopping:
            if self._healthy and not len(self._terminals):
                interval = self.health_interval
            else:
                interval = (
                    max(0.01, self._retry_at - _now())
                    if len(self._terminals)
                    else (self.retry_interval)
                )
            if self.heartbeat_interval is not None and self._healthy:
                interval = max(0.01, min(interval, self._next_heartbeat - _now()))
            self._wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), interval)
            if self._stopping:
                return
            await self._ping()
            await self._heartbeat()
            if self._healthy and len(self._terminals) and self._consumer is not None:
                self._consumer.poke()

    async def _publish(self, event: str, data: Any, room: str) -> int | None:
        """Emit one event; the receiver count, or ``None`` when Redis failed."""
        manager = self._manager
        manager.last_receivers = None
        try:
            await manager.emit(event, data, namespace=self.namespace, room=room)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._set_healthy(False, f"publish failed: {exc}")
            return None
        receivers: int | None = manager.last_receivers
        if receivers is None:
            self._set_healthy(False, "publish failed (see the socketio log)")
            self._wakeup.set()
        return receivers

    async def _send(self, items: list[Outgoing]) -> None:
        hub = self.hub
        if self._healthy and len(self._terminals) and _now() >= self._retry_at:
            await self._retry_terminals()
        for item in items:
            if isinstance(item, OutgoingChatEvent):
                if (
                    not self._healthy
                    or await self._publish(CHAT_EVENT, item.event, item.room) is None
                ):
                    hub.record_dropped(REDIS_DOWN)
                continue
            if not self._healthy:
                self._drop_or_hold(item, REDIS_DOWN)
                continue
            receivers = await self._publish(TOOL_EVENT_STREAM, item.block, item.room)
            if receivers is None:
                self._drop_or_hold(item, REDIS_DOWN)
            elif receivers == 0:
                self._bump("no_listener")
                self._drop_or_hold(item, NO_LISTENER)
            else:
                hub.record_delivered()

    def _drop_or_hold(self, item: OutgoingBlock, reason: str) -> None:
        if item.terminal:
            entry = _Held(item, _now())
            entry.attempts = 1
            self._terminals.hold(entry)
            self._schedule_retry()
        else:
            self.hub.record_dropped(reason, 1, item.call_id)

    def _schedule_retry(self) -> None:
        self._retry_at = _now() + _jittered(self._retry_delay)
        self._retry_delay = min(self._retry_delay * 2, self.retry_interval_max)
        self._wakeup.set()

    async def _retry_terminals(self) -> None:
        entries = self._terminals.take()
        delivered = 0
        for i, entry in enumerate(entries):
            entry.attempts += 1
            receivers = await self._publish(TOOL_EVENT_STREAM, entry.item.block, entry.item.room)
            if receivers:
                delivered += 1
                self.hub.record_delivered()
                continue
            self._terminals.hold(entry)
            if receivers is None:  # Redis is down again: keep the rest as they are
                for rest in entries[i + 1 :]:
                    self._terminals.hold(rest)
                break
        if delivered:
            self._bump("terminal_resends", delivered)
        if len(self._terminals):
            self._schedule_retry()
        else:
            self._retry_delay = self.retry_interval
