"""The manager's subscription: its own redis-py client subscribed to the channel, kept
up on kernel_ext's retry schedule, and to the channel of each room this process has a
browser in (:mod:`kernel_ext.redis.routing`): a part of
:class:`~kernel_ext.redis.manager.RelayRedisManager`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import socketio

from kernel_ext._shared.backoff import Backoff
from kernel_ext.observability._rare_log import is_rare, plural
from kernel_ext.observability.count_names import REDIS_UNREACHABLE
from kernel_ext.redis.routing import RoutedPublish, marker_channel, room_channel
from kernel_ext.relay._log import logger
from kernel_ext.settings import redacted_url

__all__ = ["Subscription"]


class Subscription(RoutedPublish, socketio.AsyncRedisManager):  # type: ignore[misc, unused-ignore]
    """Listens to Redis and says how that goes (:attr:`redis_state`)."""

    # Its state, set by the manager's constructor.
    routing: bool
    redis_state: str
    connect_timeout: float
    _url: str
    _reconnect: Backoff
    _started: bool
    _tried: asyncio.Event
    _pubsub: Any
    _syncing: asyncio.Task[None] | None
    _wanted: dict[str, tuple[str, str]]
    _joining: dict[tuple[str, str], int]
    _asked: set[str]
    _changed: set[str]
    _unconfirmed: dict[str, int]
    _subscribed_to: dict[str, asyncio.Event]
    _read_logs: set[str]

    def basic_enter_room(self, sid: str, namespace: str, room: Any, eio_sid: Any = None) -> None:
        super().basic_enter_room(sid, namespace, room, eio_sid=eio_sid)
        self._interest(namespace, room)

    def basic_leave_room(self, sid: str, namespace: str, room: Any) -> None:
        super().basic_leave_room(sid, namespace, room)
        self._interest(namespace, room)

    def _interest(self, namespace: str, room: Any) -> None:
        """Want ``room``'s channel while a browser of this process is in it or joins it."""
        if not self.routing or room.__class__ is not str:
            return
        channel = room_channel(self.channel, namespace, room)
        if self._joining.get((namespace, room)) or self.rooms.get(namespace, {}).get(room):
            if channel in self._wanted:
                return
            self._wanted[channel] = (namespace, room)
        elif self._wanted.pop(channel, None) is None:
            return
        self._changed.add(channel)
        self._sync_soon()

    def _sync_soon(self) -> None:
        if self._pubsub is not None and (self._syncing is None or self._syncing.done()):
            self._syncing = asyncio.get_running_loop().create_task(self._sync())

    async def _sync(self) -> None:
        """Subscribe to the wanted room channels not asked for yet, unsubscribe from the
        others, on the current subscription, until nothing changes."""
        while (pubsub := self._pubsub) is not None and self._changed:
            changed, self._changed = self._changed, set()
            wanted, asked = self._wanted, self._asked
            more = [c for c in changed if c in wanted and c not in asked]
            fewer = [c for c in changed if c not in wanted and c in asked]
            if not more and not fewer:
                continue
            self._asked.update(more)
            self._asked.difference_update(fewer)
            for channel in more:
                self._unconfirmed[channel] = self._unconfirmed.get(channel, 0) + 1
            for channel in fewer:
                self._subscribed_to.pop(channel, None)
                self._read_logs.discard(channel)
            try:
                if more:
                    await pubsub.subscribe(*more)
                if fewer:
                    await pubsub.unsubscribe(*fewer)
            except asyncio.CancelledError:
                raise
            except Exception:
                return  # the listener notices too, and subscribes anew to what is wanted

    def _confirm(self, channel: str) -> None:
        """Redis confirmed a subscription to ``channel``: once it confirmed every one asked
        for on this connection (a room left and joined again is asked for twice), the
        channel's joiners may go on."""
        left = self._unconfirmed.get(channel, 0) - 1
        if left > 0:
            self._unconfirmed[channel] = left
            return
        self._unconfirmed.pop(channel, None)
        if channel not in self._asked:
            return
        event = self._subscribed_to.get(channel)
        if event is None:
            event = self._subscribed_to[channel] = asyncio.Event()
        event.set()

    async def _until_subscribed(self, channel: str) -> bool:
        """Whether Redis confirmed this process's subscription to ``channel`` (waiting up to
        ``connect_timeout`` seconds, the first subscription included; at once ``False``
        while Redis does not answer)."""
        if self._pubsub is None and self.redis_state == "connecting":
            await self.tried(self.connect_timeout)
        if self._pubsub is None:
            return False
        event = self._subscribed_to.get(channel)
        if event is None:
            event = self._subscribed_to[channel] = asyncio.Event()
        try:
            await asyncio.wait_for(event.wait(), self.connect_timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def initialize(self) -> None:
        """python-socketio's start (the listener task); only the first call does anything,
        so :meth:`start` and the server's own call at its first connection start one."""
        if self._started:
            return
        self._started = True
        self.redis_state = "connecting"  # the listener task runs next
        super().initialize()

    def start(self) -> None:
        """Start listening now, on the running event loop, instead of at the server's first
        connection (the manager must belong to a server). Idempotent."""
        if self.server is None:
            raise RuntimeError("RelayRedisManager.start(): not the client manager of a server")
        self.initialize()

    async def tried(self, timeout: float) -> str:
        """:attr:`redis_state` once the first attempt to subscribe has ended, or after
        ``timeout`` seconds (then ``"connecting"`` or ``"idle"``)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._tried.wait(), timeout)
        return self.redis_state

    def _schedule(self) -> str:
        backoff = self._reconnect
        return (
            f"retrying ({backoff.initial:g} s between attempts, doubling up to "
            f"{backoff.maximum:g} s)"
        )

    async def _subscribed(self) -> AsyncIterator[Any]:
        """The messages of the channel, from a subscription of this manager's own, kept up:
        on any failure :attr:`redis_state` turns ``"unreachable"`` and it subscribes again on
        its schedule (class docstring)."""
        from redis import asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        marker = marker_channel(self.channel).encode("utf-8")
        backoff = self._reconnect
        self.redis_state = "connecting"
        failures = 0
        while True:
            client = aioredis.Redis.from_url(
                self._url,
                socket_connect_timeout=self.connect_timeout,
                retry=Retry(NoBackoff(), 0),  # this loop retries, on its own schedule
            )
            pubsub = client.pubsub()
            try:
                await asyncio.wait_for(pubsub.subscribe(self.channel), self.connect_timeout)
                if self.routing:
                    # The rooms wanted now (those wanted later: _sync), and the marker that
                    # tells publishers that this process routes, last.
                    self._asked = set(self._wanted)
                    self._changed.clear()
                    self._unconfirmed = dict.fromkeys(self._asked, 1)
                    if self._asked:
                        await pubsub.subscribe(*self._asked)
                    await pubsub.subscribe(marker_channel(self.channel))
                    self._pubsub = pubsub
                    self._sync_soon()
                    if failures and self._wanted:
                        asyncio.get_running_loop().create_task(self._recover())
                if failures:
                    logger.info(
                        "relay: Redis at %s answers again (after %s)",
                        redacted_url(self._url),
                        plural(failures, "failed attempt"),
                    )
                failures = 0
                backoff.reset()
                self.redis_state = "connected"
                self._tried.set()
                async for message in pubsub.listen():
                    kind = message.get("type")
                    if kind == "message":
                        if message.get("channel") != marker:
                            yield message.get("data")
                    elif kind == "subscribe":
                        name = message.get("channel")
                        if isinstance(name, bytes):
                            self._confirm(name.decode("utf-8", "surrogateescape"))
                raise ConnectionError("the subscription ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self.redis_state = "unreachable"
                self._tried.set()
                self._bump(REDIS_UNREACHABLE)
                if is_rare(failures):
                    logger.warning(
                        "relay: Redis at %s does not answer (%s); %s until it does, not "
                        "ready until then [failed attempt %d of this outage]",
                        redacted_url(self._url),
                        _scrubbed(exc, self._url),
                        self._schedule(),
                        failures,
                    )
            finally:
                if self._pubsub is pubsub:
                    self._pubsub = None
                    self._asked.clear()
                    self._unconfirmed.clear()
                    self._read_logs.clear()
                    for event in self._subscribed_to.values():
                        event.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(backoff.next())


def _scrubbed(exc: BaseException, url: str) -> str:
    """``exc`` as ``Type: message``, without the URL's password should the message hold it."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    with contextlib.suppress(ValueError):
        password = urlsplit(url).password
        if password:
            text = text.replace(password, "***")
    return text
