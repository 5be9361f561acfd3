"""Publishing blocks: attribution, per-stream sequencing, the T4 throttle, terminal bookkeeping.

Tool code (and the A2A adapter) calls :func:`publish`; a :class:`StreamHub` applies the
per-stream rules and queues what passes for one sender (an emitter in
:mod:`kernel_ext.emit`), which takes it through :meth:`StreamHub.consumer`.

Guarantees of :meth:`StreamHub.publish` (and the module-level :func:`publish`):

* Enqueue-only: it never blocks, never raises, and may be called from the event loop or any
  thread. Blocks are built and validated on the consumer side, not on the caller's thread.
* Attribution through :func:`kernel_ext.resolve.resolve_call_id`; the room is the active
  call's conversation id, else the ``conversation_id`` argument. No room → dropped
  (``no_room``). A running block without a callId is not sent (``unattributed``); a
  terminal without one goes out with ``callId: null``.
* A stream is one (callId, taskId); ``task_id=None`` means the callId (a local block).
  A ``str`` item becomes a pseudo-envelope whose ``seq`` comes from the stream's counter,
  strictly increasing; ``done`` text goes to ``payload.text``, ``aborted`` text to
  ``payload.message``.
* T4: at most ``max_running_per_second`` running blocks per stream in any window of one
  second (a strict sliding window); over it the newest block is dropped (``throttled``) and
  counted on the stream. A terminal is never throttled, never queued behind dropped
  blocks, and sent exactly once per stream: a second terminal is dropped
  (``duplicate_terminal``), and so is any running block after it (``closed``), for as long
  as the call is live — what closed is remembered with the call, not on a clock.
* A call's end (:meth:`StreamHub.tool_call_ended`: the instrumented runtime returned or
  raised, or the call's span ended) closes every stream of it: an open stream gets its
  provisional terminal if it has one (``publish(..., provisional=True)``), else one
  ``aborted``; afterwards nothing more of that call is sent (``closed``), also not from
  tasks the tool started that outlive it (they hold the ended :class:`~kernel_ext.ToolCall`).
* Bounded: at most ``max_streams`` open streams (``stream_limit`` beyond), ``max_queue``
  queued running blocks (``queue_full`` beyond; terminals are queued regardless, and
  their number is bounded by the streams), ``max_calls`` live calls with state (the oldest
  is forgotten beyond, ``call_limit``), ``max_closed_per_call`` closed streams remembered
  per call (the oldest is forgotten beyond). A stream's state is released at its terminal,
  a call's when it ends; a stream idle for ``stream_idle_ttl`` seconds (its call's end never
  came) is ended like at its call's end (counted ``expired``), so its pane ends too.
* Terminals without a callId (attribution failed) are remembered like the streams of one
  call that never ends, so a repeated one is dropped too (at most ``max_closed_per_call``).
* With no sender attached, blocks are counted ``no_sender`` and not kept.

Counts by reason are in :meth:`StreamHub.stats`; they reach the OpenTelemetry counter
``kernel_ext.blocks`` (``outcome``/``reason``) in batches, from the consumer side.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from kernel_ext import metrics
from kernel_ext._telemetry import RareLog
from kernel_ext.context import _CURRENT_CALL, CallLife
from kernel_ext.errors import (
    BlockTooLargeError,
    DecodeError,
    check_positive_ints,
    check_positive_numbers,
)
from kernel_ext.protocol import (
    DEFAULT_MAX_BLOCK_BYTES,
    PROTOCOL_VERSION,
    Block,
    Envelope,
    decode_envelope,
    encode_wire,
    fallback_terminal,
    fits,
    text_block,
    text_block_fast_limit,
)
from kernel_ext.resolve import _count_context
from kernel_ext.tap import LiveCall

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

    from kernel_ext.tap import Tap

__all__ = [
    "ATTR_BLOCKS_DROPPED",
    "ATTR_BLOCKS_SENT",
    "ATTR_CALL_ID_PATH",
    "HubConsumer",
    "HubStats",
    "Outgoing",
    "OutgoingBlock",
    "OutgoingChatEvent",
    "StreamHub",
    "get_default_hub",
    "publish",
    "publish_chat_event",
    "set_default_hub",
]

logger = logging.getLogger(__name__)
_rare = RareLog(logger)

ATTR_BLOCKS_SENT = "kernel_ext.stream.blocks_sent"
ATTR_BLOCKS_DROPPED = "kernel_ext.stream.blocks_dropped"
ATTR_CALL_ID_PATH = "kernel_ext.call_id.path"
ATTR_STREAMS = "kernel_ext.stream.streams"

PublishState = Literal["running", "done", "aborted"]
PublishItem = Envelope | Mapping[str, Any] | str

_current_tool_call = _CURRENT_CALL.get  # kernel_ext.current_tool_call without its call
_time_ns = time.time_ns
_DEFAULT_ABORT_MESSAGE = "the tool call ended before its stream did"
_IDLE_ABORT_MESSAGE = "the stream was idle too long; its tool call's end was never seen"
_MAX_TASK_ID = 512
_MAX_RING = 1024
_SWEEP_EVERY = 1.0

# Drop reasons (the ``reason`` attribute of ``kernel_ext.blocks`` with outcome ``dropped``).
THROTTLED = "throttled"
CLOSED = "closed"
DUPLICATE_TERMINAL = "duplicate_terminal"
UNATTRIBUTED = "unattributed"
NO_ROOM = "no_room"
NO_SENDER = "no_sender"
NO_TASK_ID = "no_task_id"
QUEUE_FULL = "queue_full"
STREAM_LIMIT = "stream_limit"
INVALID = "invalid"
TOO_LARGE = "too_large"
EXPIRED = "expired"
CALL_LIMIT = "call_limit"
UNFLUSHED = "unflushed"
ERROR = "error"
# Counted, not dropped: a terminal that had to be rebuilt (invalid/too large) to be sent.
DEGRADED = "degraded"
# Outcome ``sent`` is reported by the sender (:meth:`StreamHub.record_delivered`).
SENT = "sent"


class _ToolCallItem(NamedTuple):
    """A nested tool call's start marker (built into a ``tool_call`` envelope later)."""

    tool_name: str
    call_id: str


