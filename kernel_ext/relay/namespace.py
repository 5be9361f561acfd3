"""The ``/chat`` namespace: blocks from internal senders to the browsers in each room.

:class:`ChatRelay` is a python-socketio ``AsyncNamespace`` to register on an ``AsyncServer``
(:func:`~kernel_ext.relay.mount_relay`) or to subclass as the application's own (define more
``on_<event>`` handlers; call ``super()`` in ``on_connect`` and ``on_disconnect``). It only
receives events and hands each to a part with one job: :mod:`~kernel_ext.relay.frames`
(parse, check), :mod:`~kernel_ext.relay.ordering` (one connection's frames in arrival
order), :mod:`~kernel_ext.relay.outbound` and :mod:`~kernel_ext.relay.delivery` (how blocks
reach a room's browsers, the manager's), :mod:`~kernel_ext.relay.backpressure`,
:mod:`~kernel_ext.relay.joins` (entry with catch-up), :mod:`~kernel_ext.relay.gone_workers`,
:mod:`~kernel_ext.relay.limits`. Guarantees: only authenticated internal senders make the
relay emit (anything else costs a count, not a crash); terminals go out once; a joining
browser is caught up, then follows live; what a browser holds is bounded; a gone worker's
streams end ``aborted``. The rules in full: docs/contracts.md, "Relay wire".
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import socketio

from kernel_ext._shared import compat as _compat
from kernel_ext.observability import count_names as counted
from kernel_ext.protocol import (
    ACKS_PACED,
    FRAME_ROOMS,
    JOIN_EVENT,
    KX_BLOCKS,
    KX_CHAT_EVENT,
    KX_HELLO,
    LEAVE_EVENT,
    REFUSED_BAD_WORKER,
    REFUSED_UNAUTHORIZED,
    TOOL_EVENT_STREAM,
)
from kernel_ext.relay import frames
from kernel_ext.relay._log import count_frame, logger
from kernel_ext.relay.auth import (
    BrowserAuth,
    InternalSecret,
    JoinAuth,
    allow_all,
    call_hook,
    worker_of,
)
from kernel_ext.relay.catch_up import CatchUp
from kernel_ext.relay.delivery import Delivery, delivery_for
from kernel_ext.relay.gone_workers import GoneWorkers
from kernel_ext.relay.guarded import GuardedNamespace
from kernel_ext.relay.health import Readiness
from kernel_ext.relay.joins import Entry
from kernel_ext.relay.limits import close_refused
from kernel_ext.relay.ordering import InternalSender
from kernel_ext.relay.outbound import Outbound
from kernel_ext.relay.relay_settings import RelaySettings, SettingsAttributes
from kernel_ext.relay.stops import StopAuth, StopRequests

__all__ = ["ChatRelay"]


class ChatRelay(StopRequests, SettingsAttributes, GuardedNamespace):
    """The ``/chat`` relay namespace: blocks from internal senders to the browsers of each
    room (the guarantees: the module docstring; the rules in full: docs/contracts.md,
    "Relay wire").

    Args:
        secret: the shared secret of internal senders, at least
            :data:`~kernel_ext.settings.MIN_SECRET_BYTES` (16) bytes in UTF-8.
        authenticate: browser auth hook (default: accept every browser).
        authorize_join: room authorization hook (default: allow every join, logged once
            as a warning — pass a real hook in production).
        authorize_stop: who may stop a call (:mod:`~kernel_ext.relay.stops`; default: its room).
        settings: the relay's options (:class:`~kernel_ext.relay.relay_settings.RelaySettings`);
        options: or its fields as keywords (``namespace=``, ``catch_up=`` …), over
            ``settings`` when both are given.

    Call :meth:`aclose` when the server stops.

    Raises:
        ConfigError: a secret shorter than that (:func:`~kernel_ext.settings.check_secret`),
            a bad bound, grace or ttl.
    """

    def __init__(
        self,
        secret: str,
        *,
        authenticate: BrowserAuth | None = None,
        authorize_join: JoinAuth | None = None,
        authorize_stop: StopAuth | None = None,
        settings: RelaySettings | None = None,
        **options: Any,
    ) -> None:
        if settings is None:
            settings = RelaySettings(**options)
        elif options:
            settings = dataclasses.replace(settings, **options)
        self.settings = settings
        """The relay's options (:class:`~kernel_ext.relay.relay_settings.RelaySettings`)."""
        self._secret = InternalSecret(secret)
        self.limits = settings.admission(self._reject)
        """The admission caps of this relay's browsers."""
        self.catch_up_memory = settings.catch_up_memory(self._count)
        """The conversations' streams held for catch-up (``None`` without ``catch_up``)."""
        super().__init__(settings.namespace)
        self.back_pressure = settings.back_pressure(self._count)
        """What each browser may have queued, and catch-ups in all
        (:class:`~kernel_ext.relay.backpressure.BackPressure`)."""
        self.workers = GoneWorkers(
            settings.worker_grace,
            self._count,
            max_workers=settings.max_workers,
            max_worker_streams=settings.max_worker_streams,
            connected=self._connected,
            emit=self._emit_ended,
        )
        """Its workers' open streams, ended when a worker is gone
        (:class:`~kernel_ext.relay.gone_workers.GoneWorkers`)."""
        self.terminals = settings.emitted_terminals(self._count)
        """What it remembers of the terminals it emitted
        (:class:`~kernel_ext.relay.emitted_terminals.EmittedTerminals`)."""
        self._authenticate = authenticate
        if authorize_join is None:
            logger.warning(
                "ChatRelay: no authorize_join hook; every browser may join any conversation"
            )
        self._authorize_join: JoinAuth = authorize_join or allow_all
        self.authorize_stop = authorize_stop
        self.worker_grace = self.workers.grace
        self.catch_up: CatchUp | None = (
            None
            if self.catch_up_memory is None
            else CatchUp(
                self.catch_up_memory,
                self.back_pressure,
                self.terminals,
                self._count,
                budget=settings.catch_up_budget,
            )
        )
        """Joins with catch-up (:class:`~kernel_ext.relay.catch_up.CatchUp`; ``None``
        without ``catch_up``)."""
        self._entry = Entry(
            catch_up=self.catch_up,
            terminals=self.terminals,
            max_cursors=settings.max_cursors,
            enter=self.enter_room,
            leave=self.leave_room,
            send_to=lambda raw, sid: self.emit(TOOL_EVENT_STREAM, raw, to=sid),
            in_room=self._in_room,
            count=self._count,
            reject=self._reject,
        )
        self._internal: dict[str, InternalSender] = {}
        self._closing: set[asyncio.Task[None]] = set()  # refused connections being closed
        self.delivery: Delivery | None = None
        """How blocks reach a room's browsers: the server's client manager's
        (:func:`~kernel_ext.relay.delivery.delivery_for`), set when the namespace is
        registered."""
        self._browsers: dict[str, Any] = {}
        self._outbound = Outbound(
            back_pressure=self.back_pressure,
            terminals=self.terminals,
            workers=self.workers,
            browsers=self._browsers,
            count=self._count,
        )

    def _set_server(self, server: Any) -> None:
        super()._set_server(server)
        self.back_pressure.attach(server)
        self.delivery = delivery_for(self.emit, server, self.namespace, self.catch_up_memory)
        self._outbound.delivery = self.delivery

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counts by outcome since start (``frames``, ``blocks_emitted``, ``rejected_*`` …,
        ``redis_*`` with :func:`~kernel_ext.relay.create_app`'s Redis manager) and the
        current ``internal``/``browsers`` connections. ``rejected_bad_packet`` counts
        packets of this server that python-socketio could not decode or dispatch (logged by
        the library), ``suppressed_log_records`` those of its log records the relay held
        back."""
        counts = dict(self._counts)
        delivery = self.delivery
        if delivery is not None:
            counts.update(delivery.counts())
        counts[counted.INTERNAL] = len(self._internal)
        counts[counted.BROWSERS] = len(self._browsers)
        counts.update(self.workers.sizes())
        if self.catch_up_memory is not None:
            counts.update(self.catch_up_memory.sizes())
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
        (else ``"namespace /chat not mounted"``), and its delivery can deliver
        (:meth:`Delivery.not_ready <kernel_ext.relay.delivery.Delivery.not_ready>`: with a
        :class:`~kernel_ext.relay.RelayRedisManager`, whether that is subscribed to Redis;
        without one, or with python-socketio's plain one, which does not say, Redis is not
        checked). Never raises."""
        reasons = []
        if _compat.namespace_handler(self.server, self.namespace) is not self:
            reasons.append(f"namespace {self.namespace} not mounted")
        not_ready = self.delivery.not_ready() if self.delivery is not None else None
        if not_ready is not None:
            reasons.append(not_ready)
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
                self._reject(sid, counted.BAD_SECRET, "an internal connection")
                raise socketio.exceptions.ConnectionRefusedError(REFUSED_UNAUTHORIZED)
            worker = worker_of(sid, auth)
            if worker is None:
                self._reject(sid, counted.BAD_WORKER, "an internal connection")
                raise socketio.exceptions.ConnectionRefusedError(REFUSED_BAD_WORKER)
            conn = InternalSender(worker, self._outbound.run)
            conn.start(self.workers.left)
            self._internal[sid] = conn
            self._count(counted.INTERNAL_CONNECTS)
            self.workers.arrived(worker)
            self.stops.serve()
            return True
        identity: Any = True
        if self._authenticate is not None:
            try:
                identity = await call_hook(self._authenticate, auth, environ)
            except socketio.exceptions.ConnectionRefusedError:
                self._count(counted.BROWSER_REFUSED)
                raise
            except Exception:
                logger.exception("relay: browser authentication hook failed")
                identity = None
        if identity is None or identity is False:
            self._count(counted.BROWSER_REFUSED)
            raise socketio.exceptions.ConnectionRefusedError(REFUSED_UNAUTHORIZED)
        try:
            self.limits.connect(sid, identity)  # raises a refusal past a cap
        except socketio.exceptions.ConnectionRefusedError:
            self._close_refused(sid)
            raise
        self._browsers[sid] = identity
        return True

    def _close_refused(self, sid: str) -> None:
        task = close_refused(self.server, self.namespace, sid)
        if task is not None:
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def on_disconnect(self, sid: str, reason: Any = None) -> None:
        """Forget the connection; an internal sender's queued frames are still emitted."""
        self.limits.disconnect(sid)
        self._browsers.pop(sid, None)
        self.back_pressure.forget(sid)
        if self.catch_up is not None:
            self.catch_up.forget(sid)
        conn = self._internal.pop(sid, None)
        if conn is not None:
            conn.close()

    def _who(self, sid: str) -> str:
        return "internal sender" if sid in self._internal else "browser"

    # -- browsers -------------------------------------------------------------------------

    async def on_join_conversation(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Put a browser into the room of ``data["conversationId"]`` if the hook allows."""
        room = frames.room_of(data)
        if sid not in self._browsers:
            self._reject(sid, counted.NOT_BROWSER, JOIN_EVENT)
            return {"ok": False, "error": "only browsers join conversations"}
        if room is None:
            self._reject(sid, counted.BAD_JOIN, JOIN_EVENT)
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
            self._count(counted.JOIN_REFUSED)
            return {"ok": False, "error": "forbidden"}
        # Behind Redis with room routing, this process subscribes to the room (and reads its
        # log) before the browser enters it (the delivery's joining()).
        joining = self.delivery.joining(room) if self.delivery is not None else nullcontext()
        return await self._entry.enter(sid, room, data, joining)

    def _in_room(self, sid: str, room: str) -> bool:
        """Whether ``sid`` is in ``room`` here: a look at that room's members.
        ``self.rooms(sid)`` scans every room of the namespace (python-socketio's
        ``get_rooms``): with many conversations, every join paid for that scan."""
        members = self.server.manager.get_participants(self.namespace, room)
        return any(member == sid for member, _ in members)

    async def on_leave_conversation(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Take a browser out of a conversation's room."""
        room = frames.room_of(data)
        if sid not in self._browsers or room is None:
            self._reject(sid, counted.BAD_LEAVE, LEAVE_EVENT)
            return {"ok": False, "error": "conversationId must be a non-empty string"}
        self.limits.leave(sid, room)
        await self.leave_room(sid, room)
        return {"ok": True}

    # -- internal senders -----------------------------------------------------------------

    async def on_kx_hello(self, sid: str, data: Any = None) -> dict[str, Any]:
        """What this relay takes from an internal sender, asked once per connection:
        ``{"ok": true, "v": 1, "frames": ["rooms"], "maxFrameBlocks", "maxBlockBytes"}``
        (``"rooms"``: a frame may carry blocks of several rooms; an older relay says nothing:
        one room per frame), ``"acks": "paced"`` unless ``browser_queue_max`` is ``None``
        (:meth:`on_kx_blocks`); the ``open`` streams: :meth:`GoneWorkers.announced`."""
        if sid not in self._internal:
            self._reject(sid, counted.NOT_INTERNAL, KX_HELLO)
            return {"ok": False, "error": "forbidden"}
        self.workers.announced(self._internal[sid].worker, data, self.terminals.emitted)
        answer: dict[str, Any] = {
            "ok": True,
            "v": 1,
            "frames": [FRAME_ROOMS],
            "maxFrameBlocks": self.settings.max_frame_blocks,
            "maxBlockBytes": self.settings.max_block_bytes,
        }
        if self.settings.browser_queue_max is not None:
            answer["acks"] = ACKS_PACED
        return answer

    async def on_kx_blocks(self, sid: str, data: Any = None) -> dict[str, Any]:
        """A frame from an internal sender (one room's blocks, or several rooms' in order;
        :mod:`kernel_ext.relay.frames`): each valid block goes out unchanged as one
        ``tool_event_stream`` to its room, in frame order. Acknowledged ``{"ok": true,
        "accepted": n, "rejected": m}`` once emitted, with ``"refused"`` and
        ``"maxBlockBytes"`` when ``m > 0``; paced by the rooms' browsers with
        ``browser_queue_max`` (:meth:`BackPressure.pace
        <kernel_ext.relay.backpressure.BackPressure.pace>`). The wire in full:
        docs/contracts.md, "Relay wire". A frame's ``blocks`` lists are emptied once
        emitted: the blocks are released while the acknowledgement waits."""
        conn = self._internal.get(sid)
        if conn is None:
            self._reject(sid, counted.NOT_INTERNAL, KX_BLOCKS)
            return {"ok": False, "error": "forbidden"}
        # Everything up to the enqueue is synchronous: frames queue in arrival order even
        # when the server runs each event as its own task (async_handlers=True).
        sections = self._sections(data)
        if isinstance(sections, str):
            self._reject(sid, counted.BAD_FRAME, KX_BLOCKS)
            return {"ok": False, "error": sections}
        if sum(len(blocks) for _, blocks in sections) > self.settings.max_frame_blocks:
            self._reject(sid, counted.FRAME_TOO_LARGE, KX_BLOCKS)
            return {
                "ok": False,
                "error": f"more than {self.settings.max_frame_blocks} blocks in a frame",
            }
        valid, refused = frames.checked_sections(sections, self._check_block)
        for each in refused:
            self._reject(sid, each["reason"], "a block")
        if conn.queue.qsize() >= self.settings.max_pending_frames:
            self._reject(sid, counted.BUSY, KX_BLOCKS)
            return {"ok": False, "error": "busy"}
        self._count(counted.FRAMES)
        count_frame(counted.ACCEPTED)
        await conn.submit("blocks", "", valid)
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
        if self.settings.browser_queue_max is not None:
            await self.back_pressure.pace(rooms)
        ack: dict[str, Any] = {"ok": True, "accepted": accepted, "rejected": len(refused)}
        if refused:
            ack["refused"] = refused
            ack["maxBlockBytes"] = self.settings.max_block_bytes
        return ack

    def _sections(self, data: Any) -> frames.Sections | str:
        """A frame's (room, blocks) sections in order, or what is wrong with it
        (:func:`kernel_ext.relay.frames.sections`)."""
        return frames.sections(data, self.settings.max_frame_blocks)

    def _check_block(self, raw: Any) -> str | bytes:
        """The block's compact JSON, or why it is refused
        (:func:`kernel_ext.relay.frames.block_json`)."""
        return frames.block_json(raw, self.settings.max_block_bytes)

    async def on_kx_chat_event(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Relay the kernel's ``chat_event`` snapshot from an internal sender to the room."""
        conn = self._internal.get(sid)
        if conn is None:
            self._reject(sid, counted.NOT_INTERNAL, KX_CHAT_EVENT)
            return {"ok": False, "error": "forbidden"}
        chat_event = frames.chat_event_of(data)
        if chat_event is None:
            self._reject(sid, counted.BAD_FRAME, KX_CHAT_EVENT)
            return {"ok": False, "error": "a chat event frame is {room, event}"}
        room, event = chat_event
        await conn.submit("chat_event", room, event)
        return {"ok": True}

    # -- gone workers ---------------------------------------------------------------------

    def _connected(self, worker: str) -> bool:
        return any(conn.worker == worker for conn in self._internal.values())

    async def _emit_ended(self, room: str, raw: dict[str, Any]) -> bool:
        return await self._outbound.emit_ended(room, raw)

    async def aclose(self) -> None:
        """Stop ending gone workers' streams: cancel every grace timer and any emission of
        ``aborted`` blocks in progress (and what the delivery runs: the Redis manager's
        watch of write-only workers, its stops); send the acknowledgements that wait for the
        browsers (back-pressure) now. Call it when the server stops — python-socketio gives
        a namespace no hook for that. Idempotent."""
        await self.workers.aclose()
        await self.back_pressure.aclose()
        if self.delivery is not None:
            await self.delivery.aclose()
