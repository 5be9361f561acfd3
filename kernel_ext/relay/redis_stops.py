"""Behind Redis: a browser's stop for a loopback worker connected to another web process.

A worker on the loopback path is connected to one web process; a browser of its
conversation may be on any. The web process the browser is on knows the call is running (its
blocks reached it, through Redis) but not which worker owns it. So it forwards the request,
and the web process that owns it asks its worker:

* Every web process with a Redis manager subscribes, from its first worker connection or its
  first forwarded stop on, to the web processes' stop channel
  (:func:`~kernel_ext._redis_routing.relay_stop_channel`) and to its own reply channel
  (:func:`~kernel_ext._redis_routing.stop_reply_channel`, by its manager's ``host_id``), on
  a Redis connection of its own (:class:`~kernel_ext.emit.redis_stops.Subscription`).
* The browser's web process publishes ``{"v": 1, "room", "callId", "from": <host_id>,
  "id": n}`` on the stop channel and waits for a reply at most ``stop_timeout`` seconds. A
  web process whose worker owns an open stream of that call in that room asks it
  (``kx_stop``) and publishes its answer, ``{"id": n, "answer", "reason"?}``, on the
  requester's reply channel; the others say nothing.
* The browser gets the worker's answer; ``unreachable`` when Redis did not take the request
  (``stop_publish_failed``), when no other web process listens, or when no answer came in
  time (``stop_no_answer``: the owner's web process is gone, or its worker is).

Used from the event loop's thread only. Never raises into the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from kernel_ext._redis_routing import relay_stop_channel, stop_reply_channel
from kernel_ext._shared.compat import connect_redis
from kernel_ext.emit.redis_stops import Subscription
from kernel_ext.observability.count_names import STOP_NO_ANSWER, STOP_PUBLISH_FAILED
from kernel_ext.protocol import STOP_ANSWERS
from kernel_ext.relay._log import rare

__all__ = ["StopForwarding"]

Local = Callable[[str, str], Awaitable[dict[str, Any] | None]]
"""``await local(room, call_id)``: the answer of this process's worker that owns the call,
``None`` when none does."""
_UNREACHABLE = "unreachable"


class StopForwarding:
    """Stops forwarded among the web processes on one Redis channel (module docstring).

    Args:
        manager: the server's Redis client manager (python-socketio's ``AsyncRedisManager``
            or a subclass: its ``redis_url``, ``redis_options``, ``channel``, ``host_id``
            and publishing client).
        local: asks this process's owning worker (:data:`Local`).
        count: the relay's counter.
        timeout: seconds to wait for Redis and for the reply.
    """

    def __init__(
        self, manager: Any, local: Local, count: Callable[[str], None], timeout: float
    ) -> None:
        self._manager = manager
        self._local = local
        self._count = count
        self._timeout = timeout
        self._host = str(manager.host_id)
        self._requests = relay_stop_channel(manager.channel)
        self._replies = stop_reply_channel(manager.channel, self._host)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._serving: set[asyncio.Task[None]] = set()
        self.subscription = Subscription(
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
            await asyncio.wait_for(self.subscription.subscribed.wait(), self._timeout)
        if not self.subscription.subscribed.is_set():
            return self._not_published()
        key = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[key] = reply
        request = {"v": 1, "room": room, "callId": call_id, "from": self._host, "id": key}
        try:
            receivers = await self._publish(self._requests, request)
            if receivers is None:
                return self._not_published()
            if receivers <= 1:  # this process only
                return {"answer": _UNREACHABLE, "reason": "no other web process listens"}
            try:
                return await asyncio.wait_for(reply, self._timeout)
            except asyncio.TimeoutError:
                self._count(STOP_NO_ANSWER)
                return {"answer": _UNREACHABLE, "reason": "no web process answered for the call"}
        finally:
            self._waiting.pop(key, None)

    def _not_published(self) -> dict[str, Any]:
        self._count(STOP_PUBLISH_FAILED)
        rare("stop_publish_failed", "relay: a stop could not be forwarded on Redis")
        return {"answer": _UNREACHABLE, "reason": "Redis did not take the request"}

    async def _publish(self, channel: str, message: dict[str, Any]) -> int | None:
        """Publish on the manager's client; the receivers, or ``None`` when it failed."""
        manager = self._manager
        try:
            connect_redis(manager)
            receivers = await asyncio.wait_for(
                manager.redis.publish(channel, json.dumps(message)), self._timeout
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            return None
        return receivers if isinstance(receivers, int) and not isinstance(receivers, bool) else None

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
        # Imported here: kernel_ext.relay.stops makes this object.
        from kernel_ext.relay.stops import read_request

        request = read_request(message)
        if request is None:
            return
        task = asyncio.get_running_loop().create_task(self._serve(*request, sender, key))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, room: str, call_id: str, sender: str, key: int) -> None:
        """Answer a forwarded request when a worker of this process owns the call."""
        try:
            answer = await self._local(room, call_id)
            if answer is not None:
                channel = stop_reply_channel(self._manager.channel, sender)
                await self._publish(channel, {"id": key, **answer})
        except asyncio.CancelledError:
            raise
        except Exception:
            rare("stop_forward_failed", "relay: answering a forwarded stop failed", exc_info=True)
