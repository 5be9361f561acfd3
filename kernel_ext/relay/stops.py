"""A browser's stop request (``stop_call``), from the relay to the worker that owns the call.

:class:`Stops` answers one ``stop_call`` ``{"v": 1, "room", "callId"}`` of a browser
(docs/web.md, "Stopping a call") with ``{"answer": A}`` and maybe ``"reason"``, A one of
:data:`~kernel_ext.protocol.STOP_ANSWERS`. It guarantees:

* **Refused** (``refused``, counted ``rejected_<reason>``, logged rarely), in this order:
  a connection that is not a browser (``not_browser``); past the browser's rate —
  ``stop_rate`` requests a second once ``stop_burst`` are spent, a token bucket per
  connection (:class:`~kernel_ext.relay.limits.TokenBuckets`; ``stop_rate``), checked
  before anything is read, so a flood of any kind costs a dict step each; a malformed
  request (``bad_stop``: not a mapping, ``v`` not the integer 1, ``room`` not a non-empty
  string of at most :data:`~kernel_ext.protocol.MAX_CONVERSATION_ID_CHARS` characters that
  UTF-8 can encode — no lone surrogate —, ``callId`` not 16 lower-case hex digits); a room
  this browser has not joined on this web process (``stop_not_joined``); the application's
  ``authorize_stop(identity, conversation_id, call_id)`` hook saying no, or raising
  (``stop_forbidden``).
* **Routed to the owner** of the call's open stream in that room, the one that sent its
  latest running block (:class:`~kernel_ext.relay.workers.OpenStreams`):

  - a worker connected to this web process (loopback): asked on its own connection,
    ``kx_stop`` ``{"v": 1, "callId"}``, and its answer (what
    :func:`kernel_ext.stop_call` said: ``stopping``, ``already_ended``, ``unknown``) is the
    browser's; no usable answer within ``stop_timeout`` seconds: ``unreachable``
    (``stop_no_answer``); the worker has no connection now (it is within its grace):
    ``unreachable``;
  - a write-only worker on Redis (:class:`~kernel_ext.emit.RedisEmitter`, known from its
    tagged blocks): the request is published on that worker's stop channel
    (:func:`kernel_ext._redis_routing.stop_channel`), to which it subscribes
    (:mod:`kernel_ext._redis_stops`); Redis's receiver count 0: ``unreachable``, at
    least 1: ``stopping`` (the worker's own answer does not come back: the terminal does);
    the publish failed or Redis did not answer within ``stop_timeout``: ``unreachable``
    (``stop_publish_failed``).
* **Otherwise**, from this process's catch-up memory of that room
  (:meth:`~kernel_ext.relay.replay.ReplayMemory.call_state`): the call's streams all ended
  — ``already_ended``; one is running but no worker of this process owns it — behind Redis,
  forwarded to the web process whose loopback worker does
  (:mod:`kernel_ext._redis_stops`: that worker's answer, or ``unreachable``), without
  Redis ``unreachable``; nothing — ``unknown``.
* Every answer is counted ``stops_<answer>``; nothing raises (an unexpected error is logged
  and answered ``unreachable``); nothing but the one call of that room is asked to stop.

Used from the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from kernel_ext._shared.compat import connect_redis
from kernel_ext.errors import check_positive_numbers
from kernel_ext.observability.count_names import (
    BAD_STOP,
    NOT_BROWSER,
    STOP_FORBIDDEN,
    STOP_NO_ANSWER,
    STOP_NOT_JOINED,
    STOP_PUBLISH_FAILED,
    STOP_RATE,
    STOPS_PREFIX,
)
from kernel_ext.protocol import KX_STOP, MAX_CONVERSATION_ID_CHARS, STOP_EVENT
from kernel_ext.relay._log import logger, rare
from kernel_ext.relay.auth import allow_all, call_hook
from kernel_ext.relay.limits import TokenBuckets
from kernel_ext.relay.workers import OpenStreams

if TYPE_CHECKING:
    from kernel_ext._redis_stops import StopForwarding

__all__ = [
    "DEFAULT_STOP_BURST",
    "DEFAULT_STOP_RATE",
    "DEFAULT_STOP_TIMEOUT",
    "StopAuth",
    "Stops",
    "read_request",
]

DEFAULT_STOP_RATE = 2.0
"""Stop requests a second of one browser connection once its burst is spent."""
DEFAULT_STOP_BURST = 5
"""Stop requests one browser connection may send at once."""
DEFAULT_STOP_TIMEOUT = 5.0
"""Seconds the relay waits for a worker's answer (loopback) or Redis's (publish)."""

StopAuth = Callable[[Any, str, str], Any]
"""``authorize_stop(identity, conversation_id, call_id) -> bool`` (may be async)."""

STOPPING, ALREADY_ENDED, UNKNOWN, REFUSED, UNREACHABLE = (
    "stopping",
    "already_ended",
    "unknown",
    "refused",
    "unreachable",
)
_WORKER_ANSWERS = frozenset({STOPPING, ALREADY_ENDED, UNKNOWN, REFUSED})
_CALL_ID = re.compile(r"[0-9a-f]{16}")

Count = Callable[[str], None]
Reject = Callable[[str, str, str], None]
Ask = Callable[..., Awaitable[Any]]
"""``await ask(event, data, to=sid, timeout=t)``: the namespace's ``call``."""


