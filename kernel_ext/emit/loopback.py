"""The loopback sender: a python-socketio ``AsyncClient`` on the web process's relay.

Reconnection is ours, not python-socketio's: one connect loop
(``LoopbackEmitter._connect_loop``) waits between attempts by
:class:`kernel_ext._shared.backoff.Backoff`, and an acknowledgement watchdog forces a reconnect
when the relay stops answering. The client's own reconnection is off: it cannot do what a
sender needs (why: docs/contracts.md, "The loopback sender").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kernel_ext._shared import compat
from kernel_ext.emit.base import (
    DEFAULT_NAMESPACE,
    DISCONNECTED,
    REJECTED,
    Emitter,
    backoff,
    check_worker_id,
    logger,
    rare,
    remembers_arguments,
)
from kernel_ext.emit.owed_terminals import OwedTerminal, OwedTerminals
from kernel_ext.errors import ConfigError, check_positive_ints, check_positive_numbers
from kernel_ext.observability.count_names import (
    ACK_TIMEOUTS,
    ACKS,
    CONNECT_FAILURES,
    CONNECT_REFUSED,
    CONNECTS,
    DISCONNECTS,
    NACKS,
    TERMINAL_RESENDS,
    TERMINALS_DEGRADED,
    WINDOW_FULL,
)
from kernel_ext.protocol import (
    ACKS_PACED,
    FRAME_ROOMS,
    KX_BLOCKS,
    KX_CHAT_EVENT,
    KX_HELLO,
    KX_HELLO_MAX_OPEN,
    KX_STOP,
    REFUSED_BAD_WORKER,
    REFUSED_UNAUTHORIZED,
    wire_text,
)
from kernel_ext.settings import check_secret
from kernel_ext.stop import stop_call
from kernel_ext.stream import Outgoing, OutgoingBlock, OutgoingChatEvent, StreamHub

__all__ = ["LoopbackEmitter"]


def _on_stop(data: Any = None) -> dict[str, str]:
    """``kx_stop`` from the relay: stop one running call of this worker by its callId
    (``{"v": 1, "callId": …}``); the acknowledgement is ``{"answer": …}``, what
    :func:`kernel_ext.stop_call` answered (anything malformed: ``refused``). Never raises."""
    call_id = data.get("callId") if isinstance(data, Mapping) and data.get("v") == 1 else None
    return {"answer": stop_call(call_id, reason="asked by the relay (kx_stop)")}


_LIVED = 1.0
"""Seconds a connection must last for the next attempt to start over from the first delay."""

_HELLO_WAIT = 1.0
"""Seconds the frames of a new connection wait for the relay's answer to ``kx_hello`` (the
first blocks wait in the hub's queue)."""
_OPEN_ENTRY_CHARS = 80
"""Characters of an announced open stream's entry beside its room and taskId (keys, callId,
seq, punctuation), at most."""

Section = tuple[str, list[OutgoingBlock]]
Frame = list[Section] | OutgoingChatEvent
"""A ``kx_blocks`` frame as (room, blocks) sections (one, unless the relay takes several
rooms per frame), or a chat event."""


class _Inflight(NamedTuple):
    """A ``kx_blocks`` frame awaiting its acknowledgement."""

    terminals: list[OwedTerminal]
    sent: float
    blocks: list[OutgoingBlock]


def _now() -> float:
    return time.monotonic()


