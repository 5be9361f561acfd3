"""A browser's stop request (``stop_call``), from the relay to the worker that owns the call.

:class:`Stops` answers one ``stop_call`` ``{"v": 1, "room", "callId"}`` of a browser
(docs/web.md, "Stopping a call") with ``{"answer": A}`` and maybe ``"reason"``, A one of
:data:`~kernel_ext.protocol.STOP_ANSWERS`. It guarantees:

* **Refused** (``refused``, counted ``rejected_<reason>``, logged rarely), in this order:
  a connection that is not a browser (``not_browser``); past the browser's stop rate
  (``stop_rate``: :meth:`Admission.stop <kernel_ext.relay.limits.Admission.stop>`, checked
  before anything is read, so a flood of any kind costs a dict step each); a malformed
  request (``bad_stop``: not a mapping, ``v`` not the integer 1, ``room`` not a non-empty
  string of at most :data:`~kernel_ext.protocol.MAX_CONVERSATION_ID_CHARS` characters that
  UTF-8 can encode — no lone surrogate —, ``callId`` not 16 lower-case hex digits); a room
  this browser has not joined on this web process (``stop_not_joined``); the application's
  ``authorize_stop(identity, conversation_id, call_id)`` hook saying no, or raising
  (``stop_forbidden``).
* **Routed to the owner** of the call's open stream in that room, the worker that sent its
  latest running block (:class:`~kernel_ext.relay.workers.OpenStreams`). A worker
  connected to this web process is asked on its own connection, ``kx_stop`` ``{"v": 1,
  "callId"}``, and its answer (what :func:`kernel_ext.stop_call` said: ``stopping``,
  ``already_ended``, ``unknown``) is the browser's; no usable answer within
  ``stop_timeout`` seconds: ``unreachable`` (``stop_no_answer``); the worker has no
  connection now (it is within its grace): ``unreachable``. Otherwise the delivery is asked
  (:meth:`Delivery.stop <kernel_ext.relay.delivery.Delivery.stop>`): behind Redis, a
  write-only worker's stop channel, or the web process a loopback worker is connected to
  (:mod:`kernel_ext.redis.stops`).
* **Otherwise**, from this process's catch-up memory of that room
  (:func:`call_state`): the call's streams all ended
  — ``already_ended``; one is running but no worker can be reached — ``unreachable``;
  nothing — ``unknown``.
* Every answer is counted ``stops_<answer>``; nothing raises (an unexpected error is logged
  and answered ``unreachable``); nothing but the one call of that room is asked to stop.

:class:`StopRequests` puts it on :class:`~kernel_ext.relay.ChatRelay`: the ``stop_call``
handler and the :class:`Stops` made from the relay's parts. Used from the event loop's
thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kernel_ext.errors import check_positive_numbers
from kernel_ext.observability.count_names import (
    BAD_STOP,
    NOT_BROWSER,
    STOP_FORBIDDEN,
    STOP_NO_ANSWER,
    STOP_NOT_JOINED,
    STOP_RATE,
    STOPS_PREFIX,
)
from kernel_ext.protocol import KX_STOP, STOP_EVENT
from kernel_ext.relay._log import logger, rare
from kernel_ext.relay.auth import allow_all, call_hook
from kernel_ext.relay.delivery import Delivery, StopWays
from kernel_ext.relay.frames import room_and_call
from kernel_ext.relay.gone_workers import GoneWorkers
from kernel_ext.relay.limits import Admission
from kernel_ext.relay.relay_settings import RelaySettings
from kernel_ext.relay.replay import ReplayMemory

__all__ = ["StopAuth", "StopRequests", "Stops", "call_state", "read_request"]

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

Ask = Callable[..., Awaitable[Any]]
"""``await ask(event, data, to=sid, timeout=t)``: the namespace's ``call``."""