# Queued: (room, call_id, task_id, state, time_ns, item, seq); built into Outgoing later.
_Raw = tuple[Any, ...]


@dataclass(slots=True)
class OutgoingBlock:
    """One block ready for a sender: ``block`` is the wire form (a JSON-ready dict).
    Read-only by convention (not frozen: a frozen dataclass costs ~1 µs more per block)."""

    room: str
    block: dict[str, Any]
    call_id: str | None
    task_id: str
    terminal: bool
    size: int = 0
    """An estimate of the encoded size in characters (senders pack frames with it)."""


@dataclass(slots=True)
class OutgoingChatEvent:
    """The kernel's ``chat_event`` snapshot for ``room``, ordered with the blocks."""

    room: str
    event: dict[str, Any]


Outgoing = OutgoingBlock | OutgoingChatEvent


class _CallStats:
    """What the hub holds for one live call: counters, open streams, closed stream keys
    (an insertion-ordered set, oldest first) and the call's life when it was seen."""

    __slots__ = ("closed", "dropped", "life", "open", "path", "sent", "touched")

    def __init__(self, path: str, now: float) -> None:
        self.sent = 0
        self.dropped = 0
        self.path = path
        self.open: dict[str, _Stream] = {}
        self.closed: dict[str, None] = {}
        self.life: CallLife | None = None
        self.touched = now


class _Stream:
    __slots__ = (
        "call",
        "closed",
        "cursor",
        "dropped",
        "provisional",
        "ring",
        "room",
        "sent",
        "seq",
        "touched",
    )

    def __init__(self, room: str, call: _CallStats, ring_size: int, now: float) -> None:
        # Set (under the hub's lock) when the stream leaves the hub's streams: a publisher
        # that looked it up without the lock then knows to look again.
        self.closed = False
        self.room = room
        self.call = call
        self.ring = [-math.inf] * ring_size
        self.cursor = 0
        self.seq = 0
        self.sent = 0
        self.dropped = 0
        self.touched = now
        # (state, item) of the terminal to send if the call ends with the stream open.
        self.provisional: tuple[str, Any] | None = None


@dataclass(frozen=True)
class HubStats:
    """A snapshot of a hub: counts by reason since it was made, and its current sizes.

    ``counts`` keys are the drop reasons (``throttled``, ``closed``, …), ``queued`` (blocks
    the rules let through), ``sent`` (reported by the sender) and ``degraded``. ``closed``
    is the number of closed streams remembered (with their live calls).
    """

    counts: dict[str, int] = field(default_factory=dict)
    streams: int = 0
    calls: int = 0
    closed: int = 0
    queue: int = 0
    consumer: bool = False

    def __getitem__(self, reason: str) -> int:
        return self.counts.get(reason, 0)


def _resolver() -> Any:
    from kernel_ext.resolve import resolve_call_id

    return resolve_call_id


