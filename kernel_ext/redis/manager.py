"""A relay web process's Redis client manager: python-socketio's, plus two things it lacks.

:class:`RelayRedisManager` is python-socketio's ``AsyncRedisManager`` (rooms span every web
process on the same channel) that also

* publishes again a terminal that did not reach Redis (python-socketio publishes once and
  only logs), once Redis is back, so that browsers on the other web processes get it after
  an outage; and
* ends the open streams of a gone write-only worker (:class:`~kernel_ext.emit.RedisEmitter`,
  no relay connection to watch) for this process's browsers, from the worker's tagged
  emits and heartbeats (the rules of :mod:`kernel_ext.relay.workers`); and
* keeps its subscription's state (:attr:`RelayRedisManager.redis_state`), which the relay's
  readiness reports, reconnecting on kernel_ext's retry schedule and saying at WARNING when
  Redis does not answer; and
* routes by room (:mod:`kernel_ext.redis.routing`): it subscribes to the channel of each
  room this process has a browser in (or one joining it), publishes a room's emits on the
  room's channel and its blocks into the room's log, and catches up from that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Mapping
from typing import Any, cast

from kernel_ext._shared.backoff import Backoff
from kernel_ext._shared.bounded import BoundedMap
from kernel_ext._shared.compat import publish_pipeline_supported, publish_result_supported
from kernel_ext.errors import check_positive_numbers
from kernel_ext.observability.count_names import REDIS_AFTER_WORKER_ABORTED, REDIS_PREFIX
from kernel_ext.protocol import TOOL_EVENT_STREAM, WORKER_TAG
from kernel_ext.redis.republish import Republish
from kernel_ext.redis.room_log import RoomLog
from kernel_ext.redis.stops import RelayStops
from kernel_ext.redis.subscription import Subscription
from kernel_ext.redis.worker_watch import WorkerWatch
from kernel_ext.relay._log import logger, rare
from kernel_ext.relay._send import send_local
from kernel_ext.relay.delivery import Delivery, Emit, StopWays
from kernel_ext.relay.replay import ReplayMemory
from kernel_ext.relay.workers import DEFAULT_WORKER_GRACE, track_workers
from kernel_ext.settings import check_redis_url

__all__ = ["REDIS_STATES", "RelayRedisManager"]

REDIS_STATES = ("idle", "connecting", "connected", "unreachable")
""":attr:`RelayRedisManager.redis_state`: not listening yet (python-socketio starts at the
first connection, :meth:`~RelayRedisManager.start` at once), trying the first time,
subscribed, or not answering (retrying)."""


class RelayRedisManager(Republish, WorkerWatch, RoomLog, Subscription):  # type: ignore[misc, unused-ignore]
    """python-socketio's Redis client manager for a relay's web process, plus what it
    lacks (the rules in full: docs/contracts.md, "The relay's Redis manager"):

    * a terminal whose publish failed is published again once Redis is back
      (:class:`~kernel_ext.redis.republish.Republish`; ``max_pending``, ``retry_for``,
      ``settle``);
    * write-only workers gone silent have their open streams ended for this process's
      browsers (:class:`~kernel_ext.redis.worker_watch.WorkerWatch`; ``worker_grace``,
      ``max_workers``, ``max_worker_streams``; call :meth:`stop_watching` at the end);
    * its own subscription, kept up, says how it goes in :attr:`redis_state`
      (:class:`~kernel_ext.redis.subscription.Subscription`; ``reconnect_delay``,
      ``reconnect_delay_max``, ``connect_timeout``);
    * room routing (``routing``): a room's channel subscribed while this process has a
      browser in it, its log read into the relay's catch-up memory at a join
      (:class:`~kernel_ext.redis.room_log.RoomLog`).

    Raises:
        ConfigError: a URL redis-py cannot parse (:func:`~kernel_ext.settings.check_redis_url`),
            a bad bound, grace, time or delay.
    """

    def __init__(
        self,
        url: str,
        *,
        channel: str = "socketio",
        max_pending: int = 1_024,
        retry_for: float = 300.0,
        settle: float = 10.0,
        worker_grace: float | None = DEFAULT_WORKER_GRACE,
        max_workers: int = 1_024,
        max_worker_streams: int = 10_000,
        reconnect_delay: float = 0.5,
        reconnect_delay_max: float = 5.0,
        connect_timeout: float = 5.0,
        routing: bool = True,
    ) -> None:
        check_redis_url(url)
        check_positive_numbers(connect_timeout=connect_timeout)
        reconnect = Backoff(reconnect_delay, reconnect_delay_max)  # reset once subscribed
        workers = track_workers(
            worker_grace,
            self._bump,
            REDIS_PREFIX,
            max_workers=max_workers,
            max_worker_streams=max_worker_streams,
        )
        # Terminals to publish again, by arrival; forgotten (given up) beyond the bounds.
        pending: BoundedMap[int, Any] = BoundedMap(max_pending, retry_for, on_forget=self._given_up)
        super().__init__(url, channel=channel)
        self.counts: dict[str, int] = {}
        self.worker_grace = workers.grace if workers is not None else None
        self._workers = workers
        self._watching = None
        self._heard = 0.0
        # The watch checks the channel every step; a process that heard nothing for longer
        # than _deaf_after restarts every worker's grace when it hears again.
        self._watch_step = min(1.0, (worker_grace or 4.0) / 4)
        self._deaf_after = 2 * self._watch_step + 0.5
        self._listeners = 0
        self._pending = pending
        self._ids = itertools.count()
        self._settle = settle
        self._retrying = None
        self._confirmed = publish_result_supported()
        self._url = url
        self._reconnect = reconnect
        self.connect_timeout = float(connect_timeout)
        self.redis_state = "idle"
        self._started = False
        self._tried = asyncio.Event()  # the first attempt to subscribe ended
        # Room routing (kernel_ext.redis.routing): the room channels this process wants
        # (a browser in the room, or one joining it), asked for and confirmed on the
        # current subscription, and the rooms whose log it has read since.
        self.routing = bool(routing) and publish_pipeline_supported()
        self._wanted = {}
        self._joining = {}
        self._asked = set()
        self._changed = set()  # wanted or not any more since the last _sync
        self._unconfirmed = {}  # subscriptions asked for, not yet confirmed
        self._subscribed_to = {}
        self._read_logs = set()
        self._loading = {}
        self._relays: dict[str, Delivery] = {}  # the relay of each namespace, attached
        self._pubsub = None
        self._syncing = None
        if not self._confirmed:
            logger.warning(
                "relay: this python-socketio does not say whether a publish reached Redis; "
                "terminals emitted during a Redis outage are not published again"
            )

    def _bump(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    async def _handle_emit(self, message: Any) -> None:
        workers = self._workers
        worker = message.get(WORKER_TAG) if workers is not None else None
        if worker is not None and not self._note_worker_emit(worker, message):
            self._bump(REDIS_AFTER_WORKER_ABORTED)
            rare(
                "redis_after_worker_aborted",
                "relay: dropped a block of a stream ended when its worker was gone",
            )
            return
        self._hold(message)
        data = message.get("data")
        if (
            message.get("callback") is None
            and not message.get("binary")
            and isinstance(data, list)
            and len(data) == 1
        ):
            # python-socketio's own step for an emit without a callback, without its task
            # per browser (kernel_ext.relay._send).
            skip = message.get("skip_sid")
            await send_local(
                self.server,
                message.get("namespace") or "/",
                message.get("event"),
                data[0],
                message.get("room"),
                skip if isinstance(skip, list) else None if skip is None else [skip],
            )
            return
        await super()._handle_emit(message)

    def _hold(self, message: Mapping[str, Any]) -> None:
        """Hold a ``tool_event_stream`` block this process is about to emit to a room's
        browsers for catch-up (its namespace's :class:`~kernel_ext.relay.ChatRelay`
        memory), in the same step as the emit picks them; wherever it came from — this
        process, another one, a write-only worker. Never raises."""
        data = message.get("data")
        room = message.get("room")
        if (
            message.get("event") != TOOL_EVENT_STREAM
            or not isinstance(room, str)
            or not isinstance(data, list)
            or len(data) != 1
            or not isinstance(data[0], Mapping)
        ):
            return
        namespace = message.get("namespace") or "/"
        delivery = self._relays.get(namespace)
        if delivery is None or delivery.memory is None:
            return
        held_back = self._loading.get((namespace, room)) if self._loading else None
        if held_back is not None:
            held_back.append(message)  # held after the room's log, being read (joining())
            return
        delivery.hold(room, data[0])

    def relay_delivery(
        self, emit: Emit, server: Any, namespace: str, memory: ReplayMemory | None
    ) -> Delivery:
        """How a :class:`~kernel_ext.relay.ChatRelay` of ``namespace`` delivers through this
        manager (:func:`~kernel_ext.relay.delivery.delivery_for` asks, when the relay is
        registered): its blocks published (a frame's as one pipeline), held for catch-up
        here (:meth:`_hold`, by the delivery's :meth:`~kernel_ext.relay.delivery.Delivery.hold`,
        the relay's one place that fills ``memory``) for every block this process emits."""
        delivery = _RedisDelivery(emit, server, namespace, memory, self)
        self._relays[namespace] = delivery
        return delivery


# Why a relay delivering through this manager is not ready, by the manager's state.
_NOT_READY = {
    "idle": "redis listener not started",
    "connecting": "redis connecting",
    "unreachable": "redis unreachable",
}


class _RedisDelivery(Delivery):
    """A relay's delivery through :class:`RelayRedisManager`: blocks published one after
    the other (a frame's as one pipeline, :meth:`RelayRedisManager.pipelined`), no browser
    skipped, and held for catch-up by the manager, which holds what it emits to this
    process's browsers wherever it came from (so not here before the emit)."""

    reserves = False
    concurrent = False

    def __init__(
        self, emit: Emit, server: Any, namespace: str, memory: ReplayMemory | None, manager: Any
    ) -> None:
        super().__init__(emit, server, namespace, memory)
        self.manager = manager
        self._stops: RelayStops | None = None

    async def block(
        self, raw: Any, room: str, data: bytes | None = None, skip: list[str] | None = None
    ) -> None:
        await self.emit(TOOL_EVENT_STREAM, raw, room=room, skip_sid=skip)

    def frame(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return cast("contextlib.AbstractAsyncContextManager[Any]", self.manager.pipelined())

    def joining(self, room: str) -> contextlib.AbstractAsyncContextManager[Any]:
        return cast(
            "contextlib.AbstractAsyncContextManager[Any]",
            self.manager.joining(self.namespace, room),
        )

    def not_ready(self) -> str | None:
        """``None`` once the manager is subscribed to Redis; else ``"redis unreachable"``,
        ``"redis connecting"`` or ``"redis listener not started"`` (python-socketio starts it
        at the first connection, :meth:`RelayRedisManager.start` at once)."""
        state = self.manager.redis_state
        if state == "connected":
            return None
        return _NOT_READY.get(state, "redis unreachable")

    def counts(self) -> dict[str, int]:
        counts = dict(self.manager.counts)
        counts.update(self.manager.worker_sizes())
        return counts

    def start(self) -> None:
        self.manager.start()

    async def stop(
        self, room: str, call_id: str, running: bool, ways: StopWays
    ) -> dict[str, Any] | None:
        """A write-only worker that owns the call is asked on its stop channel; a call
        running here without an owner is forwarded to the other web processes; either
        answers on this process's reply channel (:mod:`kernel_ext.redis.stops`)."""
        workers = self.manager._workers
        owner = workers.owner_of(call_id, room) if workers is not None else None
        if owner is None and not running:
            return None
        stops = self._relay_stops(ways)
        if owner is not None:
            return await stops.ask_worker(owner, call_id)
        return await stops.forward(room, call_id)

    def serve_stops(self, ways: StopWays) -> None:
        self._relay_stops(ways)

    def _relay_stops(self, ways: StopWays) -> RelayStops:
        """This process's stops on Redis, subscribed (made at the first use)."""
        if self._stops is None:
            self._stops = RelayStops(self.manager, ways)
            self._stops.start()
        return self._stops

    async def aclose(self) -> None:
        await self.manager.stop_watching()
        if self._stops is not None:
            await self._stops.aclose()