class Stops:
    """The relay's side of ``stop_call`` (module docstring). ``browsers``: sid → identity;
    ``in_room(sid, room)``; ``limits``: the browsers' caps (their stop buckets);
    ``workers``: the open streams of the workers connected here; ``connection(worker)``:
    a sid of that worker here now, or ``None``; ``ask``: the namespace's ``call``;
    ``memory``: the catch-up memory (``None``: none); ``delivery()``: the relay's delivery;
    ``count``, ``reject``: the relay's counters; ``authorize_stop``: the application's hook
    (default: a browser in the room may stop); ``stop_timeout``: seconds to wait for a
    worker, Redis or another web process. Raises ``ConfigError`` for a bad timeout."""

    def __init__(
        self,
        *,
        browsers: Mapping[str, Any],
        in_room: Callable[[str, str], bool],
        limits: Admission,
        workers: GoneWorkers,
        connection: Callable[[str], str | None],
        ask: Ask,
        memory: ReplayMemory | None,
        delivery: Callable[[], Delivery | None],
        count: Callable[[str], None],
        reject: Callable[[str, str, str], None],
        authorize_stop: StopAuth | None = None,
        stop_timeout: float = RelaySettings.stop_timeout,
    ) -> None:
        check_positive_numbers(stop_timeout=stop_timeout)
        self._browsers = browsers
        self._in_room = in_room
        self._limits = limits
        self._workers = workers
        self._connection = connection
        self._ask = ask
        self._memory = memory
        self._delivery = delivery
        self._count = count
        self._reject = reject
        self._authorize: StopAuth = authorize_stop or allow_all
        self.ways = StopWays(local=self._answer_locally, count=count, timeout=stop_timeout)
        """How a delivery routes a stop for this relay (its workers' answers, its counter,
        the timeout)."""

    def serve(self) -> None:
        """Answer the stops other web processes forward for this process's workers (behind
        Redis): called when a worker connects."""
        delivery = self._delivery()
        if delivery is not None:
            delivery.serve_stops(self.ways)

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
        wait = self._limits.stop(sid)
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
        local = await self._answer_locally(room, call_id)
        if local is not None:
            return local
        state = call_state(self._memory, room, call_id)
        delivery = self._delivery()
        if delivery is not None:
            routed = await delivery.stop(room, call_id, state == "running", self.ways)
            if routed is not None:
                return routed
        if state == "ended":
            return {"answer": ALREADY_ENDED}
        if state == "running":
            return {"answer": UNREACHABLE, "reason": "no worker of the call can be reached"}
        return {"answer": UNKNOWN}

    def _refuse(self, sid: str, reason: str, text: str) -> dict[str, Any]:
        self._reject(sid, reason, STOP_EVENT)
        return {"answer": REFUSED, "reason": text}

    async def _answer_locally(self, room: str, call_id: str) -> dict[str, Any] | None:
        """The answer of the worker connected here that owns ``call_id`` in ``room``
        (``None``: none owns it; also for a request another web process forwarded)."""
        if read_request({"v": 1, "room": room, "callId": call_id}) is None:
            return None
        worker = self._workers.owner_of(call_id, room)
        if worker is None:
            return None
        to = self._connection(worker)
        if to is None:
            return {"answer": UNREACHABLE, "reason": "the call's worker is not connected"}
        try:
            ack = await self._ask(
                KX_STOP, {"v": 1, "callId": call_id}, to=to, timeout=self.ways.timeout
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


def call_state(memory: ReplayMemory | None, room: str, call_id: str) -> str | None:
    """What the catch-up memory holds of ``call_id`` in ``room``: ``"running"`` (a stream
    of it without its terminal), ``"ended"`` (streams of it, each with its terminal),
    ``None`` (nothing, or no memory). A look at the room's held blocks, as a join's
    catch-up takes (without parsing them)."""
    if memory is None:
        return None
    ended: dict[Any, bool] = {}
    for key, _, _, terminal in memory.catch_up_held(room, {})[0]:
        if key[0] == call_id:
            ended[key] = ended.get(key, False) or terminal
    if not ended:
        return None
    return "ended" if all(ended.values()) else "running"


def read_request(data: Any) -> tuple[str, str] | None:
    """A stop request's (room, callId), or ``None`` when it is malformed."""
    if not isinstance(data, Mapping):
        return None
    v = data.get("v")
    room = data.get("room")
    call_id = data.get("callId")
    if v.__class__ is not int or v != 1:
        return None
    return room_and_call(room, call_id)


class StopRequests:
    """The ``stop_call`` handler of :class:`~kernel_ext.relay.ChatRelay` and its
    :attr:`stops`, made from the relay's parts at the first use."""

    settings: RelaySettings
    limits: Admission
    workers: GoneWorkers
    catch_up_memory: ReplayMemory | None
    delivery: Delivery | None
    authorize_stop: StopAuth | None
    _browsers: dict[str, Any]
    _internal: Mapping[str, Any]
    _count: Callable[..., None]
    _reject: Callable[..., None]
    _in_room: Callable[[str, str], bool]
    call: Ask
    _stops: Stops | None = None

    @property
    def stops(self) -> Stops:
        """A browser's stop requests (:class:`Stops`)."""
        if self._stops is None:
            self._stops = Stops(
                browsers=self._browsers,
                in_room=self._in_room,
                limits=self.limits,
                workers=self.workers,
                connection=self._connection_of,
                ask=self.call,
                memory=self.catch_up_memory,
                delivery=lambda: self.delivery,
                count=self._count,
                reject=self._reject,
                authorize_stop=self.authorize_stop,
                stop_timeout=self.settings.stop_timeout,
            )
        return self._stops

    def _connection_of(self, worker: str) -> str | None:
        """A sid of ``worker``'s connection to this process now, or ``None``."""
        return next((sid for sid, conn in self._internal.items() if conn.worker == worker), None)

    async def on_stop_call(self, sid: str, data: Any = None) -> dict[str, Any]:
        """A browser asks to stop one call of a room it joined (:class:`Stops`)."""
        return await self.stops.handle(sid, data)
