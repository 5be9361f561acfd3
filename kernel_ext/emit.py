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

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from kernel_ext._telemetry import RareLog
from kernel_ext.errors import ConfigError
from kernel_ext.stream import (
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
    "TOOL_EVENT_STREAM",
    "Emitter",
    "MemoryEmitter",
]

logger = logging.getLogger(__name__)
_rare = RareLog(logger)

TOOL_EVENT_STREAM = "tool_event_stream"
CHAT_EVENT = "chat_event"
DEFAULT_NAMESPACE = "/chat"

Record = tuple[str, dict[str, Any]]


class Emitter:
    """Base of the senders: one task that takes batches from the hub and sends them.

    Args:
        hub: the hub to consume (default: :func:`~kernel_ext.stream.get_default_hub` at
            :meth:`attach` time).
        batch_max: items taken from the hub at once.

    Subclasses implement :meth:`_send` (and optionally :meth:`_open`, :meth:`_close`,
    :meth:`_pending`).
    """

    def __init__(self, *, hub: StreamHub | None = None, batch_max: int = 256) -> None:
        if isinstance(batch_max, bool) or not isinstance(batch_max, int) or batch_max < 1:
            raise ConfigError(f"batch_max must be a positive int, got {batch_max!r}")
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

    async def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued (terminals awaiting acknowledgement included) for up to
        ``timeout`` seconds, then stop the task, detach from the hub and close the
        transport. Idempotent."""
        if self._task is not None and not self._task.done():
            await self.flush(timeout)
        self._stopping = True
        consumer = self._consumer
        if consumer is not None:
            consumer.close()
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

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the hub's queue is empty and nothing awaits an acknowledgement;
        ``True`` when that happened within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            consumer = self._consumer
            queued = consumer.hub.stats().queue if consumer is not None else 0
            if not queued and not self._busy and not self._pending():
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.005)  # polling with a deadline

    async def __aenter__(self) -> Emitter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    _busy = False

    async def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
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

    # -- for subclasses -------------------------------------------------------------------

    async def _send(self, items: list[Outgoing]) -> None:
        """Deliver ``items`` (publish order); ``[]`` means "woken, check your state"."""
        raise NotImplementedError

    async def _open(self) -> None:
        """Start the transport (called by :meth:`start`, before the send task)."""

    async def _close(self) -> None:
        """Close the transport (called by :meth:`stop`)."""

    def _pending(self) -> int:
        """Items held back by the transport (e.g. terminals awaiting acknowledgement)."""
        return 0


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
            hub.record_sent(sent)
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


def _now() -> float:
    return time.monotonic()


def _as_dict(value: object) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None