class _EncodedFrame:
    """A ``kx_blocks`` frame's data already in JSON text: each block's
    :attr:`~kernel_ext.stream.OutgoingBlock.text` spliced in, none encoded again."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    @classmethod
    def of(cls, frame: list[Section]) -> _EncodedFrame:
        """The frame's data: ``{v, room, blocks}`` for one room, ``{v, rooms}`` for more
        (docs/protocol.md), as python-socketio would encode it."""
        sections = [
            f'"room":{wire_text(room)},"blocks":[{",".join([b.text for b in blocks])}]'
            for room, blocks in frame
        ]
        if len(sections) == 1:
            return cls(f'{{"v":1,{sections[0]}}}')
        return cls('{"v":1,"rooms":[{' + "},{".join(sections) + "}]}")


@functools.cache
def _packet_class() -> type[Any]:
    """The sender client's packet class: an event whose data is an :class:`_EncodedFrame`
    is written as the frame's text (its blocks are not encoded again), everything else as
    python-socketio writes it (:func:`kernel_ext._shared.compat.spliced_packet_class`).
    Made on first use: the root package does not import python-socketio."""
    return compat.spliced_packet_class(_EncodedFrame, wire_text)


class LoopbackEmitter(Emitter):
    """Sends blocks to the web process's relay over a python-socketio ``AsyncClient``.

    Connects to ``url``, namespace ``/chat``, with auth ``{"internal": secret, "worker":
    worker_id}`` (default id: random per emitter), and tells the relay its hub's open streams
    (``kx_hello``), which the relay ends ``aborted`` when the sender stays away longer than
    its grace period. Guarantees (in full: docs/contracts.md, "The loopback sender"):

    * Blocks of one stream go in order, batched into ``kx_blocks`` frames (at most
      ``frame_max_blocks`` blocks / about ``frame_max_chars`` characters).
    * A terminal is re-sent after a reconnect until acknowledged, within
      ``terminal_max_attempts``, ``terminal_max_age`` and ``max_pending_terminals``
      (beyond: dropped, counted, logged at ERROR); a silent relay past ``ack_timeout`` is
      left and reconnected to.
    * Running blocks are fire-and-forget (T3); against a relay that paces its
      acknowledgements, at most ``max_inflight_frames`` await one, and the hub's bounds
      decide what waits.
    * Reconnects with jittered backoff; a refused connection is told apart from an
      unreachable relay. :attr:`healthy`, ``on_health`` and :attr:`counts` report it.

    Raises :class:`~kernel_ext.ConfigError` for a bad argument (a secret under 16 bytes …).
    """

    sender = "loopback"
    up_event = CONNECTS
    down_event = DISCONNECTS

    # The keyword parameters are this sender's documented API; alike in shape (not a copy)
    # of RedisEmitter's and the relay's. OwedTerminals checks the terminal bounds.
    @remembers_arguments
    def __init__(
        self,
        url: str,
        secret: str,
        *,
        hub: StreamHub | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        socketio_path: str = "socket.io",
        transports: list[str] | None = None,
        batch_max: int = 512,
        frame_max_blocks: int = 256,
        frame_max_chars: int = 256 * 1024,
        ack_timeout: float = 10.0,
        terminal_max_attempts: int = 10,
        terminal_max_age: float = 300.0,
        max_pending_terminals: int = 10_000,
        max_inflight_frames: int = 4,
        reconnect_delay: float = 0.1,
        reconnect_delay_max: float = 5.0,
        connect_timeout: float = 5.0,
        on_health: Callable[[bool], None] | None = None,
        worker_id: str | None = None,
    ) -> None:
        super().__init__(hub=hub, batch_max=batch_max, on_health=on_health)
        if not isinstance(url, str) or not url:
            raise ConfigError("url must be the relay's http(s) URL")
        check_secret(secret)  # the relay's rule: at least 16 bytes
        check_positive_ints(
            frame_max_blocks=frame_max_blocks,
            frame_max_chars=frame_max_chars,
            max_inflight_frames=max_inflight_frames,
        )
        check_positive_numbers(ack_timeout=ack_timeout, connect_timeout=connect_timeout)
        self.url = url
        self._secret = secret
        self.worker_id = check_worker_id(worker_id)
        self.namespace = namespace
        self.socketio_path = socketio_path
        self.transports = transports if transports is not None else ["websocket"]
        self.frame_max_blocks = frame_max_blocks
        self.frame_max_chars = frame_max_chars
        self.max_inflight_frames = max_inflight_frames
        self.ack_timeout = float(ack_timeout)
        self._backoff = backoff(
            reconnect_delay=reconnect_delay, reconnect_delay_max=reconnect_delay_max
        )
        self.reconnect_delay = self._backoff.initial
        self.reconnect_delay_max = self._backoff.maximum
        self.connect_timeout = float(connect_timeout)
        self._terminals = OwedTerminals(
            lambda: self.port,
            max_pending_terminals=max_pending_terminals,
            terminal_max_age=terminal_max_age,
            terminal_max_attempts=terminal_max_attempts,
        )
        self._inflight: dict[int, _Inflight] = {}  # by frame id
        self._frame_ids = 0
        self._client: Any = None
        self._healthy = False
        self._first_attempt = asyncio.Event()
        self._rooms_per_frame = False  # the relay's answer to kx_hello, per connection
        self._paced = False  # likewise
        self._window = asyncio.Event()  # set: a frame may go (the window has room)
        self._window.set()
        self._holding_back = False
        self._hello_task: asyncio.Task[None] | None = None
        self._hello_waited: asyncio.Task[None] | None = None  # the last one frames waited for
        self._refusal: str | None = None  # the relay's reason, during one attempt
        self._reported: str | None = None  # the refusal logged last (None once connected)

    @property
    def connections(self) -> int:
        """How many times a connection was established (1 + reconnects)."""
        return self.counts[CONNECTS]

    @property
    def sid(self) -> str | None:
        """The current connection's namespace sid, if connected."""
        client = self._client
        if client is None or not self._healthy:
            return None
        sid: str | None = client.get_sid(self.namespace)
        return sid

    @property
    def paced(self) -> bool:
        """Whether every frame now awaits its acknowledgement within the window (the relay
        said its acknowledgements are paced)."""
        return self._paced

    @property
    def holding_back(self) -> bool:
        """Whether the sender waits now for the window to have room (taking nothing from
        the hub meanwhile)."""
        return self._holding_back

    @property
    def inflight_frames(self) -> int:
        """Frames sent and not yet acknowledged, now."""
        return len(self._inflight)

    def _window_changed(self) -> None:
        """Open the window when a frame may go: it has room, or the connection is down (the
        frame then goes nowhere and is lost or held)."""
        if len(self._inflight) < self.max_inflight_frames or not self._healthy:
            self._window.set()
        else:
            self._window.clear()

    def _pending(self) -> int:
        return len(self._terminals) + sum(len(f.terminals) for f in self._inflight.values())

    def _abandon_pending(self) -> int:
        pending = self._pending()
        self._terminals.abandon()
        self._inflight = {}
        self._window.set()
        return pending

    def _health_message(self, healthy: bool, why: object) -> tuple[int, str, tuple[object, ...]]:
        if healthy:
            return logging.INFO, "loopback emitter: connected to %s (sid %s)", (self.url, self.sid)
        return logging.WARNING, "loopback emitter: disconnected from %s (%s)", (self.url, why)

    # -- the connection -------------------------------------------------------------------

    async def _ready(self) -> None:
        """The first connection attempt is over, and when it connected, the relay answered
        ``kx_hello`` (or did not within ``_HELLO_WAIT`` seconds): the first frames already
        take the form the relay takes."""
        await self._first_attempt.wait()
        await self._hello_answered()

    async def _hello_answered(self) -> None:
        """The current connection's ``kx_hello`` was answered, failed, or waited for
        ``_HELLO_WAIT`` seconds once: frames go after it (the open streams it announced are
        the relay's before that connection's terminals)."""
        hello = self._hello_task
        if hello is self._hello_waited:
            return
        self._hello_waited = hello
        if hello is not None and not hello.done():
            await asyncio.wait((hello,), timeout=min(_HELLO_WAIT, self.ack_timeout))

    async def _open(self) -> None:
        import socketio

        self._first_attempt = asyncio.Event()
        # reconnection ours: module docstring; frames sent as their blocks' text (_packet_class)
        # handle_sigint=False: the application's Ctrl-C stays its own (python-engineio would
        # otherwise take SIGINT over on the main thread's loop, cancel every task and stop it).
        client = socketio.AsyncClient(
            reconnection=False, serializer=_packet_class(), handle_sigint=False
        )
        client.on("connect", self._on_connect, namespace=self.namespace)
        client.on("disconnect", self._on_disconnect, namespace=self.namespace)
        client.on("connect_error", self._on_connect_error, namespace=self.namespace)
        client.on(KX_STOP, _on_stop, namespace=self.namespace)
        self._client = client
        self._start_watcher(self._connect_loop)

    async def _close(self) -> None:
        await self._stop_watcher()
        client, self._client = self._client, None
        self._cancel_hello()
        if client is not None:
            with contextlib.suppress(Exception):
                await client.disconnect()
        self._set_healthy(False, "stopped")

    @property
    def rooms_per_frame(self) -> bool:
        """Whether frames now carry blocks of several rooms (the relay said it takes them)."""
        return self._rooms_per_frame

    async def _on_connect(self) -> None:
        self._reported = None  # a later refusal is news again
        self._rooms_per_frame = False
        self._paced = False
        self._set_healthy(True)
        self._cancel_hello()
        # Not awaited here: the client reads the answer on the loop this handler runs in.
        # The answer counts for this connection only (the connection count it started at).
        self._hello_task = asyncio.get_running_loop().create_task(
            self._hello(self._client, self.counts[CONNECTS])
        )
        if self._consumer is not None:
            self._consumer.poke()  # re-send held terminals now

    def _cancel_hello(self) -> None:
        task, self._hello_task = self._hello_task, None
        if task is not None:
            task.cancel()

    def _open_streams(self) -> list[dict[str, Any]]:
        """The hub's open streams as ``kx_hello`` announces them (``{room, callId, taskId,
        seq}``, newest first): at most :data:`~kernel_ext.protocol.KX_HELLO_MAX_OPEN` of
        them, within about ``frame_max_chars`` characters (the newest kept)."""
        port = self._consumer
        if port is None:
            return []
        budget = self.frame_max_chars
        found = []
        for room, call_id, task_id, seq in port.hub.open_streams(KX_HELLO_MAX_OPEN):
            budget -= len(wire_text(room)) + len(wire_text(task_id)) + _OPEN_ENTRY_CHARS
            if budget < 0:
                break
            found.append({"room": room, "callId": call_id, "taskId": task_id, "seq": seq})
        return found

    async def _hello(self, client: Any, connection: int) -> None:
        """Ask the relay what frames it takes, saying which streams are open here (the
        relay, maybe restarted since their last block, then knows whose they are); one room
        per frame until it says more. The answer is taken only while the connection it was
        asked on (the ``connection``-th) is still up: an answer crossing a reconnect (the
        relay since replaced by an older one) is ignored."""
        question = {"v": 1, "open": self._open_streams()}
        try:
            answer = await client.call(
                KX_HELLO, question, namespace=self.namespace, timeout=self.ack_timeout
            )
        except Exception:  # an older relay that does not answer, a disconnect
            return
        if not isinstance(answer, Mapping) or answer.get("ok") is not True:
            return
        if client is not self._client or not self._healthy or self.counts[CONNECTS] != connection:
            return
        frames = answer.get("frames")
        if isinstance(frames, list) and FRAME_ROOMS in frames:
            self._rooms_per_frame = True
        if answer.get("acks") == ACKS_PACED:
            self._paced = True

    def _on_connect_error(self, data: Any = None) -> None:
        """The relay answered the namespace CONNECT with an error: ``{"message": reason}``
        (a transport failure reaches here as a bare string, and is no refusal)."""
        if isinstance(data, Mapping) and isinstance(data.get("message"), str):
            self._refusal = data["message"]

    def _report_refusal(self, reason: str) -> None:
        """Count a refused attempt; log it when the answer changed since the last log."""
        self._count(CONNECT_REFUSED)
        if reason == self._reported:
            return
        self._reported = reason
        if reason == REFUSED_UNAUTHORIZED:
            logger.error(
                "loopback emitter: the relay refused the internal secret (%s, %r): give this "
                "worker the relay's secret (KERNEL_EXT_SECRET or enable(secret=...)); "
                "retrying with backoff",
                self.url,
                reason,
            )
        elif reason == REFUSED_BAD_WORKER:
            logger.error(
                "loopback emitter: the relay refused the worker id %r (%s): use 1-128 letters, "
                "digits and ._:@- ; retrying with backoff",
                self.worker_id,
                self.url,
            )
        else:
            logger.error(
                "loopback emitter: the relay refused the connection (%s, %r); retrying with "
                "backoff",
                self.url,
                reason,
            )

    async def _on_disconnect(self, reason: Any = None) -> None:
        # Frames without an acknowledgement may or may not have arrived: hold their
        # terminals again (the relay drops a terminal it emitted already).
        # Their running blocks are lost like any sent while disconnected.
        inflight, self._inflight = self._inflight, {}
        for frame in inflight.values():
            self._lose(frame.blocks, frame.terminals)
        self._rooms_per_frame = False
        self._paced = False
        self._cancel_hello()
        self._set_healthy(False, reason)
        self._window.set()
        self._wakeup.set()

    async def _connect_loop(self) -> None:
        """The one reconnect loop: attempt, watch the connection while it lives, wait by the
        backoff, again, until stopped."""
        backoff = self._backoff
        backoff.reset()
        while not self._stopping:
            self._refusal = None
            try:
                await self._client.connect(
                    self.url,
                    auth={"internal": self._secret, "worker": self.worker_id},
                    namespaces=[self.namespace],
                    transports=self.transports,
                    socketio_path=self.socketio_path,
                    wait_timeout=self.connect_timeout,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # ConnectionError, OSError, refused auth, …
                self._count(CONNECT_FAILURES)
                if self._refusal is not None:  # the relay answered: no
                    self._report_refusal(self._refusal)
                else:
                    rare(
                        "connect_failed",
                        "loopback emitter: cannot connect to %s: %s",
                        self.url,
                        exc,
                        level=logging.WARNING,
                    )
                self._terminals.expire()  # give up spent ones meanwhile
                self._first_attempt.set()
                await self._pause(backoff.next())
                continue
            self._first_attempt.set()
            connected_at = _now()
            await self._watch()
            # A connection that dropped at once (a relay that keeps closing it) backs off
            # like a failed attempt; one that lived starts over from the shortest delay.
            if _now() - connected_at >= _LIVED:
                backoff.reset()
            if not self._stopping:
                await self._pause(backoff.next())

    async def _watch(self) -> None:
        """While connected: force a reconnect when an acknowledgement is overdue."""
        step = min(1.0, self.ack_timeout / 4)
        while self._healthy and not self._stopping:
            await self._pause(step)
            if not self._healthy or self._stopping:
                return
            if self._inflight:
                oldest = min(frame.sent for frame in self._inflight.values())
                if _now() - oldest > self.ack_timeout:
                    self._count(ACK_TIMEOUTS)
                    logger.warning(
                        "loopback emitter: no acknowledgement from %s within %.1f s; reconnecting",
                        self.url,
                        self.ack_timeout,
                    )
                    with contextlib.suppress(Exception):
                        await self._client.disconnect()
                    if self._healthy:  # the disconnect handler did not run
                        await self._on_disconnect("ack timeout")
                    return

    # -- sending --------------------------------------------------------------------------

    def _frames(self, items: list[Outgoing]) -> list[Frame]:
        """``items`` as frames, in order: blocks of one room stay in order within and
        across frames; a chat event goes between the frames before and after it."""
        frames: list[Frame] = []
        max_blocks, max_chars = self.frame_max_blocks, self.frame_max_chars
        if self._rooms_per_frame:
            current: list[Section] | None = None
            by_room: dict[str, list[OutgoingBlock]] = {}
            count = chars = 0
            for item in items:
                if isinstance(item, OutgoingChatEvent):
                    current = None
                    frames.append(item)
                    continue
                if current is None or (
                    count and (count >= max_blocks or chars + item.size > max_chars)
                ):
                    current, by_room, count, chars = [], {}, 0, 0
                    frames.append(current)
                section = by_room.get(item.room)
                if section is None:
                    section = by_room[item.room] = []
                    current.append((item.room, section))
                section.append(item)
                count += 1
                chars += item.size
            return frames
        open_frames: dict[str, tuple[list[OutgoingBlock], list[int]]] = {}
        for item in items:
            if isinstance(item, OutgoingChatEvent):
                open_frames.pop(item.room, None)
                frames.append(item)
                continue
            room_frame = open_frames.get(item.room)
            if room_frame is not None:
                blocks, size = room_frame
                if len(blocks) < max_blocks and size[0] + item.size <= max_chars:
                    blocks.append(item)
                    size[0] += item.size
                    continue
            blocks = [item]
            open_frames[item.room] = (blocks, [item.size])
            frames.append([(item.room, blocks)])
        return frames

    async def _send(self, items: list[Outgoing]) -> None:
        if self._hello_task is not self._hello_waited:
            await self._hello_answered()
        if self._healthy and len(self._terminals):
            retry = self._terminals.take()
            if retry:
                self._count(TERMINAL_RESENDS, len(retry))
                await self._send_frames(self._frames([h.item for h in retry]), retry)
        if items:
            await self._send_frames(self._frames(items), None)

    async def _send_frames(self, frames: list[Frame], retry: list[OwedTerminal] | None) -> None:
        consumer = self.port
        held_by_item = {id(h.item): h for h in retry} if retry else {}
        for frame in frames:
            if isinstance(frame, OutgoingChatEvent):
                if not self._healthy:
                    consumer.dropped(DISCONNECTED)
                    continue
                try:
                    await self._client.emit(
                        KX_CHAT_EVENT,
                        {"room": frame.room, "event": frame.event},
                        namespace=self.namespace,
                    )
                except Exception:
                    consumer.dropped(DISCONNECTED)
                continue
            blocks = [b for _, section in frame for b in section]
            terminals = [
                held_by_item.get(id(b)) or self._terminals.new(b) for b in blocks if b.terminal
            ]
            if self._paced and not self._window.is_set():
                self._count(WINDOW_FULL)
                self._holding_back = True
                try:
                    await self._window.wait()
                finally:
                    self._holding_back = False
            if not self._healthy:
                self._lose(blocks, terminals)
                continue
            payload = _EncodedFrame.of(frame)
            frame_id = 0
            try:
                if terminals or self._paced:
                    self._frame_ids += 1
                    frame_id = self._frame_ids
                    for entry in terminals:
                        entry.attempts += 1
                    self._inflight[frame_id] = _Inflight(terminals, _now(), blocks)
                    self._window_changed()
                    await self._client.emit(
                        KX_BLOCKS,
                        payload,
                        namespace=self.namespace,
                        callback=functools.partial(self._on_ack, frame_id, len(blocks)),
                    )
                else:
                    await self._client.emit(KX_BLOCKS, payload, namespace=self.namespace)
                    consumer.delivered(len(blocks))
            except Exception as exc:
                rare("emit_failed", "loopback emitter: emit failed: %s", exc)
                if frame_id and self._inflight.pop(frame_id, None) is None:
                    continue  # the disconnect handler lost or held them already
                self._window_changed()
                self._lose(blocks, terminals)

    def _lose(self, blocks: list[OutgoingBlock], terminals: list[OwedTerminal]) -> None:
        """Blocks that cannot go now: running ones are dropped, terminals held."""
        consumer = self.port
        for block in blocks:
            if not block.terminal:
                consumer.dropped(DISCONNECTED, 1, block.call_id)
        for entry in terminals:
            self._terminals.hold(entry)

    def _on_ack(self, frame_id: int, n_blocks: int, ack: Any = None) -> None:
        """A frame's acknowledgement. Running blocks the relay refused are lost (counted
        ``rejected``); a refused terminal is never counted delivered: it is degraded one
        step and sent again, or dropped (counted) when both steps were refused
        (:meth:`OwedTerminals.refused`). A relay that refuses blocks without saying which
        has each terminal of the frame sent again (it drops a terminal it emitted already);
        a busy relay has them all sent again unchanged."""
        frame = self._inflight.pop(frame_id, None)
        if frame is None:
            return
        self._window_changed()
        held, blocks = frame.terminals, frame.blocks
        bound: Any = None
        if isinstance(ack, Mapping) and ack.get("ok") is True:
            self._count(ACKS)
            rejected = ack.get("rejected")
            if isinstance(rejected, bool) or not isinstance(rejected, int) or rejected < 0:
                rejected = 0
            self.port.delivered(n_blocks - min(rejected, n_blocks))
            if not rejected:
                return
            refused = _refused_indexes(ack.get("refused"), len(blocks))
            for index in refused:
                if not blocks[index].terminal:
                    self.port.dropped(REJECTED, 1, blocks[index].call_id)
            if len(refused) < rejected:  # the relay did not say which
                self.port.dropped(REJECTED, rejected - len(refused))
                again = [(h, "invalid") for h in held]
            else:
                position = {id(block): index for index, block in enumerate(blocks)}
                again = [
                    (h, refused[position[id(h.item)]])
                    for h in held
                    if position.get(id(h.item), -1) in refused
                ]
            bound = ack.get("maxBlockBytes")
        else:
            self._count(NACKS)
            rare("nack", "loopback emitter: relay refused a frame: %r", ack)
            if isinstance(ack, Mapping) and ack.get("error") == "busy":
                for entry in held:
                    self._terminals.hold(entry)
                if held and self._consumer is not None:
                    self._consumer.poke()
                return
            again = [(h, "invalid") for h in held]
        for entry, reason in again:
            if self._terminals.refused(entry, reason, bound if isinstance(bound, int) else None):
                self._count(TERMINALS_DEGRADED)
        if again and self._consumer is not None:
            self._consumer.poke()


def _refused_indexes(refused: Any, n_blocks: int) -> dict[int, str]:
    """``{index: reason}`` from an acknowledgement's ``refused`` list (bad entries skipped)."""
    found: dict[int, str] = {}
    if not isinstance(refused, list):
        return found
    for entry in refused:
        if not isinstance(entry, Mapping):
            continue
        index, reason = entry.get("index"), entry.get("reason")
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < n_blocks:
            found[index] = reason if isinstance(reason, str) else "invalid"
    return found