class StreamHub:
    """Per-stream rules and the queue between publishers and one sender (module docstring).

    Args:
        max_running_per_second: running blocks per stream per second (T4, default 10);
            ``None`` disables the throttle (benchmarks).
        max_streams: open streams kept (default 10,000).
        max_queue: running blocks queued for the sender (default 10,000).
        max_calls: live calls with state kept (default 10,000).
        max_closed_per_call: closed streams remembered per live call to drop late blocks
            (default 1,024).
        stream_idle_ttl: seconds after which an idle open stream is forgotten (default 900).
        max_block_bytes: the size bound of one encoded block (truncated beyond).
        tap: the tap for near-match attribution (default: the process-wide tap).
        clock: the monotonic clock of the throttle and the graces (tests pass a fake).

    Raises:
        ConfigError: a bound is not a positive number.
    """

    def __init__(
        self,
        *,
        max_running_per_second: float | None = 10.0,
        max_streams: int = 10_000,
        max_queue: int = 10_000,
        max_calls: int = 10_000,
        max_closed_per_call: int = 1_024,
        stream_idle_ttl: float = 900.0,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
        tap: Tap | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_positive_ints(
            max_streams=max_streams,
            max_queue=max_queue,
            max_calls=max_calls,
            max_closed_per_call=max_closed_per_call,
            max_block_bytes=max_block_bytes,
        )
        check_positive_numbers(stream_idle_ttl=stream_idle_ttl)
        if max_running_per_second is None:
            ring, window = 1, 0.0
        else:
            rate = max_running_per_second
            check_positive_numbers(max_running_per_second=rate)
            # A strict sliding window: at most `ring` blocks in any `window` seconds.
            ring = max(1, min(_MAX_RING, int(rate)))
            window = ring / float(rate)
        self.max_running_per_second = max_running_per_second
        self.max_streams = max_streams
        self.max_queue = max_queue
        self.max_calls = max_calls
        self.max_closed_per_call = max_closed_per_call
        self.stream_idle_ttl = float(stream_idle_ttl)
        self.max_block_bytes = max_block_bytes
        self._fast_chars = text_block_fast_limit(max_block_bytes)
        self._ring = ring
        self._window = window
        self._tap = tap
        self._clock = clock
        self._resolve: Any = None
        self._lock = threading.Lock()
        self._streams: dict[tuple[str | None, str], _Stream] = {}
        self._calls: dict[str, _CallStats] = {}
        # Terminals without a callId: remembered as the streams of one call that never ends.
        self._unattributed = _CallStats("none", 0.0)
        self._queue: deque[_Raw] = deque()
        self._queued = 0
        self._counts: dict[str, int] = {}
        self._throttled = itertools.count()  # the lock-free drop path counts here
        self._flushed: dict[str, int] = {}
        self._consumer: HubConsumer | None = None
        self._idle = False
        self._next_sweep = 0.0
        self._next_flush = 0.0

    # -- publishing (any thread) ----------------------------------------------------------

    def publish(
        self,
        item: PublishItem,
        *,
        task_id: str | None = None,
        state: PublishState = "running",
        conversation_id: str | None = None,
        tool_name: str = "ask_colleague",
        provisional: bool = False,
    ) -> None:
        """Queue one block for the sender (docs/contracts.md; guarantees: module docstring).

        ``provisional`` (terminal states only): do not end the stream now; end it with this
        terminal when its call ends if nothing ended it before (a colleague's question that
        the tool may return, or follow up on in the same call). Never raises, never blocks.
        """
        try:
            call = _current_tool_call()
            life: CallLife | None = None
            if call is not None:
                # resolve_call_id's context path, inline: this runs per block in tool code.
                _count_context()
                call_id: str | None = call.call_id
                room = call.conversation_id or conversation_id
                path = "context"
                life = call.life
            else:
                resolve = self._resolve
                if resolve is None:
                    resolve = self._resolve = _resolver()
                resolution = resolve(conversation_id, tool_name, tap=self._tap)
                call_id = resolution.call_id
                room = resolution.conversation_id
                path = str(resolution.path)
            if state == "running":
                if call_id is None:
                    self._count(UNATTRIBUTED)
                    return
                if room is None:
                    self._count(NO_ROOM)
                    return
                consumer = self._consumer
                if consumer is None:
                    self._count(NO_SENDER)
                    return
                if task_id is None:
                    task_id = call_id
                key = (call_id, task_id)
                now = self._clock()
                stream = self._streams.get(key)
                # The common drop needs no lock: the window only ever fills up, and an
                # accept is re-checked under the lock below.
                if stream is not None and now - stream.ring[stream.cursor] < self._window:
                    stream.dropped += 1
                    stream.call.dropped += 1
                    next(self._throttled)
                    return
                lock = self._lock
                lock.acquire()  # not ``with``: half the cost on CPython 3.11
                try:
                    if stream is None or stream.closed:  # else it is still the stream of key
                        stream = self._streams.get(key)
                        if stream is None:
                            stream = self._open(key, room, path, life)
                            if stream is None:
                                return
                    ring = stream.ring
                    cursor = stream.cursor
                    if now - ring[cursor] < self._window:
                        stream.dropped += 1
                        stream.call.dropped += 1
                        self._counts[THROTTLED] = self._counts.get(THROTTLED, 0) + 1
                        return
                    queue = self._queue
                    if len(queue) >= self.max_queue:
                        stream.dropped += 1
                        stream.call.dropped += 1
                        self._counts[QUEUE_FULL] = self._counts.get(QUEUE_FULL, 0) + 1
                        return
                    ring[cursor] = now
                    cursor += 1
                    stream.cursor = 0 if cursor == self._ring else cursor
                    stream.touched = now
                    if item.__class__ is str:
                        seq = stream.seq = stream.seq + 1
                    else:
                        seq = 0
                    queue.append((stream.room, call_id, task_id, state, _time_ns(), item, seq))
                    stream.sent += 1
                    stream.call.sent += 1
                    self._queued += 1
                finally:
                    lock.release()
                if self._idle:
                    self._idle = False
                    consumer._wake()
                return
            if state == "done" or state == "aborted":
                self._terminal(item, call_id, task_id, state, room, path, life, provisional)
                return
            self._count(INVALID)
            _rare(INVALID, "publish: unknown state %r; block dropped", state)
        except Exception:
            self._count(ERROR)
            _rare(ERROR, "publish failed; block dropped", exc_info=True)

    def tool_call_started(self, parent: LiveCall, child: LiveCall) -> None:
        """CallSink: a ``tool_call`` block (``payload.toolName``/``name``, ``callId`` of the
        child, status ``running``) on the parent's local stream. Never raises."""
        try:
            if parent.conversation_id is None:
                self._count(NO_ROOM)
                return
            self._running_direct(
                parent.call_id,
                parent.call_id,
                parent.conversation_id,
                _ToolCallItem(child.tool_name, child.call_id),
            )
        except Exception:
            self._count(ERROR)
            _rare(ERROR, "tool_call_started failed; block dropped", exc_info=True)

    def tool_call_ended(self, call: LiveCall, error: str | None) -> None:
        """CallSink: the call ended. Every open stream of it gets exactly one terminal — its
        provisional one if it has one, else ``aborted`` with ``error`` or a default message —
        and everything the hub held for the call is released; what is published for it
        afterwards is dropped (``closed``). Telling the hub twice is harmless (the
        instrumented runtime and the span processor may both tell it). Never raises."""
        try:
            call_id = call.call_id
            if call_id not in self._calls:
                # Most calls publish nothing. Without the lock: a stream opened by a publish
                # racing this end is the same as one opened just after it (under the lock).
                return
            with self._lock:
                stats = self._calls.get(call_id)
                if stats is None:
                    return
                if stats.life is not None:
                    stats.life.ended = True
                streams = list(stats.open.items())
            message = error if error else _DEFAULT_ABORT_MESSAGE
            for task_id, stream in streams:
                state, item = stream.provisional or ("aborted", message)
                self._terminal(item, call_id, task_id, state, stream.room, stats.path)
            with self._lock:
                if self._calls.get(call_id) is stats:
                    del self._calls[call_id]
            self._maybe_flush()
        except Exception:
            self._count(ERROR)
            _rare(ERROR, "tool_call_ended failed", exc_info=True)

    def call_attributes(self, call_id: str) -> Mapping[str, AttributeValue]:
        """CallSink: span attributes for ``call_id`` so far: blocks sent (let through by the
        rules) and dropped (at the worker), open streams, and how the callId was resolved.
        Empty when the hub knows nothing of the call. Never raises."""
        try:
            if call_id not in self._calls:  # no lock needed to learn there is nothing
                return {}
            with self._lock:
                stats = self._calls.get(call_id)
                if stats is None:
                    return {}
                return {
                    ATTR_BLOCKS_SENT: stats.sent,
                    ATTR_BLOCKS_DROPPED: stats.dropped,
                    ATTR_CALL_ID_PATH: stats.path,
                    ATTR_STREAMS: len(stats.open),
                }
        except Exception:
            return {}

    def publish_chat_event(
        self, event: Mapping[str, Any], *, conversation_id: str | None = None
    ) -> None:
        """Queue the kernel's ``chat_event`` snapshot for the room (the active call's
        conversation, else ``conversation_id``), ordered before blocks published after it.
        Not throttled. Never raises."""
        try:
            from kernel_ext.context import current_tool_call

            call = current_tool_call()
            room = (call.conversation_id if call is not None else None) or conversation_id
            if room is None:
                self._count(NO_ROOM)
                return
            if self._consumer is None:
                self._count(NO_SENDER)
                return
            with self._lock:
                if len(self._queue) >= self.max_queue:
                    self._counts[QUEUE_FULL] = self._counts.get(QUEUE_FULL, 0) + 1
                    return
                self._queue.append((room, None, "", "chat_event", 0, dict(event), 0))
            self._poke()
        except Exception:
            self._count(ERROR)
            _rare(ERROR, "publish_chat_event failed; event dropped", exc_info=True)

    # -- reading --------------------------------------------------------------------------

    def stats(self) -> HubStats:
        """Counts by reason and current sizes (also pushes pending counts to OTel)."""
        self._flush_metrics()
        with self._lock:
            self._fold_throttled()
            counts = dict(self._counts)
            counts["queued"] = self._queued
            return HubStats(
                counts=counts,
                streams=len(self._streams),
                calls=len(self._calls),
                closed=sum(len(c.closed) for c in self._calls.values())
                + len(self._unattributed.closed),
                queue=len(self._queue),
                consumer=self._consumer is not None,
            )

    @property
    def queue_size(self) -> int:
        """Blocks queued for the sender right now (cheap; no lock)."""
        return len(self._queue)

    def record_delivered(self, n: int = 1) -> None:
        """For senders: ``n`` blocks left this process (counted ``sent``)."""
        self._count(SENT, n)

    def record_dropped(self, reason: str, n: int = 1, call_id: str | None = None) -> None:
        """For senders: ``n`` blocks were dropped after the rules let them through
        (``disconnected``, ``rejected``, ``expired`` …); counted on ``call_id`` too while the
        hub still has its counters."""
        self._count(reason, n)
        if call_id is not None:
            with self._lock:
                stats = self._calls.get(call_id)
                if stats is not None:
                    stats.dropped += n

    # -- the consumer side (one sender, on one event loop) --------------------------------

    def consumer(self, loop: asyncio.AbstractEventLoop | None = None) -> HubConsumer:
        """Attach the one sender; from now on blocks are queued instead of ``no_sender``.

        ``loop`` is the event loop the consumer runs on (default: the running loop). Attaching
        a new consumer detaches the previous one (its :meth:`HubConsumer.get` then returns
        ``[]`` forever). Must not be called from tool code; may be called from any thread.
        """
        if loop is None:
            loop = asyncio.get_running_loop()
        new = HubConsumer(self, loop)
        with self._lock:
            old = self._consumer
            self._consumer = new
            self._idle = True
        if old is not None:
            old._closed = True
            old._wake()
        return new

    def _detach(self, consumer: HubConsumer, reason: str = NO_SENDER) -> int:
        """Detach ``consumer``; what was queued is dropped, counted ``reason``. Returns the
        number of terminals among it (logged at ERROR)."""
        with self._lock:
            if self._consumer is not consumer:
                return 0
            self._consumer = None
            lost = list(self._queue)
            self._queue.clear()
        terminals = sum(1 for raw in lost if raw[3] in ("done", "aborted"))
        if lost:
            self._count(reason, len(lost))
        if terminals:
            logger.error(
                "stream hub: sender detached; %d queued terminal(s) lost (%s)", terminals, reason
            )
        self._flush_metrics()
        return terminals

    def _take(self, max_items: int) -> list[Outgoing]:
        pop = self._queue.popleft
        out: list[Outgoing] = []
        append = out.append
        build = self._build
        new = object.__new__
        # The wire form of a running text block (the common block), inline: what _wire
        # builds for it, without its two calls per block.
        fast_chars = self._fast_chars
        try:
            for _ in range(max_items):
                raw = pop()
                room, call_id, task_id, state, ts_ns, item, seq = raw
                if (
                    state == "running"
                    and item.__class__ is str
                    and task_id.__class__ is str
                    and 0 < len(task_id) <= _MAX_TASK_ID
                    and (size := len(item) + len(task_id) * 2) <= fast_chars
                ):
                    block = new(OutgoingBlock)  # OutgoingBlock(...) without its __init__ call
                    block.room = room
                    block.block = {
                        "v": PROTOCOL_VERSION,
                        "callId": call_id,
                        "taskId": task_id,
                        "state": "running",
                        "ts": ts_ns // 1_000_000,
                        "envelope": {
                            "v": PROTOCOL_VERSION,
                            "kind": "text",
                            "streamKey": task_id,
                            "seq": seq,
                            "status": "running",
                            "payload": {"text": item},
                        },
                    }
                    block.call_id = call_id
                    block.task_id = task_id
                    block.terminal = False
                    block.size = size + 256
                    append(block)
                    continue
                built = build(raw)
                if built is not None:
                    append(built)
        except IndexError:  # the queue is empty
            pass
        now = self._clock()
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_EVERY
            self._sweep(now)
        if now >= self._next_flush:
            self._next_flush = now + _SWEEP_EVERY
            self._flush_metrics()
        return out

    # -- internals ------------------------------------------------------------------------

    def _count(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + n

    def _poke(self) -> None:
        consumer = self._consumer
        if consumer is not None and self._idle:
            self._idle = False
            consumer._wake()

    def _open(
        self, key: tuple[str, str], room: str, path: object, life: CallLife | None = None
    ) -> _Stream | None:
        """Open a stream (lock held); ``None`` (counted) when it or its call was closed, or
        over bounds."""
        counts = self._counts
        call_id, task_id = key
        stats = self._calls.get(call_id)
        if (life is not None and life.ended) or (stats is not None and task_id in stats.closed):
            counts[CLOSED] = counts.get(CLOSED, 0) + 1
            if stats is not None:
                stats.dropped += 1
            return None
        if len(self._streams) >= self.max_streams:
            counts[STREAM_LIMIT] = counts.get(STREAM_LIMIT, 0) + 1
            _rare(STREAM_LIMIT, "stream hub: %d streams open; block dropped", self.max_streams)
            return None
        now = self._clock()
        if stats is None:
            stats = self._new_call(call_id, str(path), now)
        if life is not None:
            stats.life = life
        stream = _Stream(room, stats, self._ring, now)
        self._streams[key] = stream
        stats.open[task_id] = stream
        return stream

    def _new_call(self, call_id: str, path: str, now: float) -> _CallStats:
        """State for a call (lock held); the oldest call's is forgotten when at the bound."""
        if len(self._calls) >= self.max_calls:
            oldest = next(iter(self._calls))
            old = self._calls.pop(oldest)
            for task_id in old.open:
                gone = self._streams.pop((oldest, task_id), None)
                if gone is not None:
                    gone.closed = True
            self._counts[CALL_LIMIT] = self._counts.get(CALL_LIMIT, 0) + 1
            _rare(
                CALL_LIMIT,
                "stream hub: %d live calls with state; the oldest (%s) forgotten",
                self.max_calls,
                oldest,
            )
        stats = self._calls[call_id] = _CallStats(path, now)
        return stats

    def _running_direct(self, call_id: str, task_id: str, room: str, item: Any) -> None:
        """A running block whose attribution is already known (the span processor)."""
        consumer = self._consumer
        if consumer is None:
            self._count(NO_SENDER)
            return
        key = (call_id, task_id)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._open(key, room, "context")
                if stream is None:
                    return
            now = self._clock()
            cursor = stream.cursor
            if now - stream.ring[cursor] < self._window:
                stream.dropped += 1
                stream.call.dropped += 1
                self._counts[THROTTLED] = self._counts.get(THROTTLED, 0) + 1
                return
            if len(self._queue) >= self.max_queue:
                stream.dropped += 1
                stream.call.dropped += 1
                self._counts[QUEUE_FULL] = self._counts.get(QUEUE_FULL, 0) + 1
                return
            stream.ring[cursor] = now
            stream.cursor = (cursor + 1) % self._ring
            stream.touched = now
            stream.seq += 1
            self._queue.append(
                (stream.room, call_id, task_id, "running", time.time_ns(), item, stream.seq)
            )
            stream.sent += 1
            stream.call.sent += 1
            self._queued += 1
        self._poke()

    def _terminal(
        self,
        item: Any,
        call_id: str | None,
        task_id: str | None,
        state: str,
        room: str | None,
        path: str,
        life: CallLife | None = None,
        provisional: bool = False,
    ) -> None:
        if task_id is None:
            task_id = call_id
        if task_id is None:
            self._count(NO_TASK_ID)
            _rare(NO_TASK_ID, "publish: %s block with neither callId nor task id dropped", state)
            return
        if room is None:
            self._count(NO_ROOM)
            _rare(NO_ROOM, "publish: %s block for task %r has no room; dropped", state, task_id)
            return
        key = (call_id, task_id)
        with self._lock:
            counts = self._counts
            if call_id is None:
                stats: _CallStats | None = self._unattributed
                provisional = False  # no call end will come to send it later
            else:
                stats = self._calls.get(call_id)
            if stats is not None and task_id in stats.closed:
                counts[DUPLICATE_TERMINAL] = counts.get(DUPLICATE_TERMINAL, 0) + 1
                stats.dropped += 1
                return
            if life is not None and life.ended:
                counts[CLOSED] = counts.get(CLOSED, 0) + 1
                return
            stream = self._streams.get(key)
            if provisional:
                if stream is None:
                    stream = self._open(key, room, path, life)  # type: ignore[arg-type]
                    if stream is None:
                        return
                stream.provisional = (state, item)
                return
            if stream is not None:
                del self._streams[key]
                stream.closed = True
                stats = stream.call
                stats.open.pop(task_id, None)
                seq = stream.seq + 1
                room = stream.room
            else:
                seq = 1
                if stats is None and call_id is not None:
                    stats = self._new_call(call_id, path, self._clock())
            if stats is not None:
                if life is not None:
                    stats.life = life
                self._remember_closed(stats, task_id)
            if self._consumer is None:
                counts[NO_SENDER] = counts.get(NO_SENDER, 0) + 1
                if stats is not None:
                    stats.dropped += 1
                return
            # Terminals bypass the queue bound: their number is bounded by the streams.
            self._queue.append((room, call_id, task_id, state, time.time_ns(), item, seq))
            if stats is not None:
                stats.sent += 1
            self._queued += 1
        self._poke()

    def _remember_closed(self, stats: _CallStats, task_id: str) -> None:
        closed = stats.closed
        closed[task_id] = None
        if len(closed) > self.max_closed_per_call:
            del closed[next(iter(closed))]

    def _sweep(self, now: float) -> None:
        """End idle streams of calls whose end never came, and forget idle empty calls
        (consumer side, about once a second)."""
        with self._lock:
            idle_before = now - self.stream_idle_ttl
            stale = [
                (key, stream.room, stream.call.path, stream.provisional)
                for key, stream in self._streams.items()
                if stream.touched < idle_before
            ]
            # A call that closed streams is remembered until it ends (or the call bound).
            calls_stale = [
                stale_id
                for stale_id, stats in self._calls.items()
                if not stats.open and not stats.closed and stats.touched < idle_before
            ]
            for stale_id in calls_stale:
                del self._calls[stale_id]
        for (call_id, task_id), room, path, provisional in stale:
            end: tuple[str, Any] = provisional or ("aborted", _IDLE_ABORT_MESSAGE)
            self._terminal(end[1], call_id, task_id, end[0], room, path)
        if stale:
            self._count(EXPIRED, len(stale))
            _rare(
                EXPIRED,
                "stream hub: %d stream(s) idle for %g s ended (their call's end never came)",
                len(stale),
                self.stream_idle_ttl,
                level=logging.INFO,
            )

    def _fold_throttled(self) -> None:
        """Move the lock-free throttle ticks into ``_counts`` (lock held). An increment that
        races the swap may be lost; every other one is counted once."""
        ticks, self._throttled = self._throttled, itertools.count()
        n = next(ticks)
        if n:
            self._counts[THROTTLED] = self._counts.get(THROTTLED, 0) + n

    def _flush_metrics(self) -> None:
        try:
            with self._lock:
                self._fold_throttled()
                counts = dict(self._counts)
            for reason, total in counts.items():
                delta = total - self._flushed.get(reason, 0)
                if delta <= 0 or reason == "queued":
                    continue
                self._flushed[reason] = total
                if reason == SENT:
                    metrics.blocks.add(delta, {"outcome": "sent"})
                elif reason == DEGRADED:
                    metrics.blocks.add(delta, {"outcome": "degraded"})
                else:
                    metrics.blocks.add(delta, {"outcome": "dropped", "reason": reason})
        except Exception:
            pass

    def _maybe_flush(self) -> None:
        now = self._clock()
        if now >= self._next_flush:
            self._next_flush = now + _SWEEP_EVERY
            self._flush_metrics()

    def _build(self, raw: Any) -> Outgoing | None:
        """Turn a queued tuple into an :class:`Outgoing` (consumer side); never raises."""
        room, call_id, task_id, state, ts_ns, item, seq = raw
        if state == "chat_event":
            return OutgoingChatEvent(room, item)
        terminal = state != "running"
        try:
            block, size = self._wire(call_id, task_id, state, ts_ns // 1_000_000, item, seq)
        except (DecodeError, ValueError, TypeError) as exc:
            if not terminal:
                reason = TOO_LARGE if isinstance(exc, BlockTooLargeError) else INVALID
                self._count(reason)
                self._drop_on_call(call_id)
                _rare(reason, "publish: running block of task %r dropped: %s", task_id, exc)
                return None
            rebuilt = self._degraded_terminal(call_id, task_id, state, ts_ns, seq, exc)
            if rebuilt is None:
                return None
            block, size = rebuilt
        except Exception:
            self._count(ERROR)
            _rare(ERROR, "stream hub: could not build a block", exc_info=True)
            return None
        return OutgoingBlock(room, block, call_id, task_id, terminal, size)

    def _drop_on_call(self, call_id: str | None) -> None:
        if call_id is None:
            return
        with self._lock:
            stats = self._calls.get(call_id)
            if stats is not None:
                stats.sent -= 1
                stats.dropped += 1

    def _degraded_terminal(
        self, call_id: str | None, task_id: str, state: str, ts_ns: int, seq: int, exc: Exception
    ) -> tuple[dict[str, Any], int] | None:
        self._count(DEGRADED)
        _rare(DEGRADED, "publish: %s block of task %r rebuilt: %s", state, task_id, exc)
        try:
            wire = fallback_terminal(
                call_id,
                str(task_id),
                "done" if state == "done" else "aborted",
                ts_ns // 1_000_000,
                seq,
                too_large=isinstance(exc, BlockTooLargeError),
            )
            Block.model_validate(wire)
            return wire, len(repr(wire))
        except Exception:
            self._count(ERROR)
            _rare(ERROR, "stream hub: terminal of task %r lost", task_id, exc_info=True)
            return None

    def _wire(
        self, call_id: str | None, task_id: str, state: str, ts: int, item: Any, seq: int
    ) -> tuple[dict[str, Any], int]:
        """The wire dict of one block, within the size bound (payload strings cut with the
        marker when needed), and an estimate of its encoded size in characters; validated
        unless built here from trusted parts."""
        if item.__class__ is str and 0 < len(task_id) <= _MAX_TASK_ID:
            wire = text_block(call_id, task_id, state, ts, seq, item)
            if len(item) + len(task_id) * 2 <= self._fast_chars:
                return wire, len(item) + len(task_id) * 2 + 256
            Block.model_validate(wire)
            return self._bounded(wire)
        if isinstance(item, _ToolCallItem):
            envelope: dict[str, Any] = {
                "v": PROTOCOL_VERSION,
                "kind": "tool_call",
                "streamKey": task_id,
                "seq": seq,
                "status": "running",
                "payload": {
                    "toolName": item.tool_name,
                    "name": item.tool_name,
                    "callId": item.call_id,
                },
            }
        elif isinstance(item, Envelope):
            envelope = item.model_dump(by_alias=True, mode="json")
        elif isinstance(item, Mapping):
            envelope = decode_envelope(item).model_dump(by_alias=True, mode="json")
        elif isinstance(item, str):  # a task id the fast path does not take: validated below
            envelope = text_block(call_id, task_id, state, ts, seq, item)["envelope"]
        else:
            raise DecodeError(
                f"invalid item: expected Envelope, mapping or str, got {type(item).__name__}"
            )
        wire = {
            "v": PROTOCOL_VERSION,
            "callId": call_id,
            "taskId": task_id,
            "state": state,
            "ts": ts,
            "envelope": envelope,
        }
        Block.model_validate(wire)
        return self._bounded(wire)

    def _bounded(self, wire: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """``wire`` (a valid block) within the size bound: cut in place when over it."""
        if fits(wire, self.max_block_bytes):
            return wire, len(repr(wire))
        encoded = encode_wire(wire, max_bytes=self.max_block_bytes)
        return wire, len(encoded)


class HubConsumer:
    """The sender's end of a :class:`StreamHub`: :meth:`get` batches of outgoing items.

    Runs on one event loop. A publisher on another thread wakes it only when it is idle
    (one ``call_soon_threadsafe`` per idle→busy transition, not per block).
    """

    def __init__(self, hub: StreamHub, loop: asyncio.AbstractEventLoop) -> None:
        self._hub = hub
        self._loop = loop
        self._event = asyncio.Event()
        self._loop_thread: int | None = None
        self._closed = False
        self._poked = False

    @property
    def hub(self) -> StreamHub:
        """The hub this consumer takes from."""
        return self._hub

    @property
    def closed(self) -> bool:
        """Whether this consumer was detached (by :meth:`close` or a newer consumer)."""
        return self._closed

    async def get(self, max_items: int = 256) -> list[Outgoing]:
        """Wait for and return up to ``max_items`` items in publish order; ``[]`` when
        :meth:`poke` was called or the consumer is closed."""
        hub = self._hub
        self._loop_thread = threading.get_ident()
        while True:
            if self._closed:
                return []
            items = hub._take(max_items)
            if items:
                return items
            if self._poked:
                self._poked = False
                return []
            hub._idle = True
            if hub._queue or self._poked or self._closed:
                hub._idle = False
                continue
            await self._event.wait()
            self._event.clear()

    def take_nowait(self, max_items: int = 256) -> list[Outgoing]:
        """What is queued now (up to ``max_items``), without waiting."""
        return [] if self._closed else self._hub._take(max_items)

    def poke(self) -> None:
        """Make a waiting :meth:`get` return (``[]`` if nothing is queued); loop thread only."""
        self._poked = True
        self._event.set()

    def close(self, reason: str = NO_SENDER) -> int:
        """Detach from the hub: later blocks count ``no_sender``; queued ones are dropped,
        counted ``reason``. Returns how many of those were terminals."""
        lost = 0
        if not self._closed:
            self._closed = True
            lost = self._hub._detach(self, reason)
            self._wake()
        return lost

    def _wake(self) -> None:
        try:
            if threading.get_ident() == self._loop_thread:
                self._event.set()
            else:
                self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


# -- the default hub and the module-level API ---------------------------------------------

_default_hub: StreamHub | None = None
_default_lock = threading.Lock()


def get_default_hub() -> StreamHub:
    """The process-wide hub (made on first use with the defaults)."""
    global _default_hub
    hub = _default_hub
    if hub is None:
        with _default_lock:
            if _default_hub is None:
                _default_hub = StreamHub()
            hub = _default_hub
    return hub


def set_default_hub(hub: StreamHub | None) -> StreamHub | None:
    """Install ``hub`` as the process-wide hub (``None``: a fresh default on next use);
    returns the previous one."""
    global _default_hub
    with _default_lock:
        previous, _default_hub = _default_hub, hub
    return previous


def publish(
    item: PublishItem,
    *,
    task_id: str | None = None,
    state: PublishState = "running",
    conversation_id: str | None = None,
    tool_name: str = "ask_colleague",
    provisional: bool = False,
) -> None:
    """Publish one block through the default hub (:meth:`StreamHub.publish`).

    ``item``: an :class:`~kernel_ext.protocol.Envelope` or envelope mapping (passed
    through; a mapping is validated off the hot path, invalid → dropped, counted
    ``invalid``), or a ``str`` (running → pseudo-envelope text, done → ``payload.text``,
    aborted → ``payload.message``). ``task_id`` ``None`` → the callId. ``provisional``
    (``done``/``aborted`` only): the stream's terminal if its call ends before anything
    else ends the stream. Never raises, never blocks.
    """
    hub = _default_hub
    if hub is None:
        hub = get_default_hub()
    hub.publish(
        item,
        task_id=task_id,
        state=state,
        conversation_id=conversation_id,
        tool_name=tool_name,
        provisional=provisional,
    )


def publish_chat_event(event: Mapping[str, Any], *, conversation_id: str | None = None) -> None:
    """Queue the kernel's ``chat_event`` snapshot through the default hub
    (:meth:`StreamHub.publish_chat_event`). Never raises."""
    hub = _default_hub
    if hub is None:
        hub = get_default_hub()
    hub.publish_chat_event(event, conversation_id=conversation_id)
