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
* routes by room (:mod:`kernel_ext._redis_routing`): it subscribes to the channel of each
  room this process has a browser in (or one joining it), publishes a room's emits on the
  room's channel and its blocks into the room's log, and catches up from that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import socketio

from kernel_ext._redis_routing import (
    RoutedPublish,
    marker_channel,
    read_log_entry,
    room_channel,
    room_log,
)
from kernel_ext._shared.backoff import Backoff
from kernel_ext._shared.bounded import BoundedMap
from kernel_ext._shared.compat import (
    connect_redis,
    publish_pipeline_supported,
    publish_result_supported,
)
from kernel_ext.errors import check_positive_numbers
from kernel_ext.observability._rare_log import is_rare, plural
from kernel_ext.observability.count_names import (
    REDIS_AFTER_WORKER_ABORTED,
    REDIS_GIVEN_UP,
    REDIS_JOIN_UNSUBSCRIBED,
    REDIS_LOG_BLOCKS,
    REDIS_LOG_UNREAD,
    REDIS_PREFIX,
    REDIS_PUBLISH_FAILED,
    REDIS_REPUBLISHED,
    REDIS_UNREACHABLE,
    REDIS_WATCH_RESUMED,
)
from kernel_ext.protocol import TERMINAL_STATES, TOOL_EVENT_STREAM, WORKER_HEARTBEAT, WORKER_TAG
from kernel_ext.relay._log import logger, rare
from kernel_ext.relay._send import send_local
from kernel_ext.relay.workers import (
    DEFAULT_WORKER_GRACE,
    OpenStreams,
    is_worker_id,
    track_workers,
)
from kernel_ext.settings import check_redis_url, redacted_url

__all__ = ["REDIS_STATES", "RelayRedisManager"]

REDIS_STATES = ("idle", "connecting", "connected", "unreachable")
""":attr:`RelayRedisManager.redis_state`: not listening yet (python-socketio starts at the
first connection, :meth:`~RelayRedisManager.start` at once), trying the first time,
subscribed, or not answering (retrying)."""


