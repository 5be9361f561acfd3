"""The Redis sender: python-socketio's write-only ``AsyncRedisManager``, watched.

python-socketio publishes an emit once and only logs a failure. This sender learns each
publish's result through :class:`kernel_ext.redis.publish_result.PublishResult` (Redis's
receiver count) and pings Redis, so an outage is reported and a terminal is held until a
web process got it. Where the python-socketio in use does not report the count
(``_compat`` says so at DEBUG, and this sender once at WARNING), a publish that did not
raise counts as delivered: outages then show through the pings only, and a terminal is not
held for web processes that do not listen yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kernel_ext._shared import compat
from kernel_ext.emit.base import (
    DEFAULT_NAMESPACE,
    NO_LISTENER,
    REDIS_DOWN,
    Emitter,
    backoff,
    check_worker_id,
    logger,
    remembers_arguments,
)
from kernel_ext.emit.owed_terminals import OwedTerminals
from kernel_ext.errors import check_positive_numbers
from kernel_ext.observability.count_names import HEARTBEATS, OUTAGES, TERMINAL_RESENDS
from kernel_ext.protocol import CHAT_EVENT, TOOL_EVENT_STREAM, WORKER_HEARTBEAT, WORKER_TAG
from kernel_ext.settings import check_redis_url, redacted_url
from kernel_ext.stream import Outgoing, OutgoingBlock, OutgoingChatEvent, StreamHub

if TYPE_CHECKING:
    from kernel_ext.redis.stops import WorkerStops

__all__ = ["RedisEmitter"]

_UNCONFIRMED = -1
"""A publish's receivers when python-socketio does not report them (taken as delivered)."""


@functools.cache
def _manager_class() -> Any:
    """python-socketio's ``AsyncRedisManager`` reporting each publish's receivers, routing
    each room's emits to the room's channel and its blocks to the room's log
    (:mod:`kernel_ext.redis.routing`)."""
    import socketio

    from kernel_ext.redis.routing import RoutedPublish

    class ReportingRedisManager(RoutedPublish, socketio.AsyncRedisManager):  # type: ignore[misc, unused-ignore]
        pass

    return ReportingRedisManager


def _now() -> float:
    return time.monotonic()


