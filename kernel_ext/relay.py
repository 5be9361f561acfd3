"""The web-process side: the ``/chat`` relay from internal senders to browsers' rooms.

:class:`ChatRelay` is a python-socketio ``AsyncNamespace`` to register on an existing
``AsyncServer`` (:func:`mount_relay`), or to subclass as the application's own ``/chat``
namespace (define more ``on_<event>`` handlers; call ``super()`` in ``on_connect`` and
``on_disconnect``). Wire (docs/contracts.md):

* connect ``auth``: ``{"internal": "<secret>"}`` for internal senders (compared in constant
  time; a wrong or non-string secret is refused, never treated as a browser); anything else
  is a browser, checked by the ``authenticate`` hook.
* browser → ``join_conversation`` / ``leave_conversation`` with ``{"conversationId"}``,
  acknowledged ``{"ok": true}`` or ``{"ok": false, "error"}`` (the ``authorize_join`` hook).
* internal → ``kx_blocks`` ``{"v": 1, "room", "blocks": [...]}``: each block is validated
  (:func:`kernel_ext.protocol.decode`, the size bound by the protocol's one measure) and each
  valid one goes out unchanged as one ``tool_event_stream`` event to the room, in frame
  order; acknowledged ``{"ok": true, "accepted": n, "rejected": m}`` once emitted, plus,
  when ``m > 0``, ``"refused": [{"index": i, "reason": "too_large" | "invalid"}, ...]``
  and ``"maxBlockBytes"`` (the relay's bound), so a sender can degrade a refused terminal
  and send it again.
* internal → ``kx_chat_event`` ``{"room", "event"}`` → ``chat_event`` to the room.

Guarantees:

* Only authenticated internal senders make the relay emit: anything else a browser sends
  (``tool_event_stream``, ``kx_blocks``, unknown events) reaches no one; it is dropped,
  logged (1st, 2nd, 4th … time per reason) and counted, as are invalid blocks and frames
  over the bounds.
* Hostile packets cost a count, not a crash or a log line each: a secret that is not
  valid UTF-8 (a lone surrogate) is a wrong secret; an event whose name is not a string,
  or with arguments its handler cannot take, is dropped (and answered, when it asks for
  an acknowledgement); an ``on_connect`` that fails refuses the connection (never leaves
  it half-open in python-socketio's manager). Packets python-socketio cannot decode or
  dispatch are counted, and the tracebacks the libraries log about them are let through
  on the 1st, 2nd, 4th … time of each kind only (a filter on the server's python-socketio,
  python-engineio and the ``asyncio`` loggers; every other record passes untouched).
* Order: frames of one internal connection are emitted in arrival order, one after the
  other, whatever the server's ``async_handlers`` setting (handlers queue synchronously
  into a per-connection worker).
* A terminal (callId, taskId) already emitted by this relay recently (a sender re-sending
  after a lost acknowledgement) is acknowledged but not emitted again — unless every
  browser it went to has disconnected since (this process was frozen: it emitted into
  connections that were already dead); then it goes to the room again.
* Late joiners: a terminal emitted into a room with no browser connected to this process
  (typically: the web process restarted, the worker re-sent the terminal before the
  browsers re-joined) is kept for ``hold_ttl`` seconds (at most ``hold_terminals`` of
  them) and sent to each browser that joins that room on this process meanwhile, once.
* Works with ``AsyncRedisManager`` as the server's client manager: rooms then span every
  web process on the same Redis channel. :func:`create_app`'s manager publishes a terminal
  that did not reach Redis again once Redis is back (counted ``redis_*``), so browsers on
  the other web processes get it after an outage.

Run a standalone relay with ``python -m kernel_ext.relay --port 8765 --authenticate
pkg.mod:fn --authorize-join pkg.mod:fn`` (secret from ``KERNEL_EXT_SECRET``;
``--redis-url`` for a Redis client manager); it binds 127.0.0.1 unless ``--host`` says
otherwise. Without both hooks it refuses to start unless ``--allow-anyone`` is given, and
on a host other than a loopback one even then (:func:`main`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import inspect
import ipaddress
import json
import logging
import math
import os
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

import engineio
import socketio
from socketio.async_pubsub_manager import AsyncPubSubManager

from kernel_ext import metrics
from kernel_ext._telemetry import RareLog, is_rare
from kernel_ext.errors import (
    BlockTooLargeError,
    ConfigError,
    DecodeError,
    check_positive_ints,
    check_positive_numbers,
)
from kernel_ext.protocol import (
    CHAT_EVENT,
    DEFAULT_MAX_BLOCK_BYTES,
    JOIN_EVENT,
    KX_BLOCKS,
    KX_CHAT_EVENT,
    LEAVE_EVENT,
    NAMESPACE,
    TERMINAL_STATES,
    TOOL_EVENT_STREAM,
    WORKER_HEARTBEAT,
    WORKER_ID_PATTERN,
    WORKER_TAG,
    Block,
    decode,
    terminal_envelope,
)

__all__ = [
    "CHAT_EVENT",
    "DEFAULT_WORKER_GRACE",
    "JOIN_EVENT",
    "KX_BLOCKS",
    "KX_CHAT_EVENT",
    "LEAVE_EVENT",
    "TOOL_EVENT_STREAM",
    "WORKER_GONE_MESSAGE",
    "ChatRelay",
    "RelayApp",
    "RelayRedisManager",
    "allow_all",
    "create_app",
    "main",
    "mount_relay",
]

logger = logging.getLogger(__name__)
_rare = RareLog(logger)

_ROOM_MAX = 512

DEFAULT_WORKER_GRACE = 15.0
"""Seconds a worker may be gone (disconnected, or silent on Redis) before the relay ends its
open streams: longer than the loopback emitter's longest reconnect delay (5 s)."""
WORKER_GONE_MESSAGE = "the worker stopped before the call ended"
"""``envelope.payload.message`` of the ``aborted`` block that ends a gone worker's stream."""
_WORKER_ID = re.compile(WORKER_ID_PATTERN)
_ENDED_MAX = 4_096  # streams ended on a gone worker's behalf, remembered …
_ENDED_TTL = 300.0  # … for this many seconds, to drop their late blocks

BrowserAuth = Callable[[Any, Mapping[str, Any]], Any]
"""``authenticate(auth, environ) -> identity``: ``None``/``False`` refuses the browser;
anything else is its identity, handed to ``authorize_join``. May be async; may raise
``socketio.exceptions.ConnectionRefusedError`` for a custom message."""

JoinAuth = Callable[[Any, str], Any]
"""``authorize_join(identity, conversation_id) -> bool`` (may be async)."""


def allow_all(*args: object) -> bool:
    """A hook that accepts everything (demos and tests)."""
    return True


