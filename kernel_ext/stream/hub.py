"""The stream hub: per-stream rules and the queue between publishers and one sender.

:class:`StreamHub` keeps every guarantee listed in :mod:`kernel_ext.stream` (in full:
docs/contracts.md, "Publishing"). It is one class of about 550 lines, and one module, on
purpose: its methods share one lock and one state (open streams, live calls, the queue),
and each rule that touches that state — attribution and admission on publish, the one
terminal per stream, the call's end, idle streams — is written once, here, under that lock.
Building what is queued, and counting, live in :mod:`.outgoing` and :mod:`.block_counts`.
:class:`SenderPort`, the sender's port (take, wait, report), is here too: it shares the
hub's state (the queue, the idle flag, the detach).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from kernel_ext.attribution.resolve import CONTEXT, attribute, count_context
from kernel_ext.attribution.tap import LiveCall, default_tap
from kernel_ext.context import CallLife, ToolCall, current_tool_call
from kernel_ext.errors import check_positive_ints, check_positive_numbers
from kernel_ext.observability import count_names
from kernel_ext.observability._rare_log import RareLog
from kernel_ext.protocol import (
    DEFAULT_MAX_BLOCK_BYTES,
    Envelope,
    text_block_fast_limit,
    trace_id_hex,
)
from kernel_ext.stop import STOPPED_MESSAGE
from kernel_ext.stream.block_counts import Counts
from kernel_ext.stream.outgoing import (
    CHAT_EVENT_STATE,
    Outgoing,
    Progress,
    QueueItem,
    Stopped,
    ToolCallItem,
    take,
)
from kernel_ext.stream.state import CallState, HubStats, StreamState
from kernel_ext.worker import _fork

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

    from kernel_ext.attribution.tap import Tap

__all__ = [
    "ATTR_BLOCKS_ADMITTED",
    "ATTR_BLOCKS_DROPPED",
    "ATTR_CALL_ID_PATH",
    "ATTR_STREAMS",
    "HubStats",
    "PublishItem",
    "PublishState",
    "SenderPort",
    "StreamHub",
]

logger = logging.getLogger("kernel_ext.stream")
_rare = RareLog(logger)

ATTR_BLOCKS_ADMITTED = "kernel_ext.stream.blocks_admitted"
ATTR_BLOCKS_DROPPED = "kernel_ext.stream.blocks_dropped"
ATTR_CALL_ID_PATH = "kernel_ext.call_id.path"
ATTR_STREAMS = "kernel_ext.stream.streams"

PublishState = Literal["running", "done", "aborted"]
PublishItem = Envelope | Mapping[str, Any] | Progress | str

_current_tool_call = current_tool_call  # ContextVar.get: a C call
_wall_time = time.time
_DEFAULT_ABORT_MESSAGE = "the tool call ended before its stream did"
_RETURNED_TEXT = "the tool call finished"  # docs/tool-authors.md, docs/protocol.md
_IDLE_ABORT_MESSAGE = "the stream was idle too long; its tool call's end was never seen"
_MAX_RING = 1024
_SWEEP_EVERY = 1.0


def _result_text(result: object) -> str:
    """The ``done`` text of a call that returned ``result`` (:meth:`StreamHub.
    tool_call_returned` says which). Runs no code of ``result``'s but its ``content``
    attribute (an exception from that gives the neutral text); never raises. A long text is
    cut to the block size bound when the block is built, like any block's."""
    try:
        text = result if isinstance(result, str) else getattr(result, "content", None)
        if isinstance(text, str) and text:
            return str.__str__(text)  # a plain str (of a subclass too), no code of its own
    except Exception:
        pass
    return _RETURNED_TEXT


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
        stream_idle_ttl: seconds after which an idle open stream is ended (default 900).
        max_block_bytes: the size bound of one encoded block (truncated beyond).
        tap: the tap for near-match attribution (default: the process-wide tap).
        clock: the monotonic clock of the throttle and the idle bound (tests pass a fake).

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
        self._fresh_state()
        _fork.reset_in_child(self._reset_after_fork)

    def _fresh_state(self) -> None:
        """The hub's lock, counts, streams, calls and queue, new and empty."""
        self._lock = threading.Lock()
        self._counts = Counts(self._lock)
        self._tick_throttled = self._counts.tick_throttled
        self._streams: dict[tuple[str | None, str], StreamState] = {}
        self._calls: dict[str, CallState] = {}
        # Terminals without a callId: remembered as the streams of one call that never ends.
        self._unattributed = CallState("none", 0.0)
        self._queue: deque[QueueItem] = deque()
        self._port: SenderPort | None = None
        self._idle = False
        self._next_sweep = 0.0
        self._next_flush = 0.0

    def _reset_after_fork(self) -> None:
        """In a forked child: start empty. What the parent queued, its streams and calls
        are the parent's to send and end (not sent twice); its sender is not the child's
        (the plugin attaches the child's own)."""
        self._fresh_state()

    # -- publishing (any thread) ----------------------------------------------------------

    def publish(
        self,
        item: PublishItem,
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
            # resolve.attribute is the rule; its first case (the active call) is taken here
            # without the call: one more Python call per block is dear on this path.
            call = _current_tool_call()
            if call is not None:
                count_context()
                call_id: str | None = call.call_id
                room = call.conversation_id or conversation_id
                path = CONTEXT
                life: CallLife | None = call.life
            else:
                call_id, room, path, call = attribute(conversation_id, tool_name, self._tap)
                life = None
            if state == "running":
                if call_id is None:
                    self._counts.add(count_names.UNATTRIBUTED)
                    return
                if room is None:
                    self._counts.add(count_names.NO_ROOM)
                    return
                port = self._port
                if port is None:
                    self._counts.add(count_names.NO_SENDER)
                    return
                if task_id is None:
                    task_id = call_id
                key = (call_id, task_id)
                now = self._clock()
                stream = self._streams.get(key)
                # The common drop needs no lock: _admit's window test, read without it (the
                # window only ever fills up; an admission is decided under the lock).
                if stream is not None and now - stream.ring[stream.cursor] < self._window:
                    stream.call.dropped += 1
                    self._tick_throttled()
                    return
                lock = self._lock
                lock.acquire()  # not ``with``: half the cost on CPython 3.11
                try:
                    if stream is None or stream.closed:  # else it is still the stream of key
                        stream = self._streams.get(key)
                        if stream is None:
                            trace = self._trace_of(call, call_id)
                            stream = self._open(key, room, path, life, trace)
                            if stream is None:
                                return
                    if not self._admit(stream, now):
                        return
                    stream.ours = False  # the tool publishes on it: its stream from now on
                    # A caller-made envelope (a pseudo-envelope, a progress report): its
                    # seq is the stream's.
                    if item.__class__ is str or item.__class__ is Progress:
                        seq = stream.seq = stream.seq + 1
                    else:
                        seq = 0
                    self._queue.append(
                        (stream.room, call_id, task_id, state, now, item, seq, stream.trace_id)
                    )
                finally:
                    lock.release()
                if self._idle:
                    self._idle = False
                    port._wake()
                return
            if state == "done" or state == "aborted":
                trace = None if call_id is None else self._trace_of(call, call_id)
                self._terminal(item, call_id, task_id, state, room, path, life, provisional, trace)
                return
            self._counts.add(count_names.INVALID)
            _rare(count_names.INVALID, "publish: unknown state %r; block dropped", state)
        except Exception:
            self._counts.add(count_names.ERROR)
            _rare(count_names.ERROR, "publish failed; block dropped", exc_info=True)

    def publish_chat_event(
        self, event: Mapping[str, Any], *, conversation_id: str | None = None
    ) -> None:
        """Queue the kernel's ``chat_event`` snapshot for the room (the active call's
        conversation, else ``conversation_id``), ordered before blocks published after it.
        Not throttled. Never raises."""
        try:
            call = _current_tool_call()
            room = (call.conversation_id if call is not None else None) or conversation_id
            if room is None:
                self._counts.add(count_names.NO_ROOM)
                return
            if self._port is None:
                self._counts.add(count_names.NO_SENDER)
                return
            with self._lock:
                if len(self._queue) >= self.max_queue:
                    self._counts.add_locked(count_names.QUEUE_FULL)
                    return
                self._queue.append((room, None, "", CHAT_EVENT_STATE, 0, dict(event), 0, None))
            self._poke()
        except Exception:
            self._counts.add(count_names.ERROR)
            _rare(count_names.ERROR, "publish_chat_event failed; event dropped", exc_info=True)

    # -- the span processor's and the instrumented runtime's side (tap.CallSink) ----------

    def tool_call_started(self, parent: LiveCall, child: LiveCall) -> None:
        """CallSink: a ``tool_call`` block (``payload.toolName``/``name``, ``callId`` of the
        child, status ``running``) on the parent's local stream, numbered by its counter
        (the one the tool's text and progress reports take theirs from). A local stream
        opened here is the hub's until the tool publishes on it: its terminal then follows
        the call's outcome (:meth:`tool_call_returned`). Never raises."""
        try:
            if parent.conversation_id is None:
                self._counts.add(count_names.NO_ROOM)
                return
            if self._port is None:
                self._counts.add(count_names.NO_SENDER)
                return
            key = (parent.call_id, parent.call_id)
            with self._lock:
                stream = self._streams.get(key)
                if stream is None:
                    trace = trace_id_hex(parent.trace_id)
                    stream = self._open(key, parent.conversation_id, "context", None, trace)
                    if stream is None:
                        return
                    stream.ours = True
                now = self._clock()
                if not self._admit(stream, now):
                    return
                stream.seq += 1
                item = ToolCallItem(child.tool_name, child.call_id)
                self._queue.append(
                    (stream.room, *key, "running", now, item, stream.seq, stream.trace_id)
                )
            self._poke()
        except Exception:
            self._counts.add(count_names.ERROR)
            _rare(count_names.ERROR, "tool_call_started failed; block dropped", exc_info=True)

    def tool_call_ended(self, call: LiveCall, error: str | None) -> None:
        """CallSink: the call ended — failed with ``error`` (``""``: without a message), or
        returned when ``error`` is ``None`` (as :meth:`tool_call_returned` without a
        result). Every open stream of the call gets exactly one terminal:

        1. its provisional terminal, if the tool left one (``publish(..., provisional=True)``);
        2. the call failed: ``aborted`` with ``error`` (the default message when empty);
        3. the stream this hub opened for the call's nested tool calls
           (:meth:`tool_call_started`), with nothing of the tool's on it: ``done`` with the
           call's result text (``"the tool call finished"`` without one);
        4. any other stream (the tool's own, left open): ``aborted`` with the default
           message, "the tool call ended before its stream did".

        Everything the hub held for the call is released; what is published for it
        afterwards is dropped (``closed``). Telling the hub twice is harmless (the
        instrumented runtime and the span processor may both tell it). Never raises."""
        self._end_call(call.call_id, error, None)

    def tool_call_returned(self, call: LiveCall, result: object) -> None:
        """The call returned ``result`` (what its code returned; the optional member of
        :class:`~kernel_ext.attribution.tap.CallSink`): :meth:`tool_call_ended` with ``error``
        ``None``, the ``done`` text being ``result`` when it is a non-empty ``str``, else a chat
        message's non-empty ``str`` ``content`` (LangChain's ``ToolMessage``), else
        ``"the tool call finished"``. Never raises, whatever ``result`` is."""
        self._end_call(call.call_id, None, result)

    def tool_call_stopped(self, call: LiveCall) -> None:
        """The user stopped the call (:func:`kernel_ext.stop_call`; the optional member of
        :class:`~kernel_ext.attribution.tap.CallSink`): every open stream of the call —
        provisional terminal or not — ends with one ``aborted`` block whose payload is
        ``{message: "stopped by the user", stopped: true}``. What the call's code publishes
        as a terminal once it was asked to stop reads so too. Never raises."""
        self._end_call(call.call_id, STOPPED_MESSAGE, None, stopped=True)

    def _end_call(
        self, call_id: str, error: str | None, result: object, stopped: bool = False
    ) -> None:
        """The call's end (the rule: :meth:`tool_call_ended`)."""
        try:
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
                streams = [
                    (task_id, stream.room, stream.provisional, stream.ours)
                    for task_id, stream in stats.open.items()
                ]
            text: str | None = None
            item: Any
            for task_id, room, provisional, ours in streams:
                if stopped:
                    state, item = "aborted", Stopped(STOPPED_MESSAGE)
                elif provisional is not None:
                    state, item = provisional
                elif error is not None:
                    state, item = "aborted", error or _DEFAULT_ABORT_MESSAGE
                elif ours:
                    if text is None:
                        text = _result_text(result)
                    state, item = "done", text
                else:
                    state, item = "aborted", _DEFAULT_ABORT_MESSAGE
                self._terminal(item, call_id, task_id, state, room, stats.path)
            with self._lock:
                if self._calls.get(call_id) is stats:
                    del self._calls[call_id]
            self._maybe_flush()
        except Exception:
            self._counts.add(count_names.ERROR)
            _rare(count_names.ERROR, "tool_call_ended failed", exc_info=True)

    def call_attributes(self, call_id: str) -> Mapping[str, AttributeValue]:
        """CallSink: span attributes for ``call_id`` so far: blocks admitted (let through by
        the rules) and dropped (at the worker, before or after admission), open streams, and
        how the callId was resolved. Empty when the hub knows nothing of the call. Never
        raises."""
        try:
            if call_id not in self._calls:  # no lock needed to learn there is nothing
                return {}
            with self._lock:
                stats = self._calls.get(call_id)
                if stats is None:
                    return {}
                return {
                    ATTR_BLOCKS_ADMITTED: stats.admitted,
                    ATTR_BLOCKS_DROPPED: stats.dropped,
                    ATTR_CALL_ID_PATH: stats.path,
                    ATTR_STREAMS: len(stats.open),
                }
        except Exception:
            return {}

    # -- the sender's side ----------------------------------------------------------------

    def attach_sender(self, loop: asyncio.AbstractEventLoop | None = None) -> SenderPort:
        """Attach the one sender; from now on blocks are queued instead of ``no_sender``.

        ``loop`` is the event loop the sender runs on (default: the running loop). Attaching
        a new sender detaches the previous one (its :meth:`SenderPort.get` then returns
        ``[]`` forever). Must not be called from tool code; may be called from any thread.
        """
        if loop is None:
            loop = asyncio.get_running_loop()
        new = SenderPort(self, loop)
        with self._lock:
            old = self._port
            self._port = new
            self._idle = True
        if old is not None:
            old._closed = True
            old._wake()
        return new

    def open_streams(self, limit: int) -> list[tuple[str, str, str, int]]:
        """The open streams a relay may know of, newest first, at most ``limit``:
        ``(room, callId, taskId, seq)`` of each stream with a callId on which a running
        block was let through, ``seq`` the highest this hub numbered its blocks with (0 when
        they all carried the peer's own envelope). What a sender announces on a new
        connection. Takes the lock."""
        found: list[tuple[str, str, str, int]] = []
        with self._lock:
            for (call_id, task_id), stream in reversed(self._streams.items()):
                if len(found) >= limit:
                    break
                # ring[cursor - 1]: the latest admission's time (-inf: none yet; a stream
                # opened for a provisional terminal alone has sent nothing).
                if call_id is None or stream.ring[stream.cursor - 1] == -math.inf:
                    continue
                found.append((stream.room, call_id, task_id, stream.seq))
        return found

    @property
    def queue_size(self) -> int:
        """Blocks queued for the sender right now (cheap; no lock)."""
        return len(self._queue)

    def record_delivered(self, n: int = 1) -> None:
        """``n`` blocks left this process (counted ``delivered``); a sender reports this on
        its port, :meth:`SenderPort.delivered`."""
        self._counts.add(count_names.DELIVERED, n)

    def record_dropped(self, reason: str, n: int = 1, call_id: str | None = None) -> None:
        """``n`` blocks will not reach a browser, counted ``reason`` — and on ``call_id`` too
        while the hub still holds that call; a sender reports this on its port,
        :meth:`SenderPort.dropped`."""
        with self._lock:
            self._counts.add_locked(reason, n)
            stats = self._calls.get(call_id) if call_id is not None else None
            if stats is not None:
                stats.dropped += n

    def stats(self) -> HubStats:
        """Counts and current sizes (also pushes pending counts to OpenTelemetry)."""
        self._counts.flush_metrics()
        with self._lock:
            return HubStats(
                counts=self._counts.snapshot(),
                streams=len(self._streams),
                calls=len(self._calls),
                closed=sum(len(c.closed) for c in self._calls.values())
                + len(self._unattributed.closed),
                queue=len(self._queue),
                consumer=self._port is not None,
            )

    def _detach(self, port: SenderPort, reason: str = count_names.NO_SENDER) -> int:
        """Detach ``port``; what was queued is dropped, counted ``reason``. Returns the
        number of terminals among it (logged at ERROR)."""
        with self._lock:
            if self._port is not port:
                return 0
            self._port = None
            lost = list(self._queue)
            self._queue.clear()
            if lost:
                self._counts.add_locked(reason, len(lost))
        terminals = sum(1 for queued in lost if queued[3] in ("done", "aborted"))
        if terminals:
            logger.error(
                "stream hub: sender detached; %d queued terminal(s) lost (%s)", terminals, reason
            )
        self._counts.flush_metrics()
        return terminals

    def _take(self, max_items: int) -> list[Outgoing]:
        """Up to ``max_items`` queued items, built (the sender's :meth:`SenderPort.get`);
        also ends idle streams and flushes counts, about once a second."""
        now = self._clock()
        out = take(
            self._queue,
            max_items,
            self.max_block_bytes,
            self._fast_chars,
            self.record_dropped,
            _wall_time() - now,
        )
        if now >= self._next_sweep:
            self._next_sweep = now + _SWEEP_EVERY
            self._sweep(now)
        self._maybe_flush(now)
        return out

    # -- the rules (lock held unless said otherwise) --------------------------------------

    def _admit(self, stream: StreamState, now: float) -> bool:
        """T4 and the queue bound for one running block of ``stream``: admitted (counted on
        the hub and the call), or dropped (``throttled``/``queue_full``, counted)."""
        ring = stream.ring
        cursor = stream.cursor
        if now - ring[cursor] < self._window:
            self._drop_locked(count_names.THROTTLED, stream.call)
            return False
        if len(self._queue) >= self.max_queue:
            self._drop_locked(count_names.QUEUE_FULL, stream.call)
            return False
        ring[cursor] = now
        cursor += 1
        stream.cursor = 0 if cursor == self._ring else cursor
        stream.touched = now
        stream.call.admitted += 1
        self._counts.admitted += 1
        return True

    def _drop_locked(self, reason: str, stats: CallState | None) -> None:
        self._counts.add_locked(reason)
        if stats is not None:
            stats.dropped += 1

    def _trace_of(self, call: ToolCall | None, call_id: str) -> str | None:
        """The ``traceId`` of the blocks of ``call_id``: the active call's (``call``), else
        that of the tap's live call of that id; ``None`` when unknown or not sampled. Asked
        when a stream opens (and for a terminal), never per block."""
        if call is not None:
            return trace_id_hex(call.trace_id)
        live = (self._tap if self._tap is not None else default_tap()).get(call_id)
        return None if live is None else trace_id_hex(live.trace_id)

    def _open(
        self,
        key: tuple[str, str],
        room: str,
        path: str,
        life: CallLife | None = None,
        trace_id: str | None = None,
    ) -> StreamState | None:
        """Open a stream; ``None`` (counted) when it or its call was closed, or over bounds.
        ``trace_id``: the call's traceId, if the call has none yet (the first one stays)."""
        call_id, task_id = key
        stats = self._calls.get(call_id)
        if (life is not None and life.ended) or (stats is not None and task_id in stats.closed):
            self._drop_locked(count_names.CLOSED, stats)
            return None
        if len(self._streams) >= self.max_streams:
            self._drop_locked(count_names.STREAM_LIMIT, stats)
            _rare(
                count_names.STREAM_LIMIT,
                "stream hub: %d streams open; block dropped",
                self.max_streams,
            )
            return None
        now = self._clock()
        if stats is None:
            stats = self._new_call(call_id, path, now)
        if life is not None:
            stats.life = life
        if stats.trace_id is None:
            stats.trace_id = trace_id
        stream = StreamState(room, stats, self._ring, now)
        self._streams[key] = stream
        stats.open[task_id] = stream
        return stream

    def _new_call(self, call_id: str, path: str, now: float) -> CallState:
        """State for a call; the oldest call's is forgotten when at the bound."""
        if len(self._calls) >= self.max_calls:
            oldest = next(iter(self._calls))
            old = self._calls.pop(oldest)
            for task_id in old.open:
                gone = self._streams.pop((oldest, task_id), None)
                if gone is not None:
                    gone.closed = True
            self._counts.add_locked(count_names.CALL_LIMIT)
            _rare(
                count_names.CALL_LIMIT,
                "stream hub: %d live calls with state; the oldest (%s) forgotten",
                self.max_calls,
                oldest,
            )
        stats = self._calls[call_id] = CallState(path, now)
        return stats

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
        trace_id: str | None = None,
    ) -> None:
        """The one terminal of a stream (takes the lock): queued once, or dropped
        (``duplicate_terminal``, ``closed``, …); kept aside when ``provisional``. It carries
        the call's traceId (``trace_id`` when the hub holds none for the call)."""
        if task_id is None:
            task_id = call_id
        if life is not None and life.stop_requested:  # the stop came first: it reads stopped
            state, item = "aborted", Stopped(STOPPED_MESSAGE)
        if task_id is None:
            self._counts.add(count_names.NO_TASK_ID)
            _rare(
                count_names.NO_TASK_ID,
                "publish: %s block with neither callId nor task id dropped",
                state,
            )
            return
        if room is None:
            self._counts.add(count_names.NO_ROOM)
            _rare(
                count_names.NO_ROOM,
                "publish: %s block for task %r has no room; dropped",
                state,
                task_id,
            )
            return
        key = (call_id, task_id)
        with self._lock:
            if call_id is None:
                stats: CallState | None = self._unattributed
                provisional = False  # no call end will come to send it later
            else:
                stats = self._calls.get(call_id)
            if stats is not None and task_id in stats.closed:
                self._drop_locked(count_names.DUPLICATE_TERMINAL, stats)
                return
            if life is not None and life.ended:
                self._drop_locked(count_names.CLOSED, stats)
                return
            stream = self._streams.get(key)
            if provisional:
                if stream is None:
                    stream = self._open(key, room, path, life, trace_id)  # type: ignore[arg-type]
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
                if stats.trace_id is None and call_id is not None:
                    stats.trace_id = trace_id
                trace_id = stats.trace_id
                closed = stats.closed
                closed[task_id] = None
                if len(closed) > self.max_closed_per_call:
                    del closed[next(iter(closed))]
            if self._port is None:
                self._drop_locked(count_names.NO_SENDER, stats)
                return
            # Terminals bypass the queue bound: their number is bounded by the streams.
            self._queue.append((room, call_id, task_id, state, self._clock(), item, seq, trace_id))
            if stats is not None:
                stats.admitted += 1
            self._counts.admitted += 1
        self._poke()

    def _sweep(self, now: float) -> None:
        """End idle streams of calls whose end never came, and forget idle empty calls
        (the sender's side, about once a second; takes the lock)."""
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
            self._counts.add(count_names.EXPIRED, len(stale))
            _rare(
                count_names.EXPIRED,
                "stream hub: %d stream(s) idle for %g s ended (their call's end never came)",
                len(stale),
                self.stream_idle_ttl,
                level=logging.INFO,
            )

    def _poke(self) -> None:
        port = self._port
        if port is not None and self._idle:
            self._idle = False
            port._wake()

    def _maybe_flush(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        if now >= self._next_flush:
            self._next_flush = now + _SWEEP_EVERY
            self._counts.flush_metrics()


class SenderPort:
    """The sender's end of a :class:`StreamHub`, and the only part of the hub a sender uses
    (made by :meth:`StreamHub.attach_sender`): :meth:`get` a batch of outgoing items (waiting for
    more), or :meth:`take_nowait` what is queued; then report what became of each block
    taken, :meth:`delivered` or :meth:`dropped`.

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
        """The :class:`StreamHub` this port takes from."""
        return self._hub

    @property
    def closed(self) -> bool:
        """Whether this port was detached (by :meth:`close` or a newer port)."""
        return self._closed

    @property
    def queue_size(self) -> int:
        """Blocks queued in the hub right now (:attr:`StreamHub.queue_size`)."""
        return len(self._hub._queue)

    async def get(self, max_items: int = 256) -> list[Outgoing]:
        """Wait for and return up to ``max_items`` items in publish order; ``[]`` when
        :meth:`poke` was called or the port is closed."""
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

    def delivered(self, n: int = 1) -> None:
        """Report ``n`` blocks taken here as having left the process (counted
        ``delivered``, as :meth:`StreamHub.record_delivered`). Also after :meth:`close`."""
        self._hub.record_delivered(n)

    def dropped(self, reason: str, n: int = 1, call_id: str | None = None) -> None:
        """Report ``n`` blocks taken here as never reaching a browser, counted ``reason``
        (a name of :mod:`kernel_ext.observability.count_names`) and on ``call_id`` while the hub
        holds that call (as :meth:`StreamHub.record_dropped`). Also after :meth:`close`."""
        self._hub.record_dropped(reason, n, call_id)

    def poke(self) -> None:
        """Make a waiting :meth:`get` return (``[]`` if nothing is queued); loop thread only."""
        self._poked = True
        self._event.set()

    def close(self, reason: str = count_names.NO_SENDER) -> int:
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