class RedisEmitter(Emitter):
    """Emits ``tool_event_stream`` into the rooms through Redis with python-socketio's
    write-only ``AsyncRedisManager``, for web processes that use an ``AsyncRedisManager``
    on the same ``channel`` (no web process needed on this machine). The rules in full:
    docs/contracts.md, "The Redis sender".

    * An outage is reported (every publish checked, Redis pinged every
      ``health_interval`` seconds): :attr:`healthy`, ``on_health``, an ERROR, blocks
      counted ``redis_down``.
    * A batch from the hub goes as one pipeline, in order; running blocks that cannot be
      published are dropped and counted; a terminal is held (within its bounds) until a
      publish reaches a web process.
    * Room routing (``routing``, :mod:`kernel_ext.redis.routing`), ``chat_event`` in
      order with the blocks, and liveness heartbeats (``heartbeat_interval``) for
      :class:`~kernel_ext.relay.RelayRedisManager`; with them on, stops asked and answered
      on Redis (:class:`~kernel_ext.redis.stops.WorkerStops`).

    Raises:
        ConfigError: a bad argument (a ``retry_interval_max`` below ``retry_interval``, a
            URL redis-py cannot parse: :func:`~kernel_ext.settings.check_redis_url`, among
            them).
    """

    sender = "redis"
    down_event = OUTAGES

    # The keyword parameters are this sender's documented API; alike in shape (not a copy)
    # of LoopbackEmitter's and the relay's. OwedTerminals checks the terminal bounds.
    @remembers_arguments
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
        routing: bool = True,
    ) -> None:
        super().__init__(hub=hub, batch_max=batch_max, on_health=on_health)
        check_redis_url(url)
        if heartbeat_interval is not None:
            check_positive_numbers(heartbeat_interval=heartbeat_interval)
        check_positive_numbers(health_interval=health_interval, socket_timeout=socket_timeout)
        self.url = url
        self.channel = channel
        self.routing = bool(routing)
        self.namespace = namespace
        self.worker_id = check_worker_id(worker_id)
        self.heartbeat_interval = None if heartbeat_interval is None else float(heartbeat_interval)
        self._next_heartbeat = 0.0
        self.health_interval = float(health_interval)
        self._backoff = backoff(
            retry_interval=retry_interval, retry_interval_max=retry_interval_max
        )
        self.retry_interval = self._backoff.initial
        self.retry_interval_max = self._backoff.maximum
        self._options = {
            "socket_connect_timeout": socket_timeout,
            "socket_timeout": socket_timeout,
            **(redis_options or {}),
        }
        self._terminals = OwedTerminals(
            lambda: self.port,
            max_pending_terminals=max_pending_terminals,
            terminal_max_age=terminal_max_age,
            terminal_max_attempts=terminal_max_attempts,
        )
        self._manager: Any = None
        self._ping_client: Any = None
        self._first_ping = asyncio.Event()
        self._retry_at = 0.0
        self._stops: WorkerStops | None = None

    @property
    def outages(self) -> int:
        """How many times Redis was found unreachable."""
        return self.counts[OUTAGES]

    def _pending(self) -> int:
        return len(self._terminals)

    def _abandon_pending(self) -> int:
        return self._terminals.abandon()

    def _health_message(self, healthy: bool, why: object) -> tuple[int, str, tuple[object, ...]]:
        url = redacted_url(self.url)
        if healthy:
            return logging.INFO, "redis emitter: Redis at %s is reachable again", (url,)
        return (
            logging.ERROR,
            "redis emitter: Redis at %s is unreachable (%s); running blocks are dropped and "
            "terminals held until it is back",
            (url, why),
        )

    async def _open(self) -> None:
        from redis import asyncio as aioredis

        from kernel_ext.redis.stops import WorkerStops

        self._manager = _manager_class()(
            self.url,
            channel=self.channel,
            write_only=True,
            logger=logging.getLogger("kernel_ext.emit.redis"),
            redis_options=dict(self._options),
        )
        self._manager.routing = self.routing
        self._ping_client = aioredis.Redis.from_url(self.url, **self._options)
        if self.heartbeat_interval is not None:
            self._manager.emit_tags = {WORKER_TAG: self.worker_id}
            self._stops = WorkerStops(
                self.url,
                self.channel,
                self.worker_id,
                self._options,
                client=self._ping_client,  # its answers go with the pings and heartbeats
                count=self._count,
            )
            self._stops.start()
        if not compat.publish_result_supported():
            logger.warning(
                "redis emitter: this python-socketio does not report a publish's receivers; "
                "publishes are taken as delivered (outages show through pings only)"
            )
        self._next_heartbeat = 0.0
        self._first_ping = asyncio.Event()
        self._start_watcher(self._watch)

    async def _ready(self) -> None:
        await self._first_ping.wait()

    async def _close(self) -> None:
        await self._stop_watcher()
        if self._stops is not None:
            await self._stops.aclose()
            self._stops = None
        for client in (self._ping_client, getattr(self._manager, "redis", None)):
            if client is not None:
                close = getattr(client, "aclose", None) or client.close  # redis < 5.0.1
                with contextlib.suppress(Exception):
                    await close()
        self._ping_client = None
        self._manager = None

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
        self._count(HEARTBEATS)

    async def _watch(self) -> None:
        try:
            await self._ping()
            await self._heartbeat()
        finally:
            self._first_ping.set()
        while not self._stopping:
            if self._healthy and not len(self._terminals):
                interval = self.health_interval
            elif len(self._terminals):
                interval = max(0.01, self._retry_at - _now())
            else:
                interval = self.retry_interval
            if self.heartbeat_interval is not None and self._healthy:
                interval = max(0.01, min(interval, self._next_heartbeat - _now()))
            await self._pause(interval)
            if self._stopping:
                return
            await self._ping()
            await self._heartbeat()
            if self._healthy and len(self._terminals) and self._consumer is not None:
                self._consumer.poke()

    async def _publish(self, messages: list[tuple[str, Any, str]]) -> list[int | None]:
        """Emit ``(event, data, room)`` messages in order, in one Redis round trip
        (:meth:`kernel_ext.redis.publish_result.PublishResult.pipelined`); each one's receiver count
        (``_UNCONFIRMED`` when python-socketio does not report it), or ``None`` where Redis
        failed (then the emitter turns unhealthy)."""
        manager = self._manager
        namespace = self.namespace
        try:
            async with manager.pipelined() as receivers:
                for event, data, room in messages:
                    await manager.emit(event, data, namespace=namespace, room=room)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._set_healthy(False, f"publish failed: {exc}")
            return [None] * len(messages)
        if not compat.publish_result_supported():
            return [_UNCONFIRMED] * len(messages)
        counts: list[int | None] = list(receivers)
        if len(counts) < len(messages) or None in counts:
            self._set_healthy(False, "publish failed (see the socketio log)")
            self._wakeup.set()
            counts += [None] * (len(messages) - len(counts))
        return counts

    async def _send(self, items: list[Outgoing]) -> None:
        consumer = self.port
        if self._healthy and len(self._terminals) and _now() >= self._retry_at:
            await self._retry_terminals()
        if not self._healthy:
            for item in items:
                if isinstance(item, OutgoingChatEvent):
                    consumer.dropped(REDIS_DOWN)
                else:
                    self._drop_or_hold(item, REDIS_DOWN)
            return
        results = await self._publish(
            [
                (CHAT_EVENT, item.event, item.room)
                if isinstance(item, OutgoingChatEvent)
                else (TOOL_EVENT_STREAM, item.block, item.room)
                for item in items
            ]
        )
        delivered = 0
        for item, receivers in zip(items, results, strict=True):
            if isinstance(item, OutgoingChatEvent):
                if receivers is None:
                    consumer.dropped(REDIS_DOWN)
            elif receivers is None:
                self._drop_or_hold(item, REDIS_DOWN)
            elif receivers == 0:
                self._count(NO_LISTENER)
                self._drop_or_hold(item, NO_LISTENER)
            else:
                delivered += 1
        if delivered:
            consumer.delivered(delivered)

    def _drop_or_hold(self, item: OutgoingBlock, reason: str) -> None:
        if item.terminal:
            self._terminals.hold(self._terminals.new(item, attempts=1))
            self._schedule_retry()
        else:
            self.port.dropped(reason, 1, item.call_id)

    def _schedule_retry(self) -> None:
        self._retry_at = _now() + self._backoff.next()
        self._wakeup.set()

    async def _retry_terminals(self) -> None:
        entries = self._terminals.take()
        for entry in entries:
            entry.attempts += 1
        results = await self._publish(
            [(TOOL_EVENT_STREAM, entry.item.block, entry.item.room) for entry in entries]
        )
        delivered = 0
        for entry, receivers in zip(entries, results, strict=True):
            if receivers:
                delivered += 1
            else:
                self._terminals.hold(entry)
        if delivered:
            self.port.delivered(delivered)
            self._count(TERMINAL_RESENDS, delivered)
        if len(self._terminals):
            self._schedule_retry()
        else:
            self._backoff.reset()
