"""Stops on Redis: a browser's stop request reaches a worker that no web process it is on holds.

Two paths (the rules of the relay's side: :mod:`kernel_ext.relay.stops`):

* **Write-only workers.** A :class:`~kernel_ext.emit.RedisEmitter` that tags its emits with
  its worker id (heartbeats on, the default) subscribes, while it runs, to its own stop
  channel (:func:`kernel_ext.redis.routing.stop_channel`): :func:`listen_for_stops`. A web
  process publishes ``{"v": 1, "callId"}`` there; each message is handed to
  :func:`kernel_ext.stop_call` (a malformed one: ``refused`` in its counts). The web
  process answers the browser by Redis's receiver count: ``stopping`` while this
  subscription stands, ``unreachable`` while it does not.
* **Loopback workers connected to another web process** (:class:`StopForwarding`). The
  browser's web process knows the call runs (its blocks reached it through Redis) but not
  its owner. Every web process with a Redis manager subscribes, from its first worker
  connection or its first forwarded stop on, to the web processes' stop channel
  (:func:`~kernel_ext.redis.routing.relay_stop_channel`) and to its own reply channel
  (:func:`~kernel_ext.redis.routing.stop_reply_channel`, by its manager's ``host_id``).
  The browser's web process publishes ``{"v": 1, "room", "callId", "from": <host_id>,
  "id": n}`` and waits for a reply at most ``stop_timeout`` seconds; a web process whose
  worker owns an open stream of that call in that room asks it (``kx_stop``) and
  publishes its answer, ``{"id": n, "answer", "reason"?}``, on the requester's reply
  channel; the others say nothing. No answer in time, Redis not taking the request, no
  other web process listening: ``unreachable``.

:class:`StopSubscription` is each of those subscriptions: a Redis connection of its own (a
subscribed connection can do nothing else), made again after a jittered backoff (0.25 s up
to 5 s) when Redis drops or refuses it; the first failure of each outage is logged at
WARNING, later ones rarely, the recovery at INFO. Nothing here raises into its owner; used
from the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kernel_ext._shared.backoff import Backoff
from kernel_ext._shared.compat import connect_redis
from kernel_ext.observability._rare_log import RareLog
from kernel_ext.observability.count_names import STOP_NO_ANSWER, STOP_PUBLISH_FAILED
from kernel_ext.protocol import STOP_ANSWERS
from kernel_ext.redis.routing import relay_stop_channel, stop_channel, stop_reply_channel

if TYPE_CHECKING:
    from kernel_ext.relay.delivery import StopWays
from kernel_ext.stop import stop_call

__all__ = ["StopForwarding", "StopSubscription", "listen_for_stops", "publish_stop"]

_log = logging.getLogger("kernel_ext.redis")
_rare = RareLog(_log)

Handle = Callable[[str, Any], None]
"""``handle(channel, data)``: one message (``data`` as redis-py gives it: bytes)."""


class StopSubscription:
    """Subscribe to ``channels`` on the Redis at ``url`` (redis-py ``options``, less a read
    timeout: a subscription waits for messages) and hand each message to ``handle``, until
    :meth:`aclose`; ``what`` names it in the log. :attr:`subscribed` is set while the
    subscription stands."""

    def __init__(
        self,
        url: str,
        channels: list[str],
        handle: Handle,
        *,
        options: Mapping[str, Any] | None = None,
        what: str = "stops",
    ) -> None:
        self.url = url
        self.channels = list(channels)
        self._handle = handle
        self._options = {k: v for k, v in (options or {}).items() if k != "socket_timeout"}
        self._what = what
        self.subscribed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start listening in a task of the running loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        """Stop listening (the subscription's connection closed). Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.subscribed.clear()

    async def _run(self) -> None:
        from redis import asyncio as aioredis

        backoff = Backoff(0.25, 5.0)
        down = False
        while True:
            client = aioredis.Redis.from_url(self.url, **self._options)
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(*self.channels)
                self.subscribed.set()
                backoff.reset()
                if down:
                    _log.info("kernel_ext: listening for %s on Redis again", self._what)
                    down = False
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        channel = message.get("channel")
                        if isinstance(channel, bytes):
                            channel = channel.decode("utf-8", "replace")
                        self._handle(str(channel), message.get("data"))
                raise ConnectionError("the subscription ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.subscribed.clear()
                if not down:
                    _log.warning(
                        "kernel_ext: not listening for %s on Redis (%s); trying again",
                        self._what,
                        exc,
                    )
                    down = True
                else:
                    _rare("stop_listen", "kernel_ext: still not listening on Redis")
            finally:
                with contextlib.suppress(Exception):
                    close = getattr(client, "aclose", None) or client.close  # redis < 5.0.1
                    await close()
            await asyncio.sleep(backoff.next())


def listen_for_stops(url: str, channel: str, options: Mapping[str, Any]) -> StopSubscription:
    """A write-only worker's subscription to its stop ``channel`` (started)."""
    subscription = StopSubscription(url, [channel], _stop, options=options)
    subscription.start()
    return subscription


def _stop(channel: str, data: Any) -> None:
    """Stop the call a stop message asks for (anything malformed: ``refused``)."""
    try:
        request = json.loads(data)
    except (TypeError, ValueError):
        request = None
    call_id = request.get("callId") if isinstance(request, dict) and request.get("v") == 1 else None
    stop_call(call_id, reason="asked over Redis")


_UNREACHABLE = "unreachable"


async def publish_stop(manager: Any, worker: str, call_id: str, ways: StopWays) -> dict[str, Any]:
    """Ask the write-only worker ``worker`` to stop ``call_id`` on its stop channel, with
    ``manager``'s publishing client; the answer for the browser by Redis's receiver count
    (``stopping`` when at least 1; ``unreachable`` when none, or when Redis did not take it
    within ``ways.timeout``: counted ``stop_publish_failed``)."""
    message = {"v": 1, "callId": call_id}
    receivers = await _publish(manager, stop_channel(manager.channel, worker), message, ways)
    if receivers is None:
        return _not_published(ways)
    if receivers == 0:
        return {"answer": _UNREACHABLE, "reason": "the call's worker does not listen"}
    return {"answer": "stopping"}


async def _publish(
    manager: Any, channel: str, message: dict[str, Any], ways: StopWays
) -> int | None:
    """Publish on the manager's client; the receivers, or ``None`` when it failed."""
    try:
        connect_redis(manager)
        receivers = await asyncio.wait_for(
            manager.redis.publish(channel, json.dumps(message)), ways.timeout
        )
    except asyncio.CancelledError:
        raise
    except Exception:
        return None
    return receivers if isinstance(receivers, int) and not isinstance(receivers, bool) else None


def _not_published(ways: StopWays) -> dict[str, Any]:
    ways.count(STOP_PUBLISH_FAILED)
    _rare("stop_publish_failed", "kernel_ext: a stop could not be published on Redis")
    return {"answer": _UNREACHABLE, "reason": "Redis did not take the request"}


class StopForwarding:
    """Stops forwarded among the web processes on one Redis channel (module docstring).

    Args:
        manager: the server's Redis client manager (python-socketio's ``AsyncRedisManager``
            or a subclass: its ``redis_url``, ``redis_options``, ``channel``, ``host_id``
            and publishing client).
        ways: the relay's ways to answer for its own workers, count and wait
            (:class:`~kernel_ext.relay.delivery.StopWays`).
    """

    def __init__(self, manager: Any, ways: StopWays) -> None:
        self._manager = manager
        self.ways = ways
        self._host = str(manager.host_id)
        self._requests = relay_stop_channel(manager.channel)
        self._replies = stop_reply_channel(manager.channel, self._host)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._serving: set[asyncio.Task[None]] = set()
        self.subscription = StopSubscription(
            manager.redis_url,
            [self._requests, self._replies],
            self._handle,
            options=getattr(manager, "redis_options", None),
            what="forwarded stops",
        )

    def start(self) -> None:
        """Subscribe (once)."""
        self.subscription.start()

    async def aclose(self) -> None:
        """Unsubscribe; stop answering for this process's workers. Idempotent."""
        await self.subscription.aclose()
        tasks = list(self._serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def forward(self, room: str, call_id: str) -> dict[str, Any]:
        """Ask the web process whose worker owns the call; the answer for the browser."""
        self.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.subscription.subscribed.wait(), self.ways.timeout)
        if not self.subscription.subscribed.is_set():
            return _not_published(self.ways)
        key = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[key] = reply
        request = {"v": 1, "room": room, "callId": call_id, "from": self._host, "id": key}
        try:
            receivers = await _publish(self._manager, self._requests, request, self.ways)
            if receivers is None:
                return _not_published(self.ways)
            if receivers <= 1:  # this process only
                return {"answer": _UNREACHABLE, "reason": "no other web process listens"}
            try:
                return await asyncio.wait_for(reply, self.ways.timeout)
            except asyncio.TimeoutError:
                self.ways.count(STOP_NO_ANSWER)
                return {"answer": _UNREACHABLE, "reason": "no web process answered for the call"}
        finally:
            self._waiting.pop(key, None)

    def _handle(self, channel: str, data: Any) -> None:
        """One message on the stop channel (a request) or on this process's reply channel."""
        try:
            message = json.loads(data)
        except (TypeError, ValueError):
            return
        if not isinstance(message, dict):
            return
        key = message.get("id")
        if key.__class__ is not int:
            return
        if channel == self._replies:
            reply = self._waiting.get(key)
            answer = message.get("answer")
            if reply is not None and not reply.done() and answer in STOP_ANSWERS:
                reason = message.get("reason")
                result = {"answer": answer}
                if isinstance(reason, str):
                    result["reason"] = reason[:200]
                reply.set_result(result)
            return
        sender = message.get("from")
        if channel != self._requests or not isinstance(sender, str) or sender == self._host:
            return
        room, call_id = message.get("room"), message.get("callId")
        if not isinstance(room, str) or not isinstance(call_id, str):
            return  # the relay's stops check the rest (its local answer)
        task = asyncio.get_running_loop().create_task(self._serve(room, call_id, sender, key))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, room: str, call_id: str, sender: str, key: int) -> None:
        """Answer a forwarded request when a worker of this process owns the call."""
        try:
            answer = await self.ways.local(room, call_id)
            if answer is not None:
                channel = stop_reply_channel(self._manager.channel, sender)
                await _publish(self._manager, channel, {"id": key, **answer}, self.ways)
        except asyncio.CancelledError:
            raise
        except Exception:
            _rare("stop_forward_failed", "relay: answering a forwarded stop failed", exc_info=True)
