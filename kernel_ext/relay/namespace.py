"""The ``/chat`` namespace: blocks from internal senders to the browsers in each room.

:class:`ChatRelay` is a python-socketio ``AsyncNamespace`` to register on an ``AsyncServer``
(:func:`~kernel_ext.relay.mount_relay`) or to subclass as the application's own (define more
``on_<event>`` handlers; call ``super()`` in ``on_connect`` and ``on_disconnect``).

Guarantees:

* Only authenticated internal senders make the relay emit; anything else a browser sends
  reaches no one and costs a count, not a crash: dropped, logged (1st, 2nd, 4th … time per
  reason) and counted, as are invalid blocks and frames over the bounds.
* Frames of one internal connection are emitted in arrival order, whatever the server's
  ``async_handlers`` setting.
* A terminal emitted recently is not emitted again; one emitted into a room with no browser
  on this process is kept for browsers that join it meanwhile.
* A joining browser first gets the held blocks it lacks, then the live ones: nothing twice
  within one join, nothing lost in between; sent as it reads, within a budget per
  connection (:mod:`kernel_ext.relay.catch_up`).
* Back-pressure (:mod:`kernel_ext.relay.backpressure`): what a browser holds is bounded in
  packets and bytes, live and catch-up together; a browser that is behind skips running
  blocks (terminals always go; not with a pub/sub manager), and a frame's acknowledgement
  waits for its rooms' browsers.
* A worker gone for longer than ``worker_grace`` has its open streams ended ``aborted``.
* Works with ``AsyncRedisManager``: rooms span every web process on the same channel.

Design: docs/contracts.md, "Relay wire"; each handler's docstring says its part.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import socketio
from socketio.async_pubsub_manager import AsyncPubSubManager

from kernel_ext._shared import compat as _compat
from kernel_ext.errors import (
    BlockTooLargeError,
    DecodeError,
    check_positive_ints,
)
from kernel_ext.observability.count_names import (
    ACCEPTED,
    AFTER_WORKER_ABORTED,
    BAD_CURSOR,
    BAD_FRAME,
    BAD_JOIN,
    BAD_LEAVE,
    BAD_SECRET,
    BAD_WORKER,
    BLOCKS_EMITTED,
    BROWSER_REFUSED,
    BROWSERS,
    BUSY,
    CHAT_EVENTS,
    DUPLICATE_TERMINAL,
    FRAME_TOO_LARGE,
    FRAMES,
    IGNORED_CURSORS,
    INTERNAL,
    INTERNAL_CONNECTS,
    JOIN_REFUSED,
    JOINS,
    LATE_TERMINALS,
    NOT_BROWSER,
    NOT_INTERNAL,
    REJOINS,
    WORKERS_IN_GRACE,
)
from kernel_ext.protocol import (
    ACKS_PACED,
    CHAT_EVENT,
    DEFAULT_MAX_BLOCK_BYTES,
    FRAME_ROOMS,
    JOIN_EVENT,
    KX_BLOCKS,
    KX_CHAT_EVENT,
    KX_HELLO,
    LEAVE_EVENT,
    NAMESPACE,
    REFUSED_BAD_WORKER,
    REFUSED_UNAUTHORIZED,
    REPLAY_IDLE,
    TERMINAL_STATES,
    TOOL_EVENT_STREAM,
    check_block,
)
from kernel_ext.relay._log import count_frame, logger, rare
from kernel_ext.relay._send import local_sends, send_local
from kernel_ext.relay.auth import (
    BrowserAuth,
    InternalSecret,
    JoinAuth,
    allow_all,
    call_hook,
    worker_of,
)
from kernel_ext.relay.backpressure import (
    DEFAULT_BROWSER_QUEUE_BYTES,
    DEFAULT_BROWSER_STALL_TIMEOUT,
    DEFAULT_CATCH_UP_INFLIGHT_BYTES,
    BackPressure,
)
from kernel_ext.relay.catch_up import DEFAULT_CATCH_UP_BUDGET, CatchUp
from kernel_ext.relay.guarded import GuardedNamespace
from kernel_ext.relay.health import Readiness
from kernel_ext.relay.limits import (
    DEFAULT_JOIN_RATE,
    DEFAULT_MAX_BROWSER_ROOMS,
    DEFAULT_MAX_BROWSERS,
    DEFAULT_MAX_PER_IDENTITY,
    Admission,
)
from kernel_ext.relay.redis_manager import RelayRedisManager
from kernel_ext.relay.replay import (
    DEFAULT_CONVERSATION_BYTES,
    DEFAULT_STREAM_BYTES,
    DEFAULT_TOTAL_BYTES,
    ReplayMemory,
    read_cursors,
)
from kernel_ext.relay.stops import (
    DEFAULT_STOP_BURST,
    DEFAULT_STOP_RATE,
    DEFAULT_STOP_TIMEOUT,
    StopAuth,
    Stops,
)
from kernel_ext.relay.terminal_memory import TerminalMemory
from kernel_ext.relay.workers import DEFAULT_WORKER_GRACE, ConnectionGrace, track_workers

__all__ = ["ChatRelay"]

_ROOM_MAX = 512
_CATCH_UP_ROUNDS = 8
"""Rounds a catch-up takes at most to find nothing more to send before the browser enters
the room (each sends what arrived during the one before)."""

# Why a relay whose server's manager is a RelayRedisManager is not ready, by its state.
_REDIS_NOT_READY = {
    "idle": "redis listener not started",
    "connecting": "redis connecting",
    "unreachable": "redis unreachable",
}


class _Internal:
    """One internal sender's connection: its ordered emit queue and the task that empties it
    (:meth:`ChatRelay._emit_queued`), and the worker process it belongs to (its ``worker``
    auth field, else ``sid/<sid>``).

    A frame is emitted at once by its own handler when nothing of the connection is queued,
    held or being emitted (``idle`` set, ``holding`` false; the common case, without a hop
    through the queue's task); otherwise it is queued behind the others. The queue's task
    takes a job (``holding``), waits for ``idle`` and emits it: frames keep arrival order."""

    __slots__ = ("holding", "idle", "queue", "task", "worker")

    def __init__(self, worker: str = "") -> None:
        self.queue: asyncio.Queue[tuple[str, str, Any, asyncio.Future[int]] | None] = (
            asyncio.Queue()
        )
        self.task: asyncio.Task[None] | None = None
        self.worker = worker
        self.idle = asyncio.Event()
        self.idle.set()
        self.holding = False

    def free(self) -> bool:
        """Whether a new job may run at once (nothing queued, held or running)."""
        return self.idle.is_set() and not self.holding and self.queue.empty()


class ChatRelay(GuardedNamespace):
    """The ``/chat`` relay namespace (module docstring for the guarantees).

    Args:
        secret: the shared secret of internal senders, at least
            :data:`~kernel_ext.settings.MIN_SECRET_BYTES` (16) bytes in UTF-8.
        namespace: the namespace (default ``/chat``).
        authenticate: browser auth hook (default: accept every browser).
        authorize_join: room authorization hook (default: allow every join, logged once
            as a warning — pass a real hook in production).
        max_block_bytes: the size bound of one block (encoded JSON).
        max_frame_blocks: blocks per ``kx_blocks`` frame.
        max_pending_frames: frames queued per internal connection before ``busy``.
        dedup_terminals: terminals remembered to suppress re-sends (0 disables).
        dedup_ttl: seconds a terminal is remembered.
        hold_terminals: terminals kept for late joiners of empty rooms (0 disables); not
            used with ``catch_up`` (the held streams have their terminals).
        hold_ttl: seconds such a terminal is kept.
        catch_up: keep the conversations' streams in memory and catch joining browsers up
            (default ``True``; docs/operations.md, "Catch-up").
        replay_stream_bytes, replay_conversation_bytes, replay_total_bytes,
            replay_max_streams, replay_hold, replay_idle: the bounds of that memory
            (:class:`~kernel_ext.relay.replay.ReplayMemory`).
        max_cursors: entries of a join's ``have`` list read at most.
        browser_queue_max: packets queued for one browser of this process at which it gets
            no more running blocks until it reads (``None``: no bound, and acknowledgements
            are not paced — the relay's behaviour before back-pressure). A frame's
            acknowledgement waits until every browser of its rooms has fewer than a quarter
            of that queued, at most ``ack_pace_timeout`` seconds; a browser that made it
            wait that long is not waited for again until it has caught up to that quarter.
        ack_pace_timeout: seconds an acknowledgement waits for the browsers at most.
        browser_queue_bytes: bytes queued for one browser past which, as past
            ``browser_queue_max`` packets, it gets no running block and no catch-up block
            until it reads (``None``: no byte bound; neither bound without
            ``browser_queue_max``).
        browser_stall_timeout: seconds a browser may stay at a bound (a running block skipped
            it, or a catch-up waits for it) without reading down to a quarter of it, before
            it is disconnected (``browsers_stalled``; ``None``: never).
        catch_up_inflight_bytes: catch-up bytes queued to this process's browsers, and not
            yet written, at most in all; more catch-ups wait their turn.
        catch_up_budget: bytes of catch-up one connection may receive a minute (refilled
            continuously; at least ``replay_conversation_bytes``; ``None``: no budget); past
            it a join's catch-up is limited and its acknowledgement says so.
        Back-pressure and catch-up: :mod:`kernel_ext.relay.backpressure`,
            :mod:`kernel_ext.relay.catch_up`.
        max_browsers, max_per_identity, max_browser_rooms, join_rate, join_burst: the
            admission caps of this process's browsers (``None``: no cap;
            :class:`~kernel_ext.relay.limits.Admission`): browsers, browsers of one
            identity, conversations one browser holds, its joins per second and at once.
        worker_grace: seconds a worker may stay disconnected before the relay ends its open
            streams with ``aborted`` (``None`` disables; see "Gone workers" below).
        max_workers: workers with open streams tracked at once.
        max_worker_streams: open streams tracked per worker.
        authorize_stop, stop_rate, stop_burst, stop_timeout: a browser's stop requests
            (:class:`~kernel_ext.relay.stops.Stops`).

    Gone workers (the rules: :mod:`kernel_ext.relay.workers`): a worker is the connect
    auth's ``worker`` id, else the connection's sid. When the last connection of a worker
    with open streams is gone and none of that worker comes back within ``worker_grace``
    seconds, the relay emits one ``aborted`` block to the room of each of its open streams
    (counted ``worker_aborted``); one that comes back in time cancels that
    (``workers_resumed``) and ends its streams itself. Such a terminal is remembered like
    any other, and later running blocks of those streams are dropped
    (``after_worker_aborted``). Call :meth:`aclose` when the server stops.

    :attr:`terminals` is what it remembers of the terminals it emitted
    (:class:`~kernel_ext.relay.terminal_memory.TerminalMemory`).

    Raises:
        ConfigError: a secret shorter than that (:func:`~kernel_ext.settings.check_secret`),
            a bad bound, grace or ttl.
    """

    def __init__(
        self,
        secret: str,
        *,
        namespace: str = NAMESPACE,
        authenticate: BrowserAuth | None = None,
        authorize_join: JoinAuth | None = None,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
        max_frame_blocks: int = 1_000,
        max_pending_frames: int = 10_000,
        dedup_terminals: int = 4_096,
        dedup_ttl: float = 300.0,
        hold_terminals: int = 256,
        hold_ttl: float = 30.0,
        worker_grace: float | None = DEFAULT_WORKER_GRACE,
        max_workers: int = 1_024,
        max_worker_streams: int = 10_000,
        catch_up: bool = True,
        replay_stream_bytes: int = DEFAULT_STREAM_BYTES,
        replay_conversation_bytes: int = DEFAULT_CONVERSATION_BYTES,
        replay_total_bytes: int = DEFAULT_TOTAL_BYTES,
        replay_max_streams: int = 10_000,
        replay_hold: float = 30.0,
        replay_idle: float = REPLAY_IDLE,
        max_cursors: int = 1_000,
        browser_queue_max: int | None = 2_000,
        ack_pace_timeout: float = 1.0,
        browser_queue_bytes: int | None = DEFAULT_BROWSER_QUEUE_BYTES,
        browser_stall_timeout: float | None = DEFAULT_BROWSER_STALL_TIMEOUT,
        catch_up_inflight_bytes: int = DEFAULT_CATCH_UP_INFLIGHT_BYTES,
        catch_up_budget: int | None = DEFAULT_CATCH_UP_BUDGET,
        max_browsers: int | None = DEFAULT_MAX_BROWSERS,
        max_per_identity: int | None = DEFAULT_MAX_PER_IDENTITY,
        max_browser_rooms: int | None = DEFAULT_MAX_BROWSER_ROOMS,
        join_rate: float | None = DEFAULT_JOIN_RATE,
        join_burst: int | None = None,
        authorize_stop: StopAuth | None = None,
        stop_rate: float | None = DEFAULT_STOP_RATE,
        stop_burst: int = DEFAULT_STOP_BURST,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    ) -> None:
        self._secret = InternalSecret(secret)
        self.limits = Admission(
            max_browsers=max_browsers,
            max_per_identity=max_per_identity,
            max_browser_rooms=max_browser_rooms,
            join_rate=join_rate,
            join_burst=join_burst,
            reject=self._reject,
        )
        """The admission caps of this relay's browsers."""
        back_pressure = BackPressure(
            namespace,
            self._count_later,
            browser_queue_max=browser_queue_max,
            ack_pace_timeout=ack_pace_timeout,
            browser_queue_bytes=browser_queue_bytes,
            browser_stall_timeout=browser_stall_timeout,
            catch_up_inflight_bytes=catch_up_inflight_bytes,
            max_block_bytes=max_block_bytes,
        )
        self.browser_queue_max = browser_queue_max
        self.ack_pace_timeout = back_pressure.ack_pace_timeout
        check_positive_ints(
            max_block_bytes=max_block_bytes,
            max_frame_blocks=max_frame_blocks,
            max_pending_frames=max_pending_frames,
            max_cursors=max_cursors,
        )
        self.replay: ReplayMemory | None = (
            ReplayMemory(
                stream_bytes=replay_stream_bytes,
                conversation_bytes=replay_conversation_bytes,
                total_bytes=replay_total_bytes,
                max_streams=replay_max_streams,
                max_block_bytes=max_block_bytes,
                hold=replay_hold,
                idle=replay_idle,
                count=self._count,
            )
            if catch_up
            else None
        )
        """The conversations' held streams (``None`` without ``catch_up``)."""
        self.max_cursors = max_cursors
        if catch_up:
            hold_terminals = 0  # the held streams keep their terminals
        super().__init__(namespace)
        self.back_pressure = back_pressure
        """What each browser may have queued, and catch-ups in all
        (:class:`~kernel_ext.relay.backpressure.BackPressure`)."""
        streams = track_workers(
            worker_grace,
            self._count,
            "",
            max_workers=max_workers,
            max_worker_streams=max_worker_streams,
        )
        terminals = TerminalMemory(
            remember=dedup_terminals,
            remember_ttl=dedup_ttl,
            hold=hold_terminals,
            hold_ttl=hold_ttl,
            count=self._count,
        )
        self._authenticate = authenticate
        if authorize_join is None:
            logger.warning(
                "ChatRelay: no authorize_join hook; every browser may join any conversation"
            )
        self._authorize_join: JoinAuth = authorize_join or allow_all
        self.max_block_bytes = max_block_bytes
        self.max_frame_blocks = max_frame_blocks
        self.max_pending_frames = max_pending_frames
        self.dedup_terminals = dedup_terminals
        self.dedup_ttl = dedup_ttl
        self.hold_terminals = hold_terminals
        self.hold_ttl = hold_ttl
        self.worker_grace = streams.grace if streams is not None else None
        self.terminals = terminals
        self.catch_up: CatchUp | None = (
            None
            if self.replay is None
            else CatchUp(self.replay, back_pressure, terminals, self._count, budget=catch_up_budget)
        )
        """Joins with catch-up (:class:`~kernel_ext.relay.catch_up.CatchUp`; ``None``
        without ``catch_up``)."""
        self._internal: dict[str, _Internal] = {}
        self._closing: set[asyncio.Task[None]] = set()  # refused connections being closed
        self._browsers: dict[str, Any] = {}
        self._streams = streams
        self._grace = (
            None
            if streams is None
            else ConnectionGrace(
                streams, connected=self._connected, emit=self._emit_ended, count=self._count
            )
        )

        self.stops = Stops(
            browsers=self._browsers,
            in_room=self._in_room,
            loopback=streams,
            connection=lambda w: next(
                (sid for sid, conn in self._internal.items() if conn.worker == w), None
            ),
            ask=self.call,
            calls=lambda room, call: self.replay.call_state(room, call) if self.replay else None,
            manager=lambda: self.server.manager,
            count=self._count,
            reject=self._reject,
            authorize_stop=authorize_stop,
            stop_rate=stop_rate,
            stop_burst=stop_burst,
            stop_timeout=stop_timeout,
        )
        """A browser's stop requests (:class:`~kernel_ext.relay.stops.Stops`)."""

    def _count_later(self, outcome: str, n: int = 1) -> None:
        self._count(outcome, n)  # the counter exists once the namespace is made

    def _set_server(self, server: Any) -> None:
        super()._set_server(server)
        self.back_pressure.attach(server)

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counts by outcome since start (``frames``, ``blocks_emitted``, ``rejected_*`` …,
        ``redis_*`` with :func:`~kernel_ext.relay.create_app`'s Redis manager) and the
        current ``internal``/``browsers`` connections. ``rejected_bad_packet`` counts
        packets of this server that python-socketio could not decode or dispatch (logged by
        the library), ``suppressed_log_records`` those of its log records the relay held
        back."""
        counts = dict(self._counts)
        counts.update(getattr(getattr(self.server, "manager", None), "counts", None) or {})
        counts[INTERNAL] = len(self._internal)
        counts[BROWSERS] = len(self._browsers)
        if self._streams is not None:
            counts.update(self._streams.sizes())
            counts[WORKERS_IN_GRACE] = self._streams.in_grace()
        manager = getattr(self.server, "manager", None)
        if isinstance(manager, RelayRedisManager):
            counts.update(manager.worker_sizes())
        if self.replay is not None:
            counts.update(self.replay.sizes())
        counts.update(self.browser_queues())
        counts.update(self.limits.sizes())
        return counts

    def browser_queues(self) -> dict[str, int]:
        """Packets queued now for this process's browsers: ``browser_queued`` in all and
        ``browser_queue_longest`` (the most for one browser)."""
        return self.back_pressure.browser_queues(self._browsers)

    def readiness(self) -> Readiness:
        """Whether this relay can do its job now (what ``/readyz`` answers:
        :mod:`kernel_ext.relay.health`): it is its server's handler of its namespace
        (else ``"namespace /chat not mounted"``), and when the server's client manager is a
        :class:`~kernel_ext.relay.RelayRedisManager`, that is subscribed to Redis (else
        ``"redis unreachable"``, ``"redis connecting"`` or ``"redis listener not
        started"``: python-socketio starts it at the first connection,
        :meth:`RelayRedisManager.start <kernel_ext.relay.RelayRedisManager.start>` at
        once). Without a Redis manager, or with python-socketio's plain one (which does not
        say), Redis is not checked. Never raises."""
        reasons = []
        server = self.server
        handlers = getattr(server, "namespace_handlers", None) or {}
        if handlers.get(self.namespace) is not self:
            reasons.append(f"namespace {self.namespace} not mounted")
        manager = getattr(server, "manager", None)
        if isinstance(manager, RelayRedisManager) and manager.redis_state != "connected":
            reasons.append(_REDIS_NOT_READY.get(manager.redis_state, "redis unreachable"))
        return Readiness(tuple(reasons))

    # -- connections ----------------------------------------------------------------------

    async def on_connect(self, sid: str, environ: Mapping[str, Any], auth: Any = None) -> bool:
        """``auth`` ``{"internal": "<secret>", "worker": "<worker id>"}`` is an internal
        sender (the secret compared in constant time as bytes; a wrong or non-string one,
        a lone surrogate included, is refused, never taken for a browser); anything else is
        a browser, checked by the ``authenticate`` hook."""
        if isinstance(auth, Mapping) and "internal" in auth:
            given = auth.get("internal")
            if not self._secret.matches(given):
                self._reject(sid, BAD_SECRET, "an internal connection")
                raise socketio.exceptions.ConnectionRefusedError(REFUSED_UNAUTHORIZED)
            worker = worker_of(sid, auth)
            if worker is None:
                self._reject(sid, BAD_WORKER, "an internal connection")
                raise socketio.exceptions.ConnectionRefusedError(REFUSED_BAD_WORKER)
            conn = _Internal(worker)
            conn.task = asyncio.get_running_loop().create_task(self._emit_queued(sid, conn))
            self._internal[sid] = conn
            self.stops.serve()
            self._count(INTERNAL_CONNECTS)
            if self._grace is not None:
                self._grace.arrived(worker)
            return True
        identity: Any = True
        if self._authenticate is not None:
            try:
                identity = await call_hook(self._authenticate, auth, environ)
            except socketio.exceptions.ConnectionRefusedError:
                self._count(BROWSER_REFUSED)
                raise
            except Exception:
                logger.exception("relay: browser authentication hook failed")
                identity = None
        if identity is None or identity is False:
            self._count(BROWSER_REFUSED)
            raise socketio.exceptions.ConnectionRefusedError(REFUSED_UNAUTHORIZED)
        try:
            self.limits.connect(sid, identity)  # raises a refusal past a cap
        except socketio.exceptions.ConnectionRefusedError:
            self._close_refused(sid)
            raise
        self._browsers[sid] = identity
        return True

    def _close_refused(self, sid: str) -> None:
        """Close the Engine.IO connection of a browser refused by a cap once its refusal is
        queued to it, unless another namespace of the application holds the connection: a
        refused browser would otherwise keep its connection open, and a client that opens
        more and more of them would make this process hold each (about 40 KiB)."""
        manager = self.server.manager
        eio_sid = manager.eio_sid_from_sid(sid, self.namespace)
        if eio_sid is None:
            return

        async def close() -> None:
            # Runs after the refusal's CONNECT_ERROR was queued (python-socketio queues it
            # with no await that waits, right after this handler raised).
            for namespace in list(manager.get_namespaces()):
                if namespace != self.namespace and manager.sid_from_eio_sid(eio_sid, namespace):
                    return
            await _compat.end_connection(self.server.eio, eio_sid)

        task = asyncio.get_running_loop().create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def on_disconnect(self, sid: str, reason: Any = None) -> None:
        """Forget the connection; an internal sender's queued frames are still emitted."""
        self.limits.disconnect(sid)
        self._browsers.pop(sid, None)
        self.back_pressure.forget(sid)
        self.stops.forget(sid)
        if self.catch_up is not None:
            self.catch_up.forget(sid)
        conn = self._internal.pop(sid, None)
        if conn is not None:
            conn.queue.put_nowait(None)

    def _who(self, sid: str) -> str:
        return "internal sender" if sid in self._internal else "browser"

    # -- browsers -------------------------------------------------------------------------

    async def on_join_conversation(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Put a browser into the room of ``data["conversationId"]`` if the hook allows."""
        room = self._room_of(data)
        if sid not in self._browsers:
            self._reject(sid, NOT_BROWSER, JOIN_EVENT)
            return {"ok": False, "error": "only browsers join conversations"}
        if room is None:
            self._reject(sid, BAD_JOIN, JOIN_EVENT)
            return {"ok": False, "error": "conversationId must be a non-empty string"}
        refused = self.limits.join(sid, room)
        if refused is not None:
            return refused
        try:
            allowed = await call_hook(self._authorize_join, self._browsers[sid], room)
        except Exception:
            logger.exception("relay: authorize_join hook failed")
            allowed = False
        if not allowed:
            if not self._in_room(sid, room):
                self.limits.leave(sid, room)  # a refused join holds no slot
            self._count(JOIN_REFUSED)
            return {"ok": False, "error": "forbidden"}
        manager = self.server.manager
        # Behind Redis with room routing, this process subscribes to the room (and reads its
        # log) before the browser enters it: RelayRedisManager.joining().
        joining = (
            manager.joining(self.namespace, room)
            if isinstance(manager, RelayRedisManager)
            else contextlib.nullcontext()
        )
        if self.replay is None:
            async with joining:
                await self.enter_room(sid, room)
            self._count(JOINS)
            late = self.terminals.late(sid, room)
            for raw in late:
                await self.emit(TOOL_EVENT_STREAM, raw, to=sid)
            if late:
                self._count(LATE_TERMINALS, len(late))
            return {"ok": True}
        cursors, ignored = read_cursors(data.get("have"), self.max_cursors)
        if ignored:  # counted and rarely logged; the join itself goes on
            self._reject(sid, BAD_CURSOR, f"{ignored} cursor(s) of {JOIN_EVENT}")
            self._count(IGNORED_CURSORS, ignored)
        async with joining:
            rejoin = self._in_room(sid, room)
            assert self.catch_up is not None
            replay = await self.catch_up.join(
                sid,
                room,
                cursors,
                rejoin=rejoin,
                have="have" in data,
                enter=lambda: self.enter_room(sid, room),
                leave=lambda: self.leave_room(sid, room),
            )
        self._count(JOINS)
        if replay is None:
            self._count(REJOINS)
            return {"ok": True}
        # What the catch-up sent is told to a browser that asked (it sent ``have``, an empty
        # list included) and to any whose catch-up was limited; any other gets the
        # acknowledgement it always got.
        return (
            {"ok": True, "replay": replay}
            if "have" in data or "limited" in replay
            else {"ok": True}
        )

    async def on_stop_call(self, sid: str, data: Any = None) -> dict[str, Any]:
        """A browser asks to stop one call of a room it joined: :class:`Stops`."""
        return await self.stops.handle(sid, data)

    def _in_room(self, sid: str, room: str) -> bool:
        """Whether ``sid`` is in ``room`` here: a look at that room's members.
        ``self.rooms(sid)`` scans every room of the namespace (python-socketio's
        ``get_rooms``): 5,000 conversations made each join cost milliseconds."""
        members = self.server.manager.get_participants(self.namespace, room)
        return any(member == sid for member, _ in members)

    async def on_leave_conversation(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Take a browser out of a conversation's room."""
        room = self._room_of(data)
        if sid not in self._browsers or room is None:
            self._reject(sid, BAD_LEAVE, LEAVE_EVENT)
            return {"ok": False, "error": "conversationId must be a non-empty string"}
        self.limits.leave(sid, room)
        await self.leave_room(sid, room)
        return {"ok": True}

    @staticmethod
    def _room_of(data: Any) -> str | None:
        if not isinstance(data, Mapping):
            return None
        room = data.get("conversationId")
        if not isinstance(room, str) or not room or len(room) > _ROOM_MAX:
            return None
        return room

    def _listeners(self, room: str) -> Iterator[str]:
        """The sids of ``room``'s browsers on this process."""
        return (sid for sid, _ in self.server.manager.get_participants(self.namespace, room))

    # -- internal senders -----------------------------------------------------------------

    async def on_kx_hello(self, sid: str, data: Any = None) -> dict[str, Any]:
        """What this relay takes from an internal sender, asked once per connection:
        ``{"ok": true, "v": 1, "frames": ["rooms"], "maxFrameBlocks", "maxBlockBytes"}``
        (``"rooms"``: a frame may carry blocks of several rooms). A sender that gets no such
        answer (a relay older than this one) sends one room per frame. ``"acks": "paced"``
        (unless ``browser_queue_max`` is ``None``): every frame's acknowledgement is paced
        by the browsers (:meth:`on_kx_blocks`); a sender not told so sends as before."""
        if sid not in self._internal:
            self._reject(sid, NOT_INTERNAL, KX_HELLO)
            return {"ok": False, "error": "forbidden"}
        answer: dict[str, Any] = {
            "ok": True,
            "v": 1,
            "frames": [FRAME_ROOMS],
            "maxFrameBlocks": self.max_frame_blocks,
            "maxBlockBytes": self.max_block_bytes,
        }
        if self.browser_queue_max is not None:
            answer["acks"] = ACKS_PACED
        return answer

    async def on_kx_blocks(self, sid: str, data: Any = None) -> dict[str, Any]:
        """A frame from an internal sender: ``{"v": 1, "room", "blocks": [...]}`` (one
        room) or ``{"v": 1, "rooms": [{"room", "blocks": [...]}, ...]}`` (several, in
        order; at most ``max_frame_blocks`` blocks in all). Each block is validated
        (:func:`kernel_ext.protocol.decode`, the size bound by the protocol's one measure)
        and each valid one goes out unchanged as one ``tool_event_stream`` to its room, in
        frame order. Acknowledged ``{"ok": true, "accepted": n, "rejected": m}`` once
        emitted, plus, when ``m > 0``, ``"refused": [{"index": i, "reason": "too_large" |
        "invalid"}, ...]`` (``i`` counts the blocks of the whole frame, in order) and
        ``"maxBlockBytes"`` (the relay's bound), so a sender can degrade a refused terminal
        and send it again. With ``browser_queue_max`` the acknowledgement is paced: it comes
        once every browser of the frame's rooms on this process has fewer than a quarter of
        that queued (a browser this relay gave up waiting for is not waited for again until
        it has), or after ``ack_pace_timeout`` seconds (counted ``ack_pace_timeouts``).
        Once a frame's blocks are emitted, its ``blocks`` lists are emptied: the blocks are
        released while the acknowledgement waits."""
        conn = self._internal.get(sid)
        if conn is None:
            self._reject(sid, NOT_INTERNAL, KX_BLOCKS)
            return {"ok": False, "error": "forbidden"}
        # Everything up to the enqueue is synchronous: frames queue in arrival order even
        # when the server runs each event as its own task (async_handlers=True).
        sections = self._sections(data)
        if isinstance(sections, str):
            self._reject(sid, BAD_FRAME, KX_BLOCKS)
            return {"ok": False, "error": sections}
        if sum(len(blocks) for _, blocks in sections) > self.max_frame_blocks:
            self._reject(sid, FRAME_TOO_LARGE, KX_BLOCKS)
            return {"ok": False, "error": f"more than {self.max_frame_blocks} blocks in a frame"}
        valid, refused = self._checked_sections(sid, sections)
        if conn.queue.qsize() >= self.max_pending_frames:
            self._reject(sid, BUSY, KX_BLOCKS)
            return {"ok": False, "error": "busy"}
        self._count(FRAMES)
        count_frame(ACCEPTED)
        await self._submit(conn, "blocks", "", valid)
        rooms = [room for room, _ in valid]
        accepted = sum(len(blocks) for _, blocks in valid)
        # The frame's blocks are out: release them before the acknowledgement waits (the
        # server holds the frame until the handler returns). Kept alive through that wait,
        # a saturated relay's frames outlived two collections, and every block's dicts
        # then counted towards a collection of the whole heap (docs/operations.md, "Where
        # it saturates first").
        valid = []
        for _, blocks in sections:
            blocks.clear()
        if self.browser_queue_max is not None:
            await self.back_pressure.pace(rooms)
        ack: dict[str, Any] = {
            "ok": True,
            "accepted": accepted,
            "rejected": len(refused),
        }
        if refused:
            ack["refused"] = refused
            ack["maxBlockBytes"] = self.max_block_bytes
        return ack

    def _checked_sections(
        self, sid: str, sections: list[tuple[str, list[Any]]]
    ) -> tuple[list[tuple[str, list[tuple[Any, bytes]]]], list[dict[str, Any]]]:
        """A frame's sections with only their valid blocks, each with its compact JSON
        (:meth:`_check_block`); and the refused ones (``index`` over the whole frame, and
        the reason), each counted."""
        valid: list[tuple[str, list[tuple[Any, bytes]]]] = []
        refused: list[dict[str, Any]] = []
        index = 0
        for room, blocks in sections:
            kept: list[tuple[Any, bytes]] = []
            for raw in blocks:
                checked = self._check_block(raw)
                if isinstance(checked, bytes):
                    kept.append((raw, checked))
                else:
                    refused.append({"index": index, "reason": checked})
                    self._reject(sid, checked, "a block")
                index += 1
            valid.append((room, kept))
        return valid, refused

    def _sections(self, data: Any) -> list[tuple[str, list[Any]]] | str:
        """A frame's (room, blocks) sections in order, or what is wrong with it."""
        if not isinstance(data, Mapping) or data.get("v") != 1:
            return "a frame is {v: 1, room, blocks} or {v: 1, rooms: [{room, blocks}, ...]}"
        if "rooms" in data:
            entries = data.get("rooms")
            if not isinstance(entries, list) or not entries:
                return "rooms must be a non-empty list of {room, blocks}"
            if len(entries) > self.max_frame_blocks:
                return f"more than {self.max_frame_blocks} rooms in a frame"
        else:
            entries = [data]
        sections: list[tuple[str, list[Any]]] = []
        for entry in entries:
            room = entry.get("room") if isinstance(entry, Mapping) else None
            if not isinstance(room, str) or not room or len(room) > _ROOM_MAX:
                return "room must be a non-empty string"
            blocks = entry.get("blocks")
            if not isinstance(blocks, list):
                return "blocks must be a list"
            sections.append((room, blocks))
        return sections

    async def on_kx_chat_event(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Relay the kernel's ``chat_event`` snapshot from an internal sender to the room."""
        conn = self._internal.get(sid)
        if conn is None:
            self._reject(sid, NOT_INTERNAL, KX_CHAT_EVENT)
            return {"ok": False, "error": "forbidden"}
        room = data.get("room") if isinstance(data, Mapping) else None
        event = data.get("event") if isinstance(data, Mapping) else None
        if not isinstance(room, str) or not room or not isinstance(event, Mapping):
            self._reject(sid, BAD_FRAME, KX_CHAT_EVENT)
            return {"ok": False, "error": "a chat event frame is {room, event}"}
        await self._submit(conn, "chat_event", room, dict(event))
        return {"ok": True}

    def _check_block(self, raw: Any) -> str | bytes:
        """The block's compact JSON when ``raw`` is a valid block within the size bound (the
        protocol's one measure, :func:`kernel_ext.protocol.block_size`; the catch-up memory
        holds that JSON, encoded once here), else the reason it is refused."""
        if not isinstance(raw, Mapping):
            return "invalid"
        try:
            return check_block(raw, max_bytes=self.max_block_bytes)
        except BlockTooLargeError:
            return "too_large"
        except (DecodeError, TypeError, ValueError, RecursionError):
            return "invalid"

    async def _emit_in_order(self, blocks: list[tuple[Any, bytes | None]], room: str) -> None:
        """One ``tool_event_stream`` per block, in order.

        With the in-process client manager each block is queued to its browsers'
        connections in the step that picks them (:func:`~kernel_ext.relay._send.send_local`),
        one after the other. Another manager of the same kind keeps its own ``emit``, each
        block's as a task: asyncio runs new tasks in creation order, so they overlap and keep
        their order. A pub/sub manager (Redis) publishes after an await, so there they go one
        after the other (collected into one pipeline per frame by
        :class:`RelayRedisManager`: :meth:`_run`).
        """
        manager = self.server.manager
        pubsub = isinstance(manager, AsyncPubSubManager)
        if not self.back_pressure.bounded or pubsub:
            skips: list[list[str] | None] = [None] * len(blocks)
            reserved: dict[str, list[int]] = {}
        else:
            skips, reserved = self.back_pressure.reserve(blocks, room)
        try:
            if len(blocks) > 1 and not pubsub and not local_sends(manager):
                loop = asyncio.get_running_loop()
                tasks = [
                    loop.create_task(self._emit_block(raw, room, data, skip))
                    for (raw, data), skip in zip(blocks, skips, strict=True)
                ]
                results = await asyncio.gather(*tasks, return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
                return
            for (raw, data), skip in zip(blocks, skips, strict=True):
                await self._emit_block(raw, room, data, skip)
        finally:
            self.back_pressure.release(reserved)

    async def _emit_block(
        self, raw: Any, room: str, data: bytes | None = None, skip: list[str] | None = None
    ) -> None:
        """Emit one block to its room; held for catch-up in the same step (before the emit
        picks the room's browsers, with nothing awaited in between) — unless the server's
        manager is a :class:`~kernel_ext.relay.RelayRedisManager`, which holds every block
        it emits to this process's browsers, wherever it came from. ``data``: the block's
        compact JSON when the relay has it already; ``skip``: the browsers it does not go to
        (:meth:`BackPressure.reserve <kernel_ext.relay.backpressure.BackPressure.reserve>`)."""
        replay = self.replay
        manager = self.server.manager
        if local_sends(manager):
            if replay is not None:
                replay.add(room, raw, data)
            await send_local(self.server, self.namespace, TOOL_EVENT_STREAM, raw, room, skip)
            return
        if replay is not None and not isinstance(manager, RelayRedisManager):
            replay.add(room, raw, data)
        await self.emit(TOOL_EVENT_STREAM, raw, room=room, skip_sid=skip)

    async def _submit(self, conn: _Internal, kind: str, room: str, payload: Any) -> int:
        """Emit a job now when the connection is free, else queue it behind the others (in
        arrival order either way: :class:`_Internal`); how many blocks went out."""
        if conn.free():
            conn.idle.clear()
            try:
                return await self._run(conn, kind, room, payload)
            finally:
                conn.idle.set()
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        conn.queue.put_nowait((kind, room, payload, done))
        return await done

    async def _run(self, conn: _Internal, kind: str, room: str, payload: Any) -> int:
        """Emit one job: a frame's valid blocks by room (``kind == "blocks"``, ``payload``
        its (room, blocks) sections) or a chat event; how many blocks went out."""
        if kind != "blocks":
            try:
                await self.emit(CHAT_EVENT, payload, room=room)
                self._count(CHAT_EVENTS)
            except asyncio.CancelledError:
                raise
            except Exception:
                rare("emit_failed", "relay: emitting to room %r failed", room, exc_info=True)
            return 0
        manager = self.server.manager
        # On Redis, the frame's publishes go as one pipeline, in order, once it is emitted
        # here (a round trip per frame, not per block).
        async with (
            manager.pipelined()
            if isinstance(manager, RelayRedisManager)
            else contextlib.nullcontext()
        ):
            return await self._emit_sections(conn, payload)

    async def _emit_sections(self, conn: _Internal, payload: Any) -> int:
        """Emit a frame's (room, blocks) sections in order; how many blocks went out."""
        emitted = 0
        for room, raws in payload:
            blocks = []
            for raw, data in raws:
                if not self._track(conn, raw, room):
                    continue
                if raw.get("state") in TERMINAL_STATES and not self.terminals.admit(
                    raw, room, self._listeners(room), self._browsers
                ):
                    self._count(DUPLICATE_TERMINAL)
                    continue
                blocks.append((raw, data))
            try:
                await self._emit_in_order(blocks, room)
            except asyncio.CancelledError:
                raise
            except Exception:
                rare("emit_failed", "relay: emitting to room %r failed", room, exc_info=True)
                continue
            emitted += len(blocks)
            self._count(BLOCKS_EMITTED, len(blocks))
        return emitted

    async def _emit_queued(self, sid: str, conn: _Internal) -> None:
        """Emit one connection's queued frames in arrival order, one after the other."""
        while True:
            job = await conn.queue.get()
            conn.holding = True
            try:
                await conn.idle.wait()  # a frame its handler is emitting goes first
            finally:
                conn.holding = False
            if job is None:
                if self._grace is not None:
                    self._grace.left(conn.worker)
                return
            kind, room, payload, done = job
            conn.idle.clear()
            try:
                emitted = await self._run(conn, kind, room, payload)
            except asyncio.CancelledError:
                if not done.done():
                    done.cancel()
                raise
            finally:
                conn.idle.set()
            if not done.done():
                done.set_result(emitted)

    # -- gone workers ---------------------------------------------------------------------

    def _track(self, conn: _Internal, raw: Any, room: str) -> bool:
        """Note a block about to be emitted; ``False``: drop it (a running block of a stream
        this relay ended because its worker was gone)."""
        if self._streams is None or self._streams.note(conn.worker, raw, room):
            return True
        if raw.get("state") != "running":
            return True  # a terminal: the terminal dedup decides
        self._count(AFTER_WORKER_ABORTED)
        rare(
            "after_worker_aborted",
            "relay: dropped a running block of (%s, %s), ended when its worker was gone",
            raw.get("callId"),
            raw.get("taskId"),
        )
        return False

    def _connected(self, worker: str) -> bool:
        return any(conn.worker == worker for conn in self._internal.values())

    async def _emit_ended(self, room: str, raw: dict[str, Any]) -> bool:
        """Emit one ``aborted`` block of a gone worker's stream; whether it went out."""
        if not self.terminals.admit(raw, room, self._listeners(room), self._browsers):
            return False  # its terminal went out already (another connection re-sent it)
        try:
            await self._emit_block(raw, room)
        except asyncio.CancelledError:
            raise
        except Exception:
            rare("emit_failed", "relay: emitting to room %r failed", room, exc_info=True)
            return False
        return True

    async def aclose(self) -> None:
        """Stop ending gone workers' streams: cancel every grace timer and any emission of
        ``aborted`` blocks in progress (and the watch of
        :class:`~kernel_ext.relay.RelayRedisManager`, if it is the server's manager); send
        the acknowledgements that wait for the browsers (back-pressure) now. Call
        it when the server stops — python-socketio gives a namespace no hook for that.
        Idempotent."""
        if self._grace is not None:
            await self._grace.aclose()
        await self.back_pressure.aclose()
        await self.stops.aclose()
        manager = getattr(self.server, "manager", None)
        if isinstance(manager, RelayRedisManager):
            await manager.stop_watching()
