"""Stops on Redis: a browser's stop request reaches a worker that no web process it is on holds.

Two paths (the rules of the relay's side: :mod:`kernel_ext.relay.stops`), both asked by a
web process's :class:`RelayStops`, which publishes ``{"v": 1, …, "from": <host_id>, "id":
n}`` and waits at most ``stop_timeout`` seconds for the reply ``{"id": n, "answer",
"reason"?}`` on its own reply channel (:func:`~kernel_ext.redis.routing.stop_reply_channel`,
by its manager's ``host_id``), to which it subscribes, with the web processes' stop channel
(:func:`~kernel_ext.redis.routing.relay_stop_channel`), from its first worker connection or
its first stop asked on Redis on, before it publishes a request. Redis not taking the
request: ``unreachable`` (``stop_publish_failed``); no one who could answer listening:
``unreachable`` at once; no reply in time: ``unreachable`` (``stop_no_answer``).

* **Write-only workers.** A :class:`~kernel_ext.emit.RedisEmitter` that tags its emits with
  its worker id (heartbeats on, the default) subscribes, while it runs, to its own stop
  channel (:func:`kernel_ext.redis.routing.stop_channel`): :class:`WorkerStops`. The
  browser's web process publishes ``{"v": 1, "callId", "from", "id"}`` there; the worker
  hands it to :func:`kernel_ext.stop_call` (a malformed one: ``refused``) and publishes
  what it answered — ``stopping``, ``already_ended``, ``unknown``, ``refused`` — on the
  requester's reply channel, with the client it pings with; that is the browser's answer (a
  reply Redis does not take: the worker's ``stop_reply_failed``). A request without ``from`` and
  ``id`` (a web process from before the replies) still stops its call, unanswered.
* **Loopback workers connected to another web process.** The browser's web process knows
  the call runs (its blocks reached it through Redis) but not its owner. It publishes
  ``{"v": 1, "room", "callId", "from", "id"}`` on the web processes' stop channel; a web
  process whose worker owns an open stream of that call in that room asks it
  (``kx_stop``) and publishes its answer on the requester's reply channel; the others say
  nothing.

A reply counts only with an ``id`` the web process waits for and an ``answer`` among
:data:`~kernel_ext.protocol.STOP_ANSWERS` (its ``reason`` kept, its first 200 characters,
when it is text UTF-8 can carry); a request's ``from`` only when it is shaped as an id
(:func:`~kernel_ext.redis.routing.reply_channel`); anything else is ignored.

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
from kernel_ext.observability.count_names import (
    STOP_NO_ANSWER,
    STOP_PUBLISH_FAILED,
    STOP_REPLY_FAILED,
)
from kernel_ext.protocol import STOP_ANSWERS, is_well_formed
from kernel_ext.redis.routing import (
    relay_stop_channel,
    reply_channel,
    stop_channel,
    stop_reply_channel,
)

if TYPE_CHECKING:
    from kernel_ext.relay.delivery import StopWays
from kernel_ext.stop import stop_call

__all__ = ["RelayStops", "StopSubscription", "WorkerStops"]

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


class WorkerStops:
    """A write-only worker's stop channel (:func:`~kernel_ext.redis.routing.stop_channel` of
    ``channel`` and ``worker``): each request is handed to :func:`kernel_ext.stop_call`
    (anything malformed: ``refused``), and its answer, ``{"id", "answer"}``, published with
    ``client`` (the worker's own, already open) on the reply channel the request names by
    ``from`` and ``id`` (:func:`~kernel_ext.redis.routing.reply_channel`); a request without
    them still stops its call, unanswered. A reply Redis does not take is counted
    ``stop_reply_failed`` with ``count`` and logged rarely. Never raises."""

    def __init__(
        self,
        url: str,
        channel: str,
        worker: str,
        options: Mapping[str, Any],
        *,
        client: Any,
        count: Callable[[str], None],
    ) -> None:
        self._channel = channel
        self._client = client
        self._count = count
        self._replying: set[asyncio.Task[None]] = set()
        self.subscription = StopSubscription(
            url, [stop_channel(channel, worker)], self._handle, options=options
        )

    def start(self) -> None:
        """Subscribe (once)."""
        self.subscription.start()

    async def aclose(self) -> None:
        """Unsubscribe; replies not yet published are dropped. Idempotent."""
        await self.subscription.aclose()
        await _cancel(self._replying)

    def _handle(self, channel: str, data: Any) -> None:
        request = _parse(data)
        v = request.get("v")
        call_id = request.get("callId") if v.__class__ is int and v == 1 else None
        answer = stop_call(call_id, reason="asked over Redis")
        to = reply_channel(self._channel, request.get("from"))
        key = request.get("id")
        if to is None or key.__class__ is not int:
            return  # a web process that waits for no answer
        reply = {"id": key, "answer": answer}
        task = asyncio.get_running_loop().create_task(self._reply(to, reply))
        self._replying.add(task)
        task.add_done_callback(self._replying.discard)

    async def _reply(self, to: str, reply: dict[str, Any]) -> None:
        """Publish ``reply`` on ``to``, tried twice: the client's pooled connection may be
        one Redis dropped since (an outage it has recovered from), which fails once and is
        then made anew."""
        text = json.dumps(reply)
        for attempt in (1, 2):
            try:
                await self._client.publish(to, text)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if attempt == 2:
                    self._count(STOP_REPLY_FAILED)
                    _rare(
                        "stop_reply_failed",
                        "kernel_ext: a stop's answer was not published (%s)",
                        exc,
                    )


async def _cancel(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait until they are done."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _parse(data: Any) -> dict[str, Any]:
    """A message's JSON object, or ``{}``."""
    try:
        message = json.loads(data)
    except (TypeError, ValueError, RecursionError):  # RecursionError: nested too deep
        return {}
    return message if isinstance(message, dict) else {}


_UNREACHABLE = "unreachable"


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


class RelayStops:
    """A web process's stops on Redis (module docstring): it asks write-only workers
    (:meth:`ask_worker`) and the other web processes (:meth:`forward`), and answers the
    requests they forward for its own workers, on one subscription.

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
        await _cancel(self._serving)

    async def ask_worker(self, worker: str, call_id: str) -> dict[str, Any]:
        """Ask the write-only worker ``worker`` on its stop channel; its answer for the
        browser."""
        return await self._ask(
            stop_channel(self._manager.channel, worker),
            {"v": 1, "callId": call_id},
            others=0,
            nobody="the call's worker does not listen",
            silent="the call's worker did not answer",
        )

    async def forward(self, room: str, call_id: str) -> dict[str, Any]:
        """Ask the web process whose worker owns the call; the answer for the browser."""
        return await self._ask(
            self._requests,
            {"v": 1, "room": room, "callId": call_id},
            others=1,  # this process listens too
            nobody="no other web process listens",
            silent="no web process answered for the call",
        )

    async def _ask(
        self, channel: str, request: dict[str, Any], *, others: int, nobody: str, silent: str
    ) -> dict[str, Any]:
        """Publish ``request`` on ``channel`` with where to answer (``from``: this process's
        host id; ``id``: a number of its own) once this process hears its reply channel, and
        wait for the reply of that id at most ``ways.timeout`` seconds. ``unreachable``: Redis
        did not take it (counted ``stop_publish_failed``), at most ``others`` receivers
        (``nobody``), no reply in time (``silent``, counted ``stop_no_answer``)."""
        self.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.subscription.subscribed.wait(), self.ways.timeout)
        if not self.subscription.subscribed.is_set():
            return _not_published(self.ways)
        key = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[key] = reply
        try:
            message = {**request, "from": self._host, "id": key}
            receivers = await _publish(self._manager, channel, message, self.ways)
            if receivers is None:
                return _not_published(self.ways)
            if receivers <= others:
                return {"answer": _UNREACHABLE, "reason": nobody}
            try:
                return await asyncio.wait_for(reply, self.ways.timeout)
            except asyncio.TimeoutError:
                self.ways.count(STOP_NO_ANSWER)
                _rare("stop_no_answer", "kernel_ext: a stop asked on Redis got no answer in time")
                return {"answer": _UNREACHABLE, "reason": silent}
        finally:
            self._waiting.pop(key, None)

    def _handle(self, channel: str, data: Any) -> None:
        """One message on the stop channel (a request) or on this process's reply channel
        (a reply: used when its ``id`` is one this process waits for and its ``answer`` one
        of :data:`~kernel_ext.protocol.STOP_ANSWERS`; its ``reason`` kept when it is text
        UTF-8 can carry, its first 200 characters)."""
        message = _parse(data)
        key = message.get("id")
        if key.__class__ is not int:
            return
        if channel == self._replies:
            reply = self._waiting.get(key)
            answer = message.get("answer")
            if reply is not None and not reply.done() and answer in STOP_ANSWERS:
                result = {"answer": answer}
                reason = message.get("reason")
                if isinstance(reason, str) and is_well_formed(reason):
                    result["reason"] = reason[:200]
                reply.set_result(result)
            return
        sender = message.get("from")
        to = reply_channel(self._manager.channel, sender)
        if channel != self._requests or to is None or sender == self._host:
            return
        room, call_id = message.get("room"), message.get("callId")
        if not isinstance(room, str) or not isinstance(call_id, str):
            return  # the relay's stops check the rest (its local answer)
        task = asyncio.get_running_loop().create_task(self._serve(room, call_id, to, key))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, room: str, call_id: str, to: str, key: int) -> None:
        """Answer a forwarded request on ``to`` when a worker of this process owns the call."""
        try:
            answer = await self.ways.local(room, call_id)
            if answer is not None:
                await _publish(self._manager, to, {"id": key, **answer}, self.ways)
        except asyncio.CancelledError:
            raise
        except Exception:
            _rare("stop_forward_failed", "relay: answering a forwarded stop failed", exc_info=True)