async def _call_hook(hook: Callable[..., Any], *args: Any) -> Any:
    result = hook(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


class _Internal:
    """One internal sender's connection: its ordered emit queue and worker task, and the
    worker it belongs to (its ``worker`` auth field, else ``sid/<sid>``)."""

    __slots__ = ("queue", "task", "worker")

    def __init__(self, worker: str = "") -> None:
        self.queue: asyncio.Queue[tuple[str, str, Any, asyncio.Future[int]] | None] = (
            asyncio.Queue()
        )
        self.task: asyncio.Task[None] | None = None
        self.worker = worker


StreamKey = tuple[Any, Any]


class _Worker:
    """One worker's open streams, ``(callId, taskId) -> (room, highest seq seen)``, oldest
    first, and what tells whether it is gone: its grace timer (loopback path) or when it was
    last heard of and its heartbeat interval (Redis path)."""

    __slots__ = ("interval", "namespace", "seen", "streams", "timer")

    def __init__(self) -> None:
        self.streams: dict[StreamKey, tuple[str, int]] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.seen = time.monotonic()
        self.interval = 0.0
        self.namespace = NAMESPACE


class _OpenStreams:
    """The open streams of each worker — what browsers would wait for forever if it died.

    A stream opens on a running block with a callId (a block without one has no pane) and
    closes at its terminal, whoever sends it; it belongs to the worker that sent its latest
    running block (a restarted process that goes on with its predecessor's stream takes it
    over); a worker has a record only while it has open streams. Bounds: ``max_streams``
    per worker and ``max_workers`` records; beyond either, the oldest is forgotten (counted
    ``<prefix>worker_streams_dropped`` / ``<prefix>workers_dropped``, logged rarely).
    :meth:`end` turns a worker's open streams into ``aborted`` blocks and remembers those
    streams (at most 4,096, for 300 s), so that :meth:`note` reports their late blocks.
    Nothing here is persisted (T3).
    """

    def __init__(
        self,
        count: Callable[[str, int], None],
        prefix: str,
        max_workers: int,
        max_streams: int,
    ) -> None:
        self.workers: dict[str, _Worker] = {}
        self.owner: dict[StreamKey, str] = {}
        self.ended: dict[StreamKey, float] = {}
        self._count = count
        self._prefix = prefix
        self.max_workers = max_workers
        self.max_streams = max_streams

    @property
    def open(self) -> int:
        """Open streams tracked, all workers together."""
        return len(self.owner)

    def note(self, worker: str, raw: Mapping[str, Any], room: str) -> bool:
        """Track one block of ``worker`` about to go to ``room``; ``False`` when its stream
        was ended on a gone worker's behalf already (the caller drops or dedups it)."""
        call_id = raw.get("callId")
        if call_id is None:
            return True
        key = (call_id, raw.get("taskId"))
        if self.ended and key in self.ended:
            if self.ended[key] > time.monotonic():
                return False
            del self.ended[key]
        state = raw.get("state")
        if state == "running":
            seq = _seq_of(raw)
            if seq is None or not isinstance(call_id, str) or not isinstance(key[1], str):
                return True  # not a block this relay validated (Redis path): not tracked
            owner = self.owner.get(key)
            if owner == worker:
                streams = self.workers[worker].streams
                known = streams[key]
                if seq > known[1] or room != known[0]:
                    streams[key] = (room, max(seq, known[1]))
                return True
            if owner is not None:  # taken over from another worker (a restarted process)
                seq = max(seq, self._drop_stream(owner, key)[1])
            self._open(worker, key, room, seq)
        elif state in TERMINAL_STATES:
            owner = self.owner.get(key)
            if owner is not None:
                self._drop_stream(owner, key)
        return True

    def _open(self, worker: str, key: StreamKey, room: str, seq: int) -> None:
        record = self.workers.get(worker)
        if record is None:
            if len(self.workers) >= self.max_workers:
                oldest = next(iter(self.workers))
                self.forget(oldest)
                self._count(self._prefix + "workers_dropped", 1)
                _rare(
                    "workers_dropped",
                    "relay: more than %d workers with open streams; forgot the oldest (%s)",
                    self.max_workers,
                    oldest,
                )
            record = self.workers[worker] = _Worker()
        streams = record.streams
        if len(streams) >= self.max_streams:
            first = next(iter(streams))
            del streams[first]
            del self.owner[first]
            self._count(self._prefix + "worker_streams_dropped", 1)
            _rare(
                "worker_streams_dropped",
                "relay: more than %d open streams for worker %s; forgot the oldest",
                self.max_streams,
                worker,
            )
        streams[key] = (room, seq)
        self.owner[key] = worker

    def _drop_stream(self, worker: str, key: StreamKey) -> tuple[str, int]:
        """Close ``key`` in ``worker``'s record (dropping an emptied record); its entry."""
        del self.owner[key]
        record = self.workers[worker]
        entry = record.streams.pop(key)
        if not record.streams:
            self.forget(worker)
        return entry

    def forget(self, worker: str) -> _Worker | None:
        """Drop ``worker``'s record (its timer cancelled); return it."""
        record = self.workers.pop(worker, None)
        if record is not None:
            for key in record.streams:
                del self.owner[key]
            if record.timer is not None:
                record.timer.cancel()
                record.timer = None
        return record

    def end(self, worker: str) -> list[tuple[str, dict[str, Any]]]:
        """Forget ``worker`` and return ``(room, aborted block)`` for each of its open
        streams (a valid block per :mod:`kernel_ext.protocol`: ``seq`` one above the
        highest seen, ``ts`` now); the streams are remembered as ended."""
        record = self.forget(worker)
        if record is None:
            return []
        now = time.monotonic()
        while self.ended:
            first = next(iter(self.ended))
            if self.ended[first] > now:
                break
            del self.ended[first]
        ts = int(time.time() * 1000)
        ended = []
        for (call_id, task_id), (room, seq) in record.streams.items():
            try:
                block = Block(
                    v=1,
                    call_id=call_id,
                    task_id=task_id,
                    state="aborted",
                    ts=ts,
                    envelope=terminal_envelope("aborted", task_id, seq + 1, WORKER_GONE_MESSAGE),
                )
            except Exception:  # an unvalidated id (Redis path): no valid block can end it
                _rare("worker_abort_invalid", "relay: cannot end stream %r", (call_id, task_id))
                continue
            ended.append((room, block.model_dump(by_alias=True, mode="json")))
            self.ended.pop((call_id, task_id), None)
            self.ended[(call_id, task_id)] = now + _ENDED_TTL
        while len(self.ended) > _ENDED_MAX:
            del self.ended[next(iter(self.ended))]
        return ended


def _seq_of(raw: Mapping[str, Any]) -> int | None:
    envelope = raw.get("envelope")
    seq = envelope.get("seq") if isinstance(envelope, Mapping) else None
    if isinstance(seq, bool):
        return None
    if isinstance(seq, int):
        return seq
    if isinstance(seq, float) and seq.is_integer():
        return int(seq)
    return None


class ChatRelay(socketio.AsyncNamespace):  # type: ignore[misc]
    """The ``/chat`` relay namespace (module docstring for the wire and the guarantees).

    Args:
        secret: the shared secret of internal senders (non-empty).
        namespace: the namespace (default ``/chat``).
        authenticate: browser auth hook (default: accept every browser).
        authorize_join: room authorization hook (default: allow every join, logged once
            as a warning — pass a real hook in production).
        max_block_bytes: the size bound of one block (encoded JSON).
        max_frame_blocks: blocks per ``kx_blocks`` frame.
        max_pending_frames: frames queued per internal connection before ``busy``.
        dedup_terminals: terminals remembered to suppress re-sends (0 disables).
        dedup_ttl: seconds a terminal is remembered.
        hold_terminals: terminals kept for late joiners of empty rooms (0 disables).
        hold_ttl: seconds such a terminal is kept.
        worker_grace: seconds a worker may stay disconnected before the relay ends its open
            streams with ``aborted`` (``None`` disables; see "Gone workers" below).
        max_workers: workers with open streams tracked at once.
        max_worker_streams: open streams tracked per worker.

    Gone workers: the relay tracks which streams each worker (the connect auth's ``worker``
    id, else the connection's sid) has open — opened by a running block it emitted (a
    stream belongs to the worker that sent its latest running block: a restarted process
    may take its predecessor's streams over), closed by the stream's terminal, whoever
    sends it. When the last connection of a worker with open streams is gone and no
    connection of that worker comes back within ``worker_grace`` seconds, the relay emits
    one ``aborted`` block (``WORKER_GONE_MESSAGE``) to the room of each of them, counted
    ``worker_aborted`` and logged once per worker at WARNING; a worker that comes back in
    time cancels that (``workers_resumed``) and ends its streams itself.
    Such a terminal is remembered like any other (a late re-send of the stream's terminal
    is not emitted again) and later running blocks of those streams are dropped
    (``after_worker_aborted``). Call :meth:`aclose` when the server stops.

    Raises:
        ConfigError: an empty secret or a bad bound.
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
    ) -> None:
        if not isinstance(secret, str) or not secret:
            raise ConfigError("secret must be a non-empty string")
        check_positive_ints(
            max_block_bytes=max_block_bytes,
            max_frame_blocks=max_frame_blocks,
            max_pending_frames=max_pending_frames,
            max_workers=max_workers,
            max_worker_streams=max_worker_streams,
        )
        if worker_grace is not None:
            check_positive_numbers(worker_grace=worker_grace)
        super().__init__(namespace)
        self._secret = secret.encode("utf-8")
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
        self._internal: dict[str, _Internal] = {}
        self._browsers: dict[str, Any] = {}
        # (callId, taskId) -> (forget-after, the sids it was emitted to), oldest first.
        self._terminals: dict[tuple[Any, Any], tuple[float, tuple[str, ...]]] = {}
        self.hold_terminals = hold_terminals
        self.hold_ttl = hold_ttl
        # (forget-after, room, block, sids served), oldest first.
        self._held: list[tuple[float, str, Any, set[str]]] = []
        self._counts: dict[str, int] = {}
        self.worker_grace = None if worker_grace is None else float(worker_grace)
        self._streams = (
            None
            if worker_grace is None
            else _OpenStreams(self._count, "", max_workers, max_worker_streams)
        )
        self._ending: set[asyncio.Task[None]] = set()
        self._closed = False
        self._arities: dict[str, tuple[int, float]] = {}
        self._packet_log = RareLog(logger)

    def _set_server(self, server: Any) -> None:
        # python-socketio calls this from register_namespace, however the relay is mounted.
        super()._set_server(server)
        _watch_library_logs(self, server)

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counts by outcome since start (``frames``, ``blocks_emitted``, ``rejected_*`` …,
        ``redis_*`` with :func:`create_app`'s Redis manager) and the current
        ``internal``/``browsers`` connections. ``rejected_bad_packet`` counts packets of this
        server that python-socketio could not decode or dispatch (logged by the library),
        ``suppressed_log_records`` those of its log records the relay held back."""
        counts = dict(self._counts)
        counts.update(getattr(getattr(self.server, "manager", None), "counts", None) or {})
        counts["internal"] = len(self._internal)
        counts["browsers"] = len(self._browsers)
        if self._streams is not None:
            counts["workers_tracked"] = len(self._streams.workers)
            counts["workers_in_grace"] = sum(
                1 for record in self._streams.workers.values() if record.timer is not None
            )
            counts["worker_streams"] = self._streams.open
        manager = getattr(self.server, "manager", None)
        if isinstance(manager, RelayRedisManager):
            counts.update(manager.worker_sizes())
        return counts

    def _count(self, outcome: str, n: int = 1) -> None:
        self._counts[outcome] = self._counts.get(outcome, 0) + n

    def _reject(self, sid: str, reason: str, what: str, *, exc_info: bool = False) -> None:
        self._count("rejected_" + reason)
        with contextlib.suppress(Exception):
            metrics.relay_frames.add(1, {"outcome": reason})
        level = logging.ERROR if exc_info else logging.WARNING
        _rare(
            "relay_" + reason,
            "relay: dropped %s from %s (%s)",
            what,
            sid,
            reason,
            level=level,
            exc_info=exc_info,
        )

    def _library_record(self, record: logging.LogRecord) -> bool:
        """Count a library's log record about a malformed packet (``rejected_bad_packet``)
        and say whether to keep it: the 1st, 2nd, 4th … of each kind (exception type), the
        first with its traceback, the later ones in one line; the rest are dropped
        (``suppressed_log_records``)."""
        error = record.exc_info[1] if record.exc_info else None
        kind = type(error).__name__
        self._count("rejected_bad_packet")
        with contextlib.suppress(Exception):
            metrics.relay_frames.add(1, {"outcome": "bad_packet"})
        seen = self._packet_log.note(kind)
        if not is_rare(seen):
            self._count("suppressed_log_records")
            return False
        detail = str(error)[:200]
        note = f"a malformed packet from a client: {kind}: {detail}; seen {seen} times"
        if seen == 1:
            note += "; logged again on the 2nd, 4th, 8th … time, without the traceback"
        else:
            record.exc_info = None
            record.exc_text = None
        record.msg = f"{record.getMessage()} [{note}]"
        record.args = ()
        return True

    # -- connections ----------------------------------------------------------------------

    async def on_connect(self, sid: str, environ: Mapping[str, Any], auth: Any = None) -> bool:
        """Internal sender (shared secret) or browser (hook); refuse everything else."""
        if isinstance(auth, Mapping) and "internal" in auth:
            given = auth.get("internal")
            if not self._secret_matches(given):
                self._reject(sid, "bad_secret", "an internal connection")
                raise socketio.exceptions.ConnectionRefusedError("unauthorized")
            worker = self._worker_of(sid, auth)
            if worker is None:
                self._reject(sid, "bad_worker", "an internal connection")
                raise socketio.exceptions.ConnectionRefusedError("bad worker id")
            conn = _Internal(worker)
            conn.task = asyncio.get_running_loop().create_task(self._worker(sid, conn))
            self._internal[sid] = conn
            self._count("internal_connects")
            self._worker_back(worker)
            return True
        identity: Any = True
        if self._authenticate is not None:
            try:
                identity = await _call_hook(self._authenticate, auth, environ)
            except socketio.exceptions.ConnectionRefusedError:
                self._count("browser_refused")
                raise
            except Exception:
                logger.exception("relay: browser authentication hook failed")
                identity = None
        if identity is None or identity is False:
            self._count("browser_refused")
            raise socketio.exceptions.ConnectionRefusedError("unauthorized")
        self._browsers[sid] = identity
        return True

    async def on_disconnect(self, sid: str, reason: Any = None) -> None:
        """Forget the connection; an internal sender's queued frames are still emitted."""
        self._browsers.pop(sid, None)
        conn = self._internal.pop(sid, None)
        if conn is not None:
            conn.queue.put_nowait(None)

    def _secret_matches(self, given: Any) -> bool:
        """Whether ``given`` is the internal secret, compared in constant time as bytes; any
        string (lone surrogates too) is compared, anything else does not match."""
        if not isinstance(given, str):
            return False
        return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), self._secret)

    async def trigger_event(self, event: str, *args: Any) -> Any:
        """Dispatch; an event with no handler is dropped, logged and counted, and so is a
        ``connect`` or ``disconnect`` that a client sent as an ordinary event, an event whose
        name is not a string (``bad_event_name``) and one with more or fewer arguments than
        its handler takes (``bad_arguments``). A connection whose ``on_connect`` raises
        anything but a refusal is refused (``rejected_connect_error``, logged rarely)."""
        sid = args[0] if args else "?"
        if not isinstance(event, str):  # a client may name an event 5, true or {"a": 1}
            self._reject(
                sid, "bad_event_name", f"an event with a non-string name ({type(event).__name__})"
            )
            return None
        if event in ("connect", "disconnect"):
            forged = self._sent_by_client(event, args)
        else:
            forged = not hasattr(self, "on_" + event)
        if forged:
            who = "internal sender" if sid in self._internal else "browser"
            self._reject(sid, "unknown_event", f"event {event[:64]!r} from a {who}")
            return None
        if event == "connect":
            return await self._connect(args)
        if event != "disconnect" and not self._takes(event, len(args)):
            self._reject(sid, "bad_arguments", f"event {event!r} with {len(args) - 1} arguments")
            return None
        return await super().trigger_event(event, *args)

    async def _connect(self, args: tuple[Any, ...]) -> Any:
        """The server's own ``connect``. python-socketio handles only refusals: any other
        exception would be logged with its traceback and leave the connection half-open in
        its manager for good, so it refuses the connection instead."""
        try:
            return await super().trigger_event("connect", *args)
        except (socketio.exceptions.ConnectionRefusedError, ConnectionRefusedError):
            raise
        except Exception as exc:
            if isinstance(exc, TypeError) and not self._takes("connect", len(args)):
                raise  # python-socketio retries a legacy on_connect(sid, environ)
            sid = args[0] if args else "?"
            self._reject(sid, "connect_error", "a connection (on_connect failed)", exc_info=True)
            raise socketio.exceptions.ConnectionRefusedError("unauthorized") from None

    def _takes(self, event: str, count: int) -> bool:
        """Whether the handler of ``event`` takes ``count`` positional arguments."""
        bounds = self._arities.get(event)
        if bounds is None:  # one entry per handler name: hasattr was checked
            bounds = self._arities[event] = _positional_bounds(getattr(self, "on_" + event))
        return bounds[0] <= count <= bounds[1]

    def _sent_by_client(self, event: str, args: tuple[Any, ...]) -> bool:
        """Whether a ``connect``/``disconnect`` came from a connected client as an ordinary
        event (python-socketio dispatches those to the same handlers as its own): the
        server's own disconnect runs once the client is no longer connected, its own
        connect with the connection's WSGI/ASGI environ."""
        if not args:
            return True
        sid, server = args[0], self.server
        if event == "disconnect":
            return bool(server.manager.is_connected(sid, self.namespace))
        eio_sid = server.manager.eio_sid_from_sid(sid, self.namespace)
        return len(args) < 2 or args[1] is not server.environ.get(eio_sid)

    # -- browsers -------------------------------------------------------------------------

    async def on_join_conversation(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Put a browser into the room of ``data["conversationId"]`` if the hook allows."""
        room = self._room_of(data)
        if sid not in self._browsers:
            self._reject(sid, "not_browser", JOIN_EVENT)
            return {"ok": False, "error": "only browsers join conversations"}
        if room is None:
            self._reject(sid, "bad_join", JOIN_EVENT)
            return {"ok": False, "error": "conversationId must be a non-empty string"}
        try:
            allowed = await _call_hook(self._authorize_join, self._browsers[sid], room)
        except Exception:
            logger.exception("relay: authorize_join hook failed")
            allowed = False
        if not allowed:
            self._count("join_refused")
            return {"ok": False, "error": "forbidden"}
        await self.enter_room(sid, room)
        self._count("joins")
        late = self._late_terminals(sid, room)
        for raw in late:
            await self.emit(TOOL_EVENT_STREAM, raw, to=sid)
        if late:
            self._count("late_terminals", len(late))
        return {"ok": True}

    async def on_leave_conversation(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Take a browser out of a conversation's room."""
        room = self._room_of(data)
        if sid not in self._browsers or room is None:
            self._reject(sid, "bad_leave", LEAVE_EVENT)
            return {"ok": False, "error": "conversationId must be a non-empty string"}
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

    # -- internal senders -----------------------------------------------------------------

    async def on_kx_blocks(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Validate a frame of blocks from an internal sender and emit the valid ones."""
        conn = self._internal.get(sid)
        if conn is None:
            self._reject(sid, "not_internal", KX_BLOCKS)
            return {"ok": False, "error": "forbidden"}
        # Everything up to the enqueue is synchronous: frames queue in arrival order even
        # when the server runs each event as its own task (async_handlers=True).
        if not isinstance(data, Mapping) or data.get("v") != 1:
            self._reject(sid, "bad_frame", KX_BLOCKS)
            return {"ok": False, "error": "a frame is {v: 1, room, blocks}"}
        room = data.get("room")
        blocks = data.get("blocks")
        if not isinstance(room, str) or not room or len(room) > _ROOM_MAX:
            self._reject(sid, "bad_frame", KX_BLOCKS)
            return {"ok": False, "error": "room must be a non-empty string"}
        if not isinstance(blocks, list):
            self._reject(sid, "bad_frame", KX_BLOCKS)
            return {"ok": False, "error": "blocks must be a list"}
        if len(blocks) > self.max_frame_blocks:
            self._reject(sid, "frame_too_large", KX_BLOCKS)
            return {"ok": False, "error": f"more than {self.max_frame_blocks} blocks in a frame"}
        valid: list[Any] = []
        refused: list[dict[str, Any]] = []
        for index, raw in enumerate(blocks):
            problem = self._check_block(raw)
            if problem is None:
                valid.append(raw)
            else:
                refused.append({"index": index, "reason": problem})
                self._reject(sid, problem, "a block")
        if conn.queue.qsize() >= self.max_pending_frames:
            self._reject(sid, "busy", KX_BLOCKS)
            return {"ok": False, "error": "busy"}
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        conn.queue.put_nowait(("blocks", room, valid, done))
        self._count("frames")
        with contextlib.suppress(Exception):
            metrics.relay_frames.add(1, {"outcome": "accepted"})
        await done
        ack: dict[str, Any] = {"ok": True, "accepted": len(valid), "rejected": len(refused)}
        if refused:
            ack["refused"] = refused
            ack["maxBlockBytes"] = self.max_block_bytes
        return ack

    async def on_kx_chat_event(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Relay the kernel's ``chat_event`` snapshot from an internal sender to the room."""
        conn = self._internal.get(sid)
        if conn is None:
            self._reject(sid, "not_internal", KX_CHAT_EVENT)
            return {"ok": False, "error": "forbidden"}
        room = data.get("room") if isinstance(data, Mapping) else None
        event = data.get("event") if isinstance(data, Mapping) else None
        if not isinstance(room, str) or not room or not isinstance(event, Mapping):
            self._reject(sid, "bad_frame", KX_CHAT_EVENT)
            return {"ok": False, "error": "a chat event frame is {room, event}"}
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        conn.queue.put_nowait(("chat_event", room, dict(event), done))
        await done
        return {"ok": True}

    def _check_block(self, raw: Any) -> str | None:
        """``None`` when ``raw`` is a valid block within the size bound (the protocol's one
        measure, :func:`kernel_ext.protocol.block_size`), else the reason."""
        if not isinstance(raw, Mapping):
            return "invalid"
        try:
            decode(raw, max_bytes=self.max_block_bytes)
        except BlockTooLargeError:
            return "too_large"
        except (DecodeError, TypeError, ValueError, RecursionError):
            return "invalid"
        return None

    def _seen_terminal(self, raw: Mapping[str, Any], room: str) -> bool:
        """Remember a terminal emitted to ``room``'s browsers now; ``True`` when it was
        emitted recently already to a browser that is still connected, or to none (it is
        held for joiners then)."""
        if self.dedup_terminals <= 0:
            return False
        now = time.monotonic()
        key = (raw.get("callId"), raw.get("taskId"))
        seen = self._terminals.get(key)
        if seen is not None and seen[0] > now:
            went_to = seen[1]
            if not went_to or any(sid in self._browsers for sid in went_to):
                return True
            self._count("terminal_reemitted")  # every connection it went to was dead
        participants = self.server.manager.get_participants(self.namespace, room)
        self._terminals.pop(key, None)
        self._terminals[key] = (now + self.dedup_ttl, tuple(sid for sid, _ in participants))
        while len(self._terminals) > self.dedup_terminals:
            del self._terminals[next(iter(self._terminals))]
        while self._terminals:
            first = next(iter(self._terminals))
            if self._terminals[first][0] > now:
                break
            del self._terminals[first]
        return False

    def _late_terminals(self, sid: str, room: str) -> list[Any]:
        """Held terminals of ``room`` that ``sid`` has not been sent yet (marks them)."""
        self._expire_held()
        late = []
        for _, held_room, raw, served in self._held:
            if held_room == room and sid not in served:
                served.add(sid)
                late.append(raw)
        return late

    def _hold_if_nobody_listens(self, room: str, raw: Any) -> None:
        if self.hold_terminals <= 0:
            return
        participants = self.server.manager.get_participants(self.namespace, room)
        if next(iter(participants), None) is not None:
            return
        self._expire_held()
        self._held.append((time.monotonic() + self.hold_ttl, room, raw, set()))
        del self._held[: max(0, len(self._held) - self.hold_terminals)]
        self._count("held_terminals")

    def _expire_held(self) -> None:
        now = time.monotonic()
        expired = 0
        for forget, *_ in self._held:
            if forget > now:
                break
            expired += 1
        if expired:
            del self._held[:expired]

    async def _emit_in_order(self, blocks: list[Any], room: str) -> None:
        """One ``tool_event_stream`` per block, in order.

        With the in-process client manager every emit is queued to each participant's
        connection synchronously when its task first runs, and asyncio runs new tasks in
        creation order: the emits of a frame overlap and keep their order. A pub/sub manager
        (Redis) publishes after an await, so there they go one after the other.
        """
        if len(blocks) > 1 and not isinstance(self.server.manager, AsyncPubSubManager):
            loop = asyncio.get_running_loop()
            tasks = [
                loop.create_task(self.emit(TOOL_EVENT_STREAM, raw, room=room)) for raw in blocks
            ]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return
        for raw in blocks:
            await self.emit(TOOL_EVENT_STREAM, raw, room=room)

    async def _worker(self, sid: str, conn: _Internal) -> None:
        """Emit one connection's frames in arrival order, one after the other."""
        while True:
            job = await conn.queue.get()
            if job is None:
                self._worker_left(conn.worker)
                return
            kind, room, payload, done = job
            emitted = 0
            try:
                if kind == "blocks":
                    blocks = []
                    for raw in payload:
                        if not self._track(conn, raw, room):
                            continue
                        if raw.get("state") in ("done", "aborted"):
                            if self._seen_terminal(raw, room):
                                self._count("duplicate_terminal")
                                continue
                            self._hold_if_nobody_listens(room, raw)
                        blocks.append(raw)
                    await self._emit_in_order(blocks, room)
                    emitted = len(blocks)
                    self._count("blocks_emitted", emitted)
                else:
                    await self.emit(CHAT_EVENT, payload, room=room)
                    self._count("chat_events")
            except asyncio.CancelledError:
                if not done.done():
                    done.cancel()
                raise
            except Exception:
                _rare("emit_failed", "relay: emitting to room %r failed", room, exc_info=True)
            if not done.done():
                done.set_result(emitted)

    # -- gone workers ---------------------------------------------------------------------

    @staticmethod
    def _worker_of(sid: str, auth: Mapping[str, Any]) -> str | None:
        """The worker an internal connection belongs to: its ``worker`` auth field (a
        string matching ``protocol.WORKER_ID_PATTERN``), ``sid/<sid>`` without one (never
        resumed: sids change on reconnect), ``None`` for anything else."""
        given = auth.get("worker")
        if given is None:
            return "sid/" + sid
        if isinstance(given, str) and _WORKER_ID.fullmatch(given) is not None:
            return given
        return None

    def _track(self, conn: _Internal, raw: Any, room: str) -> bool:
        """Note a block about to be emitted; ``False``: drop it (a running block of a stream
        this relay ended because its worker was gone)."""
        if self._streams is None or self._streams.note(conn.worker, raw, room):
            return True
        if raw.get("state") != "running":
            return True  # a terminal: the terminal dedup decides
        self._count("after_worker_aborted")
        _rare(
            "after_worker_aborted",
            "relay: dropped a running block of (%s, %s), ended when its worker was gone",
            raw.get("callId"),
            raw.get("taskId"),
        )
        return False

    def _worker_back(self, worker: str) -> None:
        """A connection of ``worker`` arrived: its grace timer, if any, is cancelled."""
        record = self._streams.workers.get(worker) if self._streams is not None else None
        if record is not None and record.timer is not None:
            record.timer.cancel()
            record.timer = None
            self._count("workers_resumed")
            logger.info("relay: worker %s is back within the grace period", worker)

    def _worker_left(self, worker: str) -> None:
        """A connection of ``worker`` is gone and its frames are emitted: if it was the
        worker's last one and it has open streams, its grace timer starts."""
        streams = self._streams
        record = streams.workers.get(worker) if streams is not None else None
        if record is None or record.timer is not None or self._closed:
            return
        if any(conn.worker == worker for conn in self._internal.values()):
            return
        assert self.worker_grace is not None
        record.seen = time.monotonic()
        loop = asyncio.get_running_loop()
        record.timer = loop.call_later(self.worker_grace, self._worker_gone, worker)

    def _worker_gone(self, worker: str) -> None:
        """The grace timer of ``worker`` fired: end its open streams."""
        streams = self._streams
        record = streams.workers.get(worker) if streams is not None else None
        if streams is None or record is None:
            return
        record.timer = None
        if self._closed or any(conn.worker == worker for conn in self._internal.values()):
            return
        gone_for = time.monotonic() - record.seen
        ended = streams.end(worker)
        task = asyncio.get_running_loop().create_task(self._end_streams(worker, ended, gone_for))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def _end_streams(
        self, worker: str, ended: list[tuple[str, dict[str, Any]]], gone_for: float
    ) -> None:
        emitted = 0
        for room, raw in ended:
            if self._seen_terminal(raw, room):
                continue  # its terminal went out already (another connection re-sent it)
            self._hold_if_nobody_listens(room, raw)
            try:
                await self.emit(TOOL_EVENT_STREAM, raw, room=room)
            except asyncio.CancelledError:
                raise
            except Exception:
                _rare("emit_failed", "relay: emitting to room %r failed", room, exc_info=True)
                continue
            emitted += 1
        self._count("workers_gone")
        self._count("worker_aborted", emitted)
        logger.warning(
            "relay: worker %s gone for %.1f s; ended its %d open stream(s) with aborted",
            worker,
            gone_for,
            emitted,
        )

    async def aclose(self) -> None:
        """Stop ending gone workers' streams: cancel every grace timer and any emission of
        ``aborted`` blocks in progress (and the watch of :class:`RelayRedisManager`, if it
        is the server's manager). Call it when the server stops — python-socketio gives a
        namespace no hook for that. Idempotent."""
        self._closed = True
        if self._streams is not None:
            for record in self._streams.workers.values():
                if record.timer is not None:
                    record.timer.cancel()
                    record.timer = None
        tasks = list(self._ending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        manager = getattr(self.server, "manager", None)
        if isinstance(manager, RelayRedisManager):
            await manager.stop_watching()


def _positional_bounds(handler: Any) -> tuple[int, float]:
    """How many positional arguments ``handler`` takes, at least and at most."""
    try:
        parameters = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return 0, math.inf
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in parameters if p.kind in kinds]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return required, math.inf
    return required, len(positional)


# -- the libraries' log records of malformed packets --------------------------------------
#
# For a packet it cannot decode or dispatch (``42/chat,[]``, ``{}``, not JSON, nested past
# the recursion limit, an unknown packet type) python-socketio raises, and python-engineio
# logs the exception with its traceback at ERROR, once per packet, on the server's
# engineio logger ("message async handler error"; "Unknown receive error" for its own
# packet types). asyncio logs the same when python-socketio's event task fails on an
# unhashable event name (only when the server has decorator handlers for the namespace:
# the relay drops non-string names itself). One filter on those loggers hands exactly these
# records to the relay of their server; every other record passes untouched.

_LIBRARY_MESSAGES = frozenset({"message async handler error", "Unknown receive error"})
_TASK_MESSAGE = "Task exception was never retrieved"
_SOCKETIO_DIR = os.path.dirname(socketio.__file__)
_ENGINEIO_DIR = os.path.dirname(engineio.__file__)
_JSON_DIR = os.path.dirname(json.__file__)
_LIBRARY_DIRS = tuple(d + os.sep for d in (_SOCKETIO_DIR, _ENGINEIO_DIR, _JSON_DIR))
# Where a malformed packet makes the libraries raise: (directory, file) -> functions, or
# None for any function of the file.
_DECODE_SITES: dict[tuple[str, str], frozenset[str] | None] = {
    (_SOCKETIO_DIR, "packet.py"): None,
    (_SOCKETIO_DIR, "msgpack_packet.py"): None,
    (_SOCKETIO_DIR, "async_server.py"): frozenset({"_handle_eio_message", "_handle_event"}),
    (_SOCKETIO_DIR, "base_server.py"): frozenset({"_get_event_handler"}),
    (_ENGINEIO_DIR, "async_socket.py"): frozenset({"receive"}),
    (_JSON_DIR, "decoder.py"): None,
    (_JSON_DIR, "__init__.py"): None,
}
# A library server (python-socketio's or its python-engineio server) -> its relay.
_RELAY_OF: weakref.WeakKeyDictionary[Any, weakref.ref[ChatRelay]] = weakref.WeakKeyDictionary()


class _MalformedPacketFilter(logging.Filter):
    """Hands a library record about a malformed packet to its server's relay (which keeps
    the 1st, 2nd, 4th … of each kind); every other record passes untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        relay = _relay_of_record(record)
        return True if relay is None else relay._library_record(record)


_PACKET_FILTER = _MalformedPacketFilter()


def _watch_library_logs(relay: ChatRelay, server: Any) -> None:
    """Route ``server``'s records about malformed packets to ``relay`` (the first relay
    registered on a server keeps them). The one filter goes once onto each logger."""
    eio = getattr(server, "eio", None)
    for owner in (server, eio):
        with contextlib.suppress(TypeError):  # not weak-referenceable: nothing to route
            known = _RELAY_OF.get(owner)
            if known is None or known() is None:
                _RELAY_OF[owner] = weakref.ref(relay)
    for log in (getattr(server, "logger", None), getattr(eio, "logger", None)):
        if isinstance(log, logging.LoggerAdapter):
            log = log.logger
        if isinstance(log, logging.Logger):
            log.addFilter(_PACKET_FILTER)  # a no-op when it is there already
    logging.getLogger("asyncio").addFilter(_PACKET_FILTER)


def _relay_of_record(record: logging.LogRecord) -> ChatRelay | None:
    """The relay whose server logged ``record`` about a malformed packet, else ``None``."""
    message = record.msg
    if not record.exc_info or not isinstance(message, str):
        return None
    if message not in _LIBRARY_MESSAGES and not message.startswith(_TASK_MESSAGE):
        return None
    frames: list[FrameType] = []
    tb = record.exc_info[2]
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if not frames or not all(f.f_code.co_filename.startswith(_LIBRARY_DIRS) for f in frames):
        return None  # an application's or the relay's own code raised: a real error
    code = frames[-1].f_code
    site = (os.path.dirname(code.co_filename), os.path.basename(code.co_filename))
    if site not in _DECODE_SITES:
        return None
    functions = _DECODE_SITES[site]
    if functions is not None and code.co_name not in functions:
        return None
    for frame in frames:
        owner = frame.f_locals.get("self")
        for candidate in (owner, getattr(owner, "server", None)):
            try:
                ref = _RELAY_OF.get(candidate)
            except TypeError:
                continue
            relay = ref() if ref is not None else None
            if relay is not None:
                return relay
    return None


class RelayRedisManager(socketio.AsyncRedisManager):  # type: ignore[misc]
    """python-socketio's Redis client manager, except that a terminal block whose publish
    to the other web processes failed (Redis down; python-socketio publishes once and only
    logs) is published again once Redis is back and as many web processes listen as did
    before (or ``settle`` seconds after Redis answered again), for at most ``retry_for``
    seconds, at most ``max_pending`` at once. Counts ``redis_publish_failed``,
    ``redis_republished`` and ``redis_given_up`` in :attr:`counts`.

    Gone workers on the write-only path (:class:`~kernel_ext.emit.RedisEmitter`, no relay
    connection): such a worker tags each emit it publishes with its worker id (key
    ``kx_worker``) and publishes a heartbeat (``{"method": "kx_worker_heartbeat", "worker",
    "interval", "host_id"}``) every few seconds; python-socketio ignores both (an unknown
    key, an unknown method). From the tagged ``tool_event_stream`` emits this manager
    tracks each worker's open streams (bounded like :class:`ChatRelay`'s); when a worker
    with open streams was last heard of (heartbeat or block) more than
    ``max(worker_grace, 3 × its heartbeat interval)`` seconds ago, it emits one
    ``aborted`` block per open stream to the browsers of **this** web process only (every
    web process does the same for its own: one terminal per browser), counted
    ``redis_worker_aborted``, and drops later blocks of those streams
    (``redis_after_worker_aborted``). While it watches, it publishes the same heartbeat
    without a worker every second (every ``worker_grace / 4`` seconds if shorter) and
    judges a worker gone only at a time it heard the channel (its own heartbeats come
    back); after hearing nothing for longer than two such steps (Redis was down for it),
    every worker's grace starts again (``redis_watch_resumed``). ``worker_grace=None``
    disables all of this. Call :meth:`stop_watching`
    when the server stops (:meth:`ChatRelay.aclose` does).
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
    ) -> None:
        check_positive_ints(max_workers=max_workers, max_worker_streams=max_worker_streams)
        if worker_grace is not None:
            check_positive_numbers(worker_grace=worker_grace)
        super().__init__(url, channel=channel)
        self.counts: dict[str, int] = {}
        self.worker_grace = None if worker_grace is None else float(worker_grace)
        self._workers = (
            None
            if worker_grace is None
            else _OpenStreams(self._bump, "redis_", max_workers, max_worker_streams)
        )
        self._watching: asyncio.Task[None] | None = None
        self._heard = 0.0
        # The watch checks the channel every step; a process that heard nothing for longer
        # than _deaf_after restarts every worker's grace when it hears again.
        self._watch_step = min(1.0, (worker_grace or 4.0) / 4)
        self._deaf_after = 2 * self._watch_step + 0.5
        self._listeners = 0
        self._pending: list[tuple[float, Any]] = []
        self._max_pending = max_pending
        self._retry_for = retry_for
        self._settle = settle
        self._retrying: asyncio.Task[None] | None = None

    def _bump(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    async def _publish(self, data: Any) -> Any:
        result = await super()._publish(data)
        if isinstance(result, int):
            if not self._pending:
                self._listeners = result
        elif _is_terminal_emit(data):
            self._bump("redis_publish_failed")
            _rare("redis_down", "relay: a terminal did not reach Redis; retrying", level=40)
            self._pending.append((time.monotonic() + self._retry_for, data))
            if len(self._pending) > self._max_pending:
                del self._pending[0]
                self._bump("redis_given_up")
            if self._retrying is None or self._retrying.done():
                self._retrying = asyncio.get_running_loop().create_task(self._retry())
        return result

    async def _retry(self) -> None:
        delay, back_since = 0.25, None
        while self._pending:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            try:
                listening = (await self.redis.pubsub_numsub(self.channel))[0][1]
            except Exception:
                back_since = None
                continue
            now = time.monotonic()
            back_since = back_since or now
            if listening < self._listeners and now - back_since < self._settle:
                continue
            pending, self._pending = self._pending, []
            for i, (deadline, data) in enumerate(pending):
                if deadline < now:
                    self._bump("redis_given_up")
                    continue
                if not isinstance(await super()._publish(data), int):
                    self._pending = pending[i:] + self._pending
                    break
                self._bump("redis_republished")

    # -- gone workers on the write-only path ----------------------------------------------

    def worker_sizes(self) -> dict[str, int]:
        """What the gone-worker watch holds now: ``redis_workers_tracked`` (workers with
        open streams) and ``redis_worker_streams`` (their open streams)."""
        if self._workers is None:
            return {}
        return {
            "redis_workers_tracked": len(self._workers.workers),
            "redis_worker_streams": self._workers.open,
        }

    async def _handle_emit(self, message: Any) -> None:
        workers = self._workers
        worker = message.get(WORKER_TAG) if workers is not None else None
        if worker is not None and not self._note_worker_emit(worker, message):
            self._bump("redis_after_worker_aborted")
            _rare(
                "redis_after_worker_aborted",
                "relay: dropped a block of a stream ended when its worker was gone",
            )
            return
        await super()._handle_emit(message)

    def _note_worker_emit(self, worker: Any, message: Mapping[str, Any]) -> bool:
        """Track a tagged emit; ``False`` when it belongs to a stream ended already."""
        workers = self._workers
        data = message.get("data")
        room = message.get("room")
        if (
            workers is None
            or not isinstance(worker, str)
            or _WORKER_ID.fullmatch(worker) is None
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
        """python-socketio's listener, less the heartbeats (handled here)."""
        async for message in super()._listen():
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
            for silent in workers.workers.values():
                silent.seen = max(silent.seen, now)
            self._bump("redis_watch_resumed")
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
        assert self.worker_grace is not None
        grace = self.worker_grace
        probe = json.dumps({"method": WORKER_HEARTBEAT, "worker": None, "host_id": self.host_id})
        while workers.workers:
            try:
                if self.redis is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            self.redis.publish(self.channel, probe), self._watch_step
                        )
                await asyncio.sleep(self._watch_step)
                # Judged at the last time this process heard the channel (its own checks
                # come back every step while Redis works): a worker is gone only if it was
                # overdue while this process could hear it.
                heard = self._heard
                for worker, record in list(workers.workers.items()):
                    if heard - record.seen > max(grace, 3 * record.interval):
                        await self._end_worker_locally(
                            worker, record.namespace, heard - record.seen
                        )
            except asyncio.CancelledError:
                raise
            except Exception:
                _rare("worker_watch", "relay: watching workers failed", exc_info=True)

    async def _end_worker_locally(self, worker: str, namespace: str, silent_for: float) -> None:
        workers = self._workers
        assert workers is not None
        emitted = 0
        for room, raw in workers.end(worker):
            # This process's browsers only: each web process ends the streams for its own.
            await self.emit(
                TOOL_EVENT_STREAM, raw, namespace=namespace, room=room, ignore_queue=True
            )
            emitted += 1
        self._bump("redis_workers_gone")
        self._bump("redis_worker_aborted", emitted)
        logger.warning(
            "relay: worker %s silent on Redis for %.1f s; ended its %d open stream(s) "
            "with aborted for this process's browsers",
            worker,
            silent_for,
            emitted,
        )

    async def stop_watching(self) -> None:
        """Cancel the gone-worker watch (when the server stops). Idempotent."""
        task, self._watching = self._watching, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _is_heartbeat(message: Any) -> bool:
    if isinstance(message, (bytes, bytearray)):
        return _HEARTBEAT_BYTES in message
    return isinstance(message, str) and WORKER_HEARTBEAT in message


_HEARTBEAT_BYTES = WORKER_HEARTBEAT.encode()


def _is_terminal_emit(data: Any) -> bool:
    if not isinstance(data, dict) or data.get("event") != TOOL_EVENT_STREAM:
        return False
    args = data.get("data")
    block = args[0] if isinstance(args, list) and args else None
    return isinstance(block, dict) and block.get("state") in ("done", "aborted")


def mount_relay(sio: socketio.AsyncServer, secret: str, **options: Any) -> ChatRelay:
    """Register a :class:`ChatRelay` (``options`` as its constructor's) on ``sio``."""
    relay = ChatRelay(secret, **options)
    sio.register_namespace(relay)
    return relay


@dataclass(frozen=True)
class RelayApp:
    """A ready relay: the ASGI ``app`` to serve, its ``sio`` server and the ``relay``."""

    app: Any
    sio: socketio.AsyncServer
    relay: ChatRelay


def create_app(
    secret: str,
    *,
    redis_url: str | None = None,
    redis_channel: str = "socketio",
    other_asgi_app: Any = None,
    cors_allowed_origins: str | list[str] | None = None,
    max_http_buffer_size: int = 4 * 1024 * 1024,
    **relay_options: Any,
) -> RelayApp:
    """An ``AsyncServer`` (Redis client manager when ``redis_url`` is given) with a
    :class:`ChatRelay` mounted, wrapped in ``socketio.ASGIApp`` — for tests and the demo.
    ``worker_grace``, ``max_workers`` and ``max_worker_streams`` go to the Redis manager too.

    ``max_http_buffer_size`` bounds one incoming message (a whole ``kx_blocks`` frame).
    """
    manager = None
    if redis_url is not None:
        watch = ("worker_grace", "max_workers", "max_worker_streams")
        manager = RelayRedisManager(
            redis_url,
            channel=redis_channel,
            **{key: relay_options[key] for key in watch if key in relay_options},
        )
    sio = socketio.AsyncServer(
        async_mode="asgi",
        client_manager=manager,
        cors_allowed_origins=cors_allowed_origins if cors_allowed_origins is not None else [],
        max_http_buffer_size=max_http_buffer_size,
    )
    relay = mount_relay(sio, secret, **relay_options)
    app = socketio.ASGIApp(sio, other_asgi_app=other_asgi_app)
    return RelayApp(app=app, sio=sio, relay=relay)


def is_loopback_host(host: str) -> bool:
    """Whether ``--host`` binds to this machine only: ``localhost`` (any case) or an IP
    literal in 127.0.0.0/8 or ``::1``. Anything else — ``0.0.0.0``, ``::``, an empty host,
    another name (not resolved) — may be reachable from the network."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    from kernel_ext.plugin import ENV_REDIS_URL, ENV_SECRET

    parser = argparse.ArgumentParser(
        prog="python -m kernel_ext.relay",
        description="Serve the kernel_ext /chat relay on its own (uvicorn): blocks from "
        "internal senders to the browsers in each conversation's room.",
        epilog=f"The internal senders' secret comes from {ENV_SECRET}. Without both "
        "--authenticate and --authorize-join the relay refuses to start, unless "
        "--allow-anyone is given on a loopback --host.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; one other than localhost, 127.0.0.0/8 or ::1 needs both "
        "hooks (default: %(default)s)",
    )
    parser.add_argument("--port", type=int, default=8765, help="port (default: %(default)s)")
    parser.add_argument(
        "--redis-url",
        default=None,
        help=f"redis:// URL of a Redis client manager shared by several web processes "
        f"(default: ${ENV_REDIS_URL} if set, else none: this process only)",
    )
    parser.add_argument(
        "--namespace", default=NAMESPACE, help="Socket.IO namespace (default: %(default)s)"
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: %(default)s)",
    )
    parser.add_argument(
        "--authenticate",
        metavar="MODULE:FUNCTION",
        help="browser authentication hook, authenticate(auth, environ) -> identity or None "
        "(default: none, every browser is accepted)",
    )
    parser.add_argument(
        "--authorize-join",
        metavar="MODULE:FUNCTION",
        help="room hook, authorize_join(identity, conversation_id) -> bool "
        "(default: none, every join is allowed)",
    )
    parser.add_argument(
        "--allow-anyone",
        action="store_true",
        help="start without both hooks, on a loopback --host only: every browser may then "
        "join any conversation (default: off, refuse to start)",
    )
    return parser


def _openness(authenticate: str | None, authorize_join: str | None) -> str:
    """What a relay without these hooks lets browsers do ('' when both are given)."""
    if not authenticate and not authorize_join:
        return "without hooks every browser may join any conversation"
    if not authorize_join:
        return "without --authorize-join every authenticated browser may join any conversation"
    if not authenticate:
        return (
            "without --authenticate every browser is accepted and looks the same to "
            "--authorize-join"
        )
    return ""


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _load_hook(parser: argparse.ArgumentParser, option: str, spec: str) -> Callable[..., Any]:
    from kernel_ext.instrument import _load_callable

    try:
        return _load_callable(spec, option)
    except ConfigError as exc:
        _refuse(parser, str(exc))
    except Exception as exc:  # the module itself failed while importing
        _refuse(parser, f"{option} {spec!r} cannot be loaded ({type(exc).__name__}: {exc})")


def main(argv: list[str] | None = None) -> int:
    """``python -m kernel_ext.relay``: serve a standalone relay with uvicorn.

    Refuses to start (a one-line error, exit status 2) without both hooks unless
    ``--allow-anyone`` is given, and without both hooks on a non-loopback ``--host``
    (:func:`is_loopback_host`) even then; a hook that cannot be loaded, or a missing
    ``KERNEL_EXT_SECRET``, is refused the same way."""
    from kernel_ext.plugin import ENV_REDIS_URL, ENV_SECRET

    parser = _parser()
    args = parser.parse_args(argv)
    openness = _openness(args.authenticate, args.authorize_join)
    if openness and not is_loopback_host(args.host):
        _refuse(
            parser,
            f"--host {args.host} may be reachable from the network and {openness}: give both "
            "--authenticate and --authorize-join (--allow-anyone is for loopback hosts only)",
        )
    if openness and not args.allow_anyone:
        _refuse(
            parser,
            f"{openness}: give both --authenticate and --authorize-join (MODULE:FUNCTION), "
            "or --allow-anyone to accept that",
        )
    secret = os.environ.get(ENV_SECRET, "")
    if not secret:
        _refuse(parser, f"set {ENV_SECRET} to the internal senders' shared secret")
    authenticate = (
        _load_hook(parser, "--authenticate", args.authenticate) if args.authenticate else None
    )
    authorize_join = (
        _load_hook(parser, "--authorize-join", args.authorize_join)
        if args.authorize_join
        else allow_all
    )
    import uvicorn

    logging.basicConfig(level=args.log_level.upper())
    if openness:
        logger.warning(
            "relay started with --allow-anyone on %s:%d: %s", args.host, args.port, openness
        )
    ready = create_app(
        secret,
        redis_url=args.redis_url or os.environ.get(ENV_REDIS_URL) or None,
        namespace=args.namespace,
        authenticate=authenticate,
        authorize_join=authorize_join,
    )
    uvicorn.run(
        ready.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="off",
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    # Run the module under its own name, so that its loggers are kernel_ext.relay's.
    from kernel_ext.relay import main as _main

    raise SystemExit(_main())