class Stops:
    """The relay's side of ``stop_call`` (module docstring).

    Args:
        browsers: the browsers of this process, sid → identity (what ``authenticate``
            returned).
        in_room: ``in_room(sid, room)``: whether the browser is in that room here.
        loopback: the open streams of the workers connected to this process (``None``:
            not tracked).
        connection: ``connection(worker)``: the sid of a connection of that worker to this
            process now, or ``None``.
        ask: the namespace's ``call``.
        calls: ``calls(room, call_id)``: ``"running"``, ``"ended"`` or ``None``, what this
            process holds of that call (its catch-up memory; ``None`` without one).
        manager: ``manager()``: the server's client manager (a Redis one has
            ``open_streams``, ``channel`` and ``redis``).
        count: the relay's counter; ``reject(sid, reason, what)`` counts a refusal.
        authorize_stop: the application's hook (default: a browser in the room may stop).
        stop_rate, stop_burst: the per-connection rate (``None``: no rate).
        stop_timeout: seconds to wait for a worker's or Redis's answer.

    Raises:
        ConfigError: a rate, burst or timeout that is not positive.
    """

    def __init__(
        self,
        *,
        browsers: Mapping[str, Any],
        in_room: Callable[[str, str], bool],
        loopback: OpenStreams | None,
        connection: Callable[[str], str | None],
        ask: Ask,
        calls: Callable[[str, str], str | None],
        manager: Callable[[], Any],
        count: Count,
        reject: Reject,
        authorize_stop: StopAuth | None = None,
        stop_rate: float | None = DEFAULT_STOP_RATE,
        stop_burst: int = DEFAULT_STOP_BURST,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    ) -> None:
        check_positive_numbers(stop_timeout=stop_timeout)
        self.buckets = None if stop_rate is None else TokenBuckets(stop_rate, stop_burst)
        self.stop_timeout = float(stop_timeout)
        self._browsers = browsers
        self._in_room = in_room
        self._loopback = loopback
        self._connection = connection
        self._ask = ask
        self._calls = calls
        self._manager = manager
        self._count = count
        self._reject = reject
        self._authorize: StopAuth = authorize_stop or allow_all
        self._forwarding: StopForwarding | None = None

    def serve(self) -> None:
        """Behind Redis, answer the other web processes' stops for this process's workers
        (:mod:`kernel_ext._redis_stops`): called when a worker connects."""
        self._forwarder()

    def _forwarder(self) -> StopForwarding | None:
        """The forwarding among web processes (started), ``None`` without Redis."""
        if self._forwarding is None:
            manager = self._manager()
            if not isinstance(getattr(manager, "redis_url", None), str):
                return None  # not a Redis manager (python-socketio's and kernel_ext's have it)
            from kernel_ext._redis_stops import StopForwarding

            self._forwarding = StopForwarding(
                manager, self._answer_locally, self._count, self.stop_timeout
            )
            self._forwarding.start()
        return self._forwarding

    async def aclose(self) -> None:
        """Stop forwarding (when the server stops). Idempotent."""
        if self._forwarding is not None:
            await self._forwarding.aclose()

    def forget(self, sid: str) -> None:
        """The connection ``sid`` is gone: drop its bucket."""
        if self.buckets is not None:
            self.buckets.forget(sid)

    async def handle(self, sid: str, data: Any) -> dict[str, Any]:
        """The answer to the ``stop_call`` ``data`` of connection ``sid``. Never raises."""
        try:
            answer = await self._handle(sid, data)
        except asyncio.CancelledError:
            raise
        except Exception:
            rare("stop_failed", "relay: a stop request failed", exc_info=True)
            answer = {"answer": UNREACHABLE, "reason": "the relay failed to route the request"}
        self._count(STOPS_PREFIX + answer["answer"])
        return answer

    async def _handle(self, sid: str, data: Any) -> dict[str, Any]:
        if sid not in self._browsers:
            return self._refuse(sid, NOT_BROWSER, "only browsers stop calls")
        if self.buckets is not None:
            wait = self.buckets.take(sid)
            if wait is not None:
                return self._refuse(sid, STOP_RATE, f"too many stop requests; retry in {wait} ms")
        request = read_request(data)
        if request is None:
            return self._refuse(
                sid,
                BAD_STOP,
                "a stop request is {v: 1, room: <conversation id>, callId: <16 hex digits>}",
            )
        room, call_id = request
        if not self._in_room(sid, room):
            return self._refuse(sid, STOP_NOT_JOINED, "this connection has not joined the room")
        try:
            allowed = await call_hook(self._authorize, self._browsers.get(sid), room, call_id)
        except Exception:
            logger.exception("relay: authorize_stop hook failed")
            allowed = False
        if not allowed:
            return self._refuse(sid, STOP_FORBIDDEN, "not allowed to stop this call")
        owner = _owner(self._loopback, room, call_id)
        if owner is not None:
            return await self._ask_worker(owner, call_id)
        manager = self._manager()
        owner = _owner(getattr(manager, "open_streams", None), room, call_id)
        if owner is not None:
            return await self._publish(manager, owner, call_id)
        state = self._calls(room, call_id)
        if state == "ended":
            return {"answer": ALREADY_ENDED}
        if state == "running":
            forwarding = self._forwarder()
            if forwarding is not None:
                return await forwarding.forward(room, call_id)
            return {"answer": UNREACHABLE, "reason": "the call's worker is not connected"}
        return {"answer": UNKNOWN}

    async def _answer_locally(self, room: str, call_id: str) -> dict[str, Any] | None:
        """A stop another web process forwarded: this process's owning worker's answer,
        ``None`` when no worker of this process owns the call."""
        owner = _owner(self._loopback, room, call_id)
        return None if owner is None else await self._ask_worker(owner, call_id)

    def _refuse(self, sid: str, reason: str, text: str) -> dict[str, Any]:
        self._reject(sid, reason, STOP_EVENT)
        return {"answer": REFUSED, "reason": text}

    async def _ask_worker(self, worker: str, call_id: str) -> dict[str, Any]:
        """Ask the loopback worker ``worker`` on its connection; its answer."""
        to = self._connection(worker)
        if to is None:
            return {"answer": UNREACHABLE, "reason": "the call's worker is not connected"}
        try:
            ack = await self._ask(
                KX_STOP, {"v": 1, "callId": call_id}, to=to, timeout=self.stop_timeout
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # socketio.exceptions.TimeoutError, a connection gone meanwhile
            ack = None
        answer = ack.get("answer") if isinstance(ack, Mapping) else None
        if answer not in _WORKER_ANSWERS:
            self._count(STOP_NO_ANSWER)
            rare("stop_no_answer", "relay: worker %s did not answer a stop in time", worker)
            return {"answer": UNREACHABLE, "reason": "the call's worker did not answer"}
        return {"answer": answer}

    async def _publish(self, manager: Any, worker: str, call_id: str) -> dict[str, Any]:
        """Publish the stop on the write-only worker's stop channel; the answer Redis's
        receiver count gives."""
        # Imported here: the Redis routing module is for Redis deployments only.
        from kernel_ext._redis_routing import stop_channel

        message = json.dumps({"v": 1, "callId": call_id})
        try:
            connect_redis(manager)
            receivers = await asyncio.wait_for(
                manager.redis.publish(stop_channel(manager.channel, worker), message),
                self.stop_timeout,
            )
        except asyncio.CancelledError:
            raise
        except Exception:
            receivers = None
        if not isinstance(receivers, int) or isinstance(receivers, bool):
            self._count(STOP_PUBLISH_FAILED)
            rare("stop_publish_failed", "relay: a stop could not be published on Redis")
            return {"answer": UNREACHABLE, "reason": "Redis did not take the request"}
        if receivers == 0:
            return {"answer": UNREACHABLE, "reason": "the call's worker does not listen"}
        return {"answer": STOPPING}


def read_request(data: Any) -> tuple[str, str] | None:
    """A stop request's (room, callId), or ``None`` when it is malformed."""
    if not isinstance(data, Mapping):
        return None
    v = data.get("v")
    room = data.get("room")
    call_id = data.get("callId")
    if v.__class__ is not int or v != 1:
        return None
    if not isinstance(room, str) or not room or len(room) > MAX_CONVERSATION_ID_CHARS:
        return None
    if not isinstance(call_id, str) or len(call_id) != 16 or not _CALL_ID.fullmatch(call_id):
        return None
    try:
        room.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no room's name
        return None
    return room, call_id


def _owner(streams: OpenStreams | None, room: str, call_id: str) -> str | None:
    """The worker that owns an open stream of ``call_id`` in ``room``, else ``None`` (a look
    at every open stream: stops are rate-limited, open streams a few thousand at most)."""
    if not isinstance(streams, OpenStreams):
        return None
    for key, worker in streams.owner.items():
        if key[0] != call_id:
            continue
        record = streams.workers.get(worker)
        entry = record.streams.get(key) if record is not None else None
        if entry is not None and entry[0] == room:
            return worker
    return None