class RelayRedisManager(RoutedPublish, socketio.AsyncRedisManager):  # type: ignore[misc, unused-ignore]
    """python-socketio's Redis client manager, except that a terminal block whose publish
    to the other web processes failed (Redis down; python-socketio publishes once and only
    logs) is published again once Redis is back and as many web processes listen as did
    before (or ``settle`` seconds after Redis answered again), for at most ``retry_for``
    seconds, at most ``max_pending`` at once (the oldest given up beyond). A frame's blocks
    from a worker on the loopback path are published as one pipeline, in order, after
    they were emitted to this process's browsers (:meth:`pipelined`). Counts
    ``redis_publish_failed``, ``redis_republished`` and ``redis_given_up`` in
    :attr:`counts`. Where python-socketio's publish result cannot be read
    (:mod:`kernel_ext._shared.compat`), nothing is published again (logged at WARNING).

    Gone workers on the write-only path (:class:`~kernel_ext.emit.RedisEmitter`, no relay
    connection): such a worker tags each emit it publishes with its worker id (key
    ``kx_worker``) and publishes a heartbeat (``{"method": "kx_worker_heartbeat", "worker",
    "interval", "host_id"}``) every few seconds; python-socketio ignores both (an unknown
    key, an unknown method). From the tagged ``tool_event_stream`` emits this manager
    tracks each worker's open streams (bounded like :class:`~kernel_ext.relay.ChatRelay`'s);
    when a worker with open streams was last heard of (heartbeat or block) more than
    ``max(worker_grace, 3 × its heartbeat interval)`` seconds ago, it emits one
    ``aborted`` block per open stream to the browsers of **this** web process only (every
    web process does the same for its own: one terminal per browser), counted
    ``redis_worker_aborted``, and drops later blocks of those streams
    (``redis_after_worker_aborted``). While it watches, it publishes the same heartbeat
    without a worker every second (every ``worker_grace / 4`` seconds if shorter) and
    judges a worker gone only at a time it heard the channel (its own heartbeats come
    back); after hearing nothing for longer than two such steps (Redis was down for it),
    every worker's grace starts again (``redis_watch_resumed``). ``worker_grace=None``
    disables all of this. Call :meth:`stop_watching` when the server stops
    (:meth:`ChatRelay.aclose <kernel_ext.relay.ChatRelay.aclose>` does).

    Listening: it subscribes to the channel with a client of its own (redis-py, ``url``),
    and :attr:`redis_state` says how that goes (:data:`REDIS_STATES`); ``"connected"`` once
    subscribed. When Redis refuses, drops or never answers the connection (within
    ``connect_timeout`` seconds), the state is ``"unreachable"`` and it tries again after
    ``reconnect_delay`` seconds, doubling up to ``reconnect_delay_max`` (jittered ±25 %),
    until Redis answers. The first failure of each outage is logged at WARNING with that
    schedule (the URL without its password), later attempts of the outage on the 2nd, 4th,
    8th … time, the recovery at INFO; each failed attempt is counted
    ``redis_unreachable``. python-socketio starts listening at the server's first
    connection; :meth:`start` starts it at once (the relay app does, at start-up).

    Room routing (``routing``, default on, :mod:`kernel_ext._redis_routing`): besides the
    channel it subscribes to the channel of every room in which this process has a browser,
    from the moment one joins (:meth:`joining`: the browser enters the room once Redis has
    confirmed the subscription and the room's log is read into the relay's catch-up memory)
    until the last one leaves; and to the marker that tells publishers it routes. After
    Redis could not be heard, it reads its browsers' rooms' logs and sends them what they
    missed. Counts ``redis_join_unsubscribed`` (a join that went on without a confirmed
    subscription: Redis did not answer), ``redis_log_blocks`` and ``redis_log_unread``.
    ``routing=False``: python-socketio's one channel for everything (publishers that route
    then route nothing while this process listens).

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
        self._watching: asyncio.Task[None] | None = None
        self._heard = 0.0
        # The watch checks the channel every step; a process that heard nothing for longer
        # than _deaf_after restarts every worker's grace when it hears again.
        self._watch_step = min(1.0, (worker_grace or 4.0) / 4)
        self._deaf_after = 2 * self._watch_step + 0.5
        self._listeners = 0
        self._pending = pending
        self._ids = itertools.count()
        self._settle = settle
        self._retrying: asyncio.Task[None] | None = None
        self._confirmed = publish_result_supported()
        self._url = url
        self._reconnect = reconnect
        self.connect_timeout = float(connect_timeout)
        self.redis_state = "idle"
        self._started = False
        self._tried = asyncio.Event()  # the first attempt to subscribe ended
        # Room routing (kernel_ext._redis_routing): the room channels this process wants
        # (a browser in the room, or one joining it), asked for and confirmed on the
        # current subscription, and the rooms whose log it has read since.
        self.routing = bool(routing) and publish_pipeline_supported()
        self._wanted: dict[str, tuple[str, str]] = {}
        self._joining: dict[tuple[str, str], int] = {}
        self._asked: set[str] = set()
        self._changed: set[str] = set()  # wanted or not any more since the last _sync
        self._unconfirmed: dict[str, int] = {}  # subscriptions asked for, not yet confirmed
        self._subscribed_to: dict[str, asyncio.Event] = {}
        self._read_logs: set[str] = set()
        self._loading: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        self._pubsub: Any = None
        self._syncing: asyncio.Task[None] | None = None
        if not self._confirmed:
            logger.warning(
                "relay: this python-socketio does not say whether a publish reached Redis; "
                "terminals emitted during a Redis outage are not published again"
            )

    def _bump(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    # -- terminals that did not reach Redis ------------------------------------------------

    def _published(self, data: Any, receivers: int | None) -> None:
        if not self._confirmed:
            return
        if receivers is not None:
            if not self._pending:
                self._listeners = receivers
        elif _is_terminal_emit(data):
            self._bump(REDIS_PUBLISH_FAILED)
            rare(
                "redis_down",
                "relay: a terminal did not reach Redis; retrying",
                level=logging.ERROR,
            )
            self._pending.set(next(self._ids), data)
            if self._retrying is None or self._retrying.done():
                self._retrying = asyncio.get_running_loop().create_task(self._retry())

    def _given_up(self, key: int, data: Any, reason: str) -> None:
        self._bump(REDIS_GIVEN_UP)

    async def _retry(self) -> None:
        """Publish the pending terminals again, oldest first, once Redis answers and as
        many web processes listen as before (or ``settle`` seconds after it answered)."""
        pending = self._pending
        backoff = Backoff(0.25, 2.0, jitter=0.0)  # the schedule it always had
        back_since: float | None = None
        while True:
            pending.expire()
            if not pending:
                return
            await asyncio.sleep(backoff.next())
            try:
                listening = (await self.redis.pubsub_numsub(self.channel))[0][1]
            except Exception:
                back_since = None
                continue
            now = time.monotonic()
            back_since = back_since or now
            if listening < self._listeners and now - back_since < self._settle:
                continue
            for key, data in pending.items():
                if key not in pending:
                    continue  # forgotten meanwhile (beyond the bound)
                await self._publish_one(data)
                if self.last_receivers is None:
                    break
                pending.pop(key)
                self._bump(REDIS_REPUBLISHED)

    # -- gone workers on the write-only path ----------------------------------------------

    @property
    def open_streams(self) -> OpenStreams | None:
        """The write-only workers' open streams (``None`` with ``worker_grace=None``)."""
        return self._workers

    def worker_sizes(self) -> dict[str, int]:
        """What the gone-worker watch holds now: ``redis_workers_tracked`` (workers with
        open streams) and ``redis_worker_streams`` (their open streams)."""
        return self._workers.sizes() if self._workers is not None else {}

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
        handlers = getattr(self.server, "namespace_handlers", None) or {}
        replay = getattr(handlers.get(namespace), "replay", None)
        if replay is None:
            return
        held_back = self._loading.get((namespace, room)) if self._loading else None
        if held_back is not None:
            held_back.append(message)  # held after the room's log, being read (joining())
            return
        try:
            replay.add(room, data[0])
        except Exception:
            rare("replay_add", "relay: holding a block for catch-up failed", exc_info=True)

    def _note_worker_emit(self, worker: Any, message: Mapping[str, Any]) -> bool:
        """Track a tagged emit; ``False`` when it belongs to a stream ended already."""
        workers = self._workers
        data = message.get("data")
        room = message.get("room")
        if (
            workers is None
            or not is_worker_id(worker)
            or message.get("event") != TOOL_EVENT_STREAM
            or not isinstance(room, str)
            or not isinstance(data, list)
            or len(data) != 1
            or not isinstance(data[0], Mapping)
        ):
            return True
        ok = workers.note(worker, data[0], room)
        record = workers.workers.get(worker)
        if record is not None:
            record.seen = time.monotonic()
            namespace = message.get("namespace")
            record.namespace = namespace if isinstance(namespace, str) else "/"
            if self._watching is None or self._watching.done():
                self._heard = time.monotonic()
                self._watching = asyncio.get_running_loop().create_task(self._watch_workers())
        return ok

    async def _listen(self) -> AsyncIterator[Any]:
        """The channel's messages (python-socketio's transport hook), less the heartbeats
        (handled here)."""
        async for message in self._subscribed():
            if self._workers is not None and _is_heartbeat(message) and self._heartbeat(message):
                continue
            yield message

    def _heartbeat(self, message: Any) -> bool:
        """Handle ``message`` if it is a heartbeat (then ``True``)."""
        try:
            data = json.loads(message)
        except (TypeError, ValueError):
            return False
        if not isinstance(data, dict) or data.get("method") != WORKER_HEARTBEAT:
            return False
        now = time.monotonic()
        workers = self._workers
        if workers is None:
            return True
        if now - self._heard > self._deaf_after and workers.workers:
            # This process heard nothing for a while (Redis was down for it): heartbeats may
            # have been lost on the way, so every worker's grace starts again now.
            workers.restart_graces(now)
            self._bump(REDIS_WATCH_RESUMED)
        self._heard = now  # the channel works for this process
        worker = data.get("worker")
        record = workers.workers.get(worker) if isinstance(worker, str) else None
        if record is None:
            return True  # a web process's own check, or a worker with no open stream
        record.seen = now
        interval = data.get("interval")
        if isinstance(interval, (int, float)) and 0 < interval < 3_600:
            record.interval = float(interval)
        return True

    async def _watch_workers(self) -> None:
        """While workers have open streams: check the channel, end the gone workers'."""
        workers = self._workers
        assert workers is not None
        probe = json.dumps({"method": WORKER_HEARTBEAT, "worker": None, "host_id": self.host_id})
        while workers.workers:
            try:
                with contextlib.suppress(Exception):
                    # python-socketio's publishing client, made as its publish makes it
                    # (the subscription is a client of this manager's own).
                    connect_redis(self)
                    await asyncio.wait_for(
                        self.redis.publish(self.channel, probe), self._watch_step
                    )
                await asyncio.sleep(self._watch_step)
                # Judged at the last time this process heard the channel (its own checks
                # come back every step while Redis works): a worker is gone only if it was
                # overdue while this process could hear it.
                heard = self._heard
                for worker, record in workers.overdue(heard):
                    await self._end_worker_locally(worker, record.namespace, heard - record.seen)
            except asyncio.CancelledError:
                raise
            except Exception:
                rare("worker_watch", "relay: watching workers failed", exc_info=True)

    async def _end_worker_locally(self, worker: str, namespace: str, silent_for: float) -> None:
        workers = self._workers
        assert workers is not None

        async def emit(room: str, raw: dict[str, Any]) -> bool:
            # This process's browsers only: each web process ends the streams for its own
            # (and holds what it emits for its catch-ups).
            self._hold(
                {"event": TOOL_EVENT_STREAM, "data": [raw], "room": room, "namespace": namespace}
            )
            await self.emit(
                TOOL_EVENT_STREAM, raw, namespace=namespace, room=room, ignore_queue=True
            )
            return True

        await workers.emit_ended(
            worker,
            workers.end(worker),
            emit,
            gone_for=silent_for,
            how="silent on Redis",
            audience=" for this process's browsers",
        )

    # -- room routing: subscribing to the rooms of this process's browsers -----------------

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

    @contextlib.asynccontextmanager
    async def joining(self, namespace: str, room: str) -> AsyncIterator[None]:
        """Around a browser's entry into ``room``: this process subscribes to the room's
        channel (and waits, up to ``connect_timeout`` seconds, until Redis confirms it), then
        reads the room's log into the catch-up memory if it has not since it subscribed —
        so that a block published at any time before the entry reaches the browser by the
        catch-up, and every one after it live. Without routing (or when Redis does not
        answer: counted ``redis_join_unsubscribed``) it waits for nothing."""
        key = (namespace, room)
        self._joining[key] = self._joining.get(key, 0) + 1
        self._interest(namespace, room)
        try:
            channel = room_channel(self.channel, namespace, room)
            if self.routing:
                if not await self._until_subscribed(channel):
                    self._bump(REDIS_JOIN_UNSUBSCRIBED)
                elif channel not in self._read_logs:
                    await self._read_log(namespace, room, channel)
            yield
        finally:
            left = self._joining.get(key, 0) - 1
            if left > 0:
                self._joining[key] = left
            else:
                self._joining.pop(key, None)
            self._interest(namespace, room)

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

    async def _read_log(
        self, namespace: str, room: str, channel: str, *, recover: bool = False
    ) -> None:
        """Hold the room's log for catch-up (what this process does not hold yet,
        :meth:`ReplayMemory.merge <kernel_ext.relay.replay.ReplayMemory.merge>`), then what
        it emitted to the room meanwhile (held back while the log is read). ``recover``
        (after an outage of Redis): also emit what it did not hold to the room's browsers
        on this process. Counts ``redis_log_blocks`` (blocks taken from a log) and
        ``redis_log_unread`` (a log Redis did not give)."""
        handlers = getattr(self.server, "namespace_handlers", None) or {}
        relay = handlers.get(namespace)
        replay = getattr(relay, "replay", None)
        key = (namespace, room)
        if replay is None or key in self._loading:
            # No memory to fill (catch-up off); or another join of the room reads it now,
            # and what that one holds before the entry is what this one needs too.
            self._read_logs.add(channel)
            return
        held_back: list[Mapping[str, Any]] = []
        self._loading[key] = held_back
        taken: list[Mapping[str, Any]] = []
        try:
            try:
                connect_redis(self)
                pipe = self.redis.pipeline(transaction=False)
                pipe.time()
                pipe.xrange(room_log(self.channel, namespace, room))
                (seconds, micros), entries = await asyncio.wait_for(
                    pipe.execute(), self.connect_timeout
                )
            except asyncio.CancelledError:
                raise
            except Exception:
                self._bump(REDIS_LOG_UNREAD)
                rare("redis_log", "relay: reading a room's log on Redis failed", exc_info=True)
                return
            blocks = []
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            for block, worker in _recent(entries, now_ms, replay.hold, replay.idle):
                if worker is not None and self._workers is not None:
                    self._note_worker_emit(
                        worker,
                        {
                            "event": TOOL_EVENT_STREAM,
                            "data": [block],
                            "room": room,
                            "namespace": namespace,
                        },
                    )
                blocks.append(block)
            taken = replay.merge(room, blocks)
            if taken:
                self._bump(REDIS_LOG_BLOCKS, len(taken))
            if channel in self._asked:
                self._read_logs.add(channel)
        finally:
            self._loading.pop(key, None)
            replay.merge(room, [message["data"][0] for message in held_back])
        if recover:
            for raw in taken:
                await self.emit(
                    TOOL_EVENT_STREAM, raw, namespace=namespace, room=room, ignore_queue=True
                )

    async def _recover(self) -> None:
        """After Redis answered again: the rooms of this process's browsers get from their
        logs what was published while this process could not hear it."""
        for channel, (namespace, room) in list(self._wanted.items()):
            if self.rooms.get(namespace, {}).get(room):
                try:
                    if await self._until_subscribed(channel):
                        await self._read_log(namespace, room, channel, recover=True)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    rare("redis_recover", "relay: catching rooms up after an outage failed")

    # -- listening, and whether Redis answers ---------------------------------------------

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

    async def stop_watching(self) -> None:
        """Cancel the gone-worker watch (when the server stops). Idempotent."""
        task, self._watching = self._watching, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


_HEARTBEAT_BYTES = WORKER_HEARTBEAT.encode()


def _scrubbed(exc: BaseException, url: str) -> str:
    """``exc`` as ``Type: message``, without the URL's password should the message hold it."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    with contextlib.suppress(ValueError):
        password = urlsplit(url).password
        if password:
            text = text.replace(password, "***")
    return text


def _recent(
    entries: list[tuple[Any, Mapping[Any, Any]]], now_ms: int, hold: float, idle: float
) -> list[tuple[dict[str, Any], str | None]]:
    """The blocks (and worker tags) of a room's log whose stream this process would still
    hold had it heard them (:class:`~kernel_ext.relay.replay.ReplayMemory`'s rules, on
    Redis' clock: an entry's id starts with the time it was added): not of a stream whose
    terminal is older than ``hold`` seconds, nor of one without a terminal whose last block
    is older than ``idle``. Entries that are not a block are skipped."""
    last: dict[tuple[Any, Any], tuple[int, bool]] = {}
    read: list[tuple[tuple[Any, Any], dict[str, Any], str | None]] = []
    for entry_id, fields in entries:
        entry = read_log_entry(fields)
        text = entry_id.decode("ascii", "replace") if isinstance(entry_id, bytes) else entry_id
        try:
            added = int(str(text).split("-", 1)[0])
        except ValueError:
            continue
        if entry is None:
            continue
        block, worker = entry
        key = (block.get("callId"), block.get("taskId"))
        _, ended = last.get(key, (0, False))
        last[key] = (added, ended or block.get("state") != "running")
        read.append((key, block, worker))
    fresh = {
        key
        for key, (added, ended) in last.items()
        if now_ms - added <= (hold if ended else idle) * 1000
    }
    return [(block, worker) for key, block, worker in read if key in fresh]


def _is_heartbeat(message: Any) -> bool:
    if isinstance(message, (bytes, bytearray)):
        return _HEARTBEAT_BYTES in message
    return isinstance(message, str) and WORKER_HEARTBEAT in message


def _is_terminal_emit(data: Any) -> bool:
    if not isinstance(data, dict) or data.get("event") != TOOL_EVENT_STREAM:
        return False
    args = data.get("data")
    block = args[0] if isinstance(args, list) and args else None
    return isinstance(block, dict) and block.get("state") in TERMINAL_STATES
