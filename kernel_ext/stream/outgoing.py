"""What goes out of a hub: queue items and their wire form, built on the sender's side.

Publishers queue a :class:`QueueItem` (cheap: nothing is built or validated on the tool's
thread); the one sender takes them through its :class:`~kernel_ext.stream.hub.SenderPort`
(the hub's port, :meth:`~kernel_ext.stream.hub.StreamHub.attach_sender`), which turns each with
:func:`take` into
an :class:`OutgoingBlock` (the block's wire form, valid and within the size bound) or an
:class:`OutgoingChatEvent`, in publish order. Building happens here, on the sender's loop:

* a running text block is the protocol's pseudo-envelope (:func:`kernel_ext.protocol.text_block`);
  an envelope (object or mapping) is validated and passed through; a nested tool call
  becomes a ``tool_call`` envelope; a :class:`Progress` a ``progress`` envelope;
* over the size bound, payload strings are cut with the marker
  (:func:`kernel_ext.protocol.encode_wire`); a running block that cannot be built is dropped
  (``invalid`` / ``too_large``, counted on its call); a terminal that cannot be built is
  degraded to :func:`kernel_ext.protocol.fallback_terminal` (``degraded``), never lost.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any, NamedTuple

from kernel_ext.errors import BlockTooLargeError, DecodeError
from kernel_ext.observability._rare_log import RareLog
from kernel_ext.protocol import (
    CHAT_EVENT,
    MAX_TASK_ID_CHARS,
    PROTOCOL_VERSION,
    STOPPED_KEY,
    Block,
    Envelope,
    decode_envelope,
    encode_wire,
    fallback_terminal,
    fits,
    is_well_formed,
    text_block,
    wire_text,
)
from kernel_ext.stream.block_counts import DEGRADED, ERROR, INVALID, TOO_LARGE

__all__ = [
    "CHAT_EVENT_STATE",
    "Outgoing",
    "OutgoingBlock",
    "OutgoingChatEvent",
    "Progress",
    "QueueItem",
    "Stopped",
    "ToolCallItem",
    "build",
    "take",
    "wall_ms",
]

logger = logging.getLogger("kernel_ext.stream")
_rare = RareLog(logger)

CHAT_EVENT_STATE = CHAT_EVENT
"""The ``state`` of a queued ``chat_event`` snapshot (not a block): the event's name."""


QueueItem = tuple[str, "str | None", str, str, float, Any, int, "str | None"]
"""One thing published and not yet taken by the sender: ``(room, call_id, task_id, state,
at, item, seq, trace_id)`` — ``state`` is ``running | done | aborted | chat_event``; ``at``
the hub's clock (monotonic seconds) when it was queued, the block's ``ts`` once taken
(:func:`wall_ms`); ``item`` a str, an Envelope, an envelope mapping, a
:class:`ToolCallItem`, a :class:`Progress`, a :class:`Stopped` or a chat event; ``seq`` the
stream's seq for a caller-made envelope (0 for the peer's own); ``trace_id`` the block's
``traceId`` or ``None`` (the call's: the same for every item of a ``call_id``, so fixed per
stream). A plain tuple, always unpacked by these names (a named tuple would cost the
publishing path more). ``at`` rather than the wall clock in ns: the hub reads its clock
anyway, and a second clock read per block is not free."""


def wall_ms(at: float, wall_offset: float) -> int:
    """The block ``ts`` (wall clock, ms) of a hub clock reading ``at``, where
    ``wall_offset`` is the wall clock minus the hub clock at the take: the publish instant
    on the wall clock as it reads now."""
    return math.floor((at + wall_offset) * 1000)


class ToolCallItem(NamedTuple):
    """A nested tool call's start marker (built into a ``tool_call`` envelope)."""

    tool_name: str
    call_id: str


class Stopped(NamedTuple):
    """The terminal of a stream whose call the user stopped: an ``aborted`` text envelope
    whose payload is ``{message, stopped: true}`` (docs/protocol.md)."""

    message: str


class Progress(NamedTuple):
    """A progress report to publish: built into a ``progress`` envelope whose seq is the
    stream's own counter (like a text block's), with ``payload`` ``{progress, total,
    message}`` — ``total`` and ``message`` only when given, an integral float as an int
    (``3.0`` → ``3``). A non-finite number makes the block invalid (dropped, counted)."""

    progress: float
    total: float | None = None
    message: str | None = None

    def payload(self) -> dict[str, Any]:
        """The envelope's payload (docs/protocol.md, kind ``progress``)."""
        payload: dict[str, Any] = {"progress": _integral(self.progress)}
        if self.total is not None:
            payload["total"] = _integral(self.total)
        if self.message is not None:
            payload["message"] = self.message
        return payload


def _integral(number: float) -> float:
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return number


class OutgoingBlock:
    """One block ready for a sender: decided, valid and within the size bound. Its wire form
    is :attr:`block` (a JSON-ready dict) and :attr:`text` (that dict's JSON text as
    python-socketio encodes it, :func:`~kernel_ext.protocol.wire_text`); each is made on
    first use and kept, as python-socketio encodes a dict when it is emitted. Read-only by
    convention (setting :attr:`block` replaces both; not frozen: a frozen class costs every
    block more to build)."""

    __slots__ = ("_block", "_parts", "_text", "call_id", "room", "size", "task_id", "terminal")

    def __init__(
        self,
        room: str,
        block: dict[str, Any],
        call_id: str | None,
        task_id: str,
        terminal: bool,
        size: int = 0,
    ) -> None:
        self.room = room
        self._block: dict[str, Any] | None = block
        self._text: str | None = None
        self._parts: tuple[_Fixed, float, float, int, str] | None = None
        self.call_id = call_id
        self.task_id = task_id
        self.terminal = terminal
        self.size = size
        """An estimate of the encoded size in characters (senders pack frames with it)."""

    @property
    def block(self) -> dict[str, Any]:
        """The wire form as a JSON-ready dict."""
        block = self._block
        if block is None:
            fixed, at, wall_offset, seq, item = self._parts  # type: ignore[misc]
            ts = wall_ms(at, wall_offset)
            block = text_block(self.call_id, self.task_id, "running", ts, seq, item, fixed[4])
            self._block = block
        return block

    @block.setter
    def block(self, block: dict[str, Any]) -> None:
        self._block = block
        self._text = None
        self._parts = None

    @property
    def text(self) -> str:
        """The wire form as JSON text, as python-socketio encodes event data."""
        text = self._text
        if text is None:
            parts = self._parts
            if parts is None or self._block is not None:
                text = wire_text(self._block)
            else:  # a running text block taken inline: from its stream's fixed parts
                (head, mid, mid2, tail, _, _), at, wall_offset, seq, item = parts
                ts = wall_ms(at, wall_offset)
                text = f"{head}{ts}{mid}{seq}{mid2}{encode_basestring_ascii(item)}{tail}"
            self._text = text
        return text

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OutgoingBlock):
            return NotImplemented
        mine = (self.room, self.block, self.call_id, self.task_id, self.terminal, self.size)
        theirs = (other.room, other.block, other.call_id, other.task_id, other.terminal)
        return mine == (*theirs, other.size) and self.text == other.text

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"OutgoingBlock(room={self.room!r}, block={self.block!r}, call_id={self.call_id!r},"
            f" task_id={self.task_id!r}, terminal={self.terminal!r}, size={self.size!r})"
        )


@dataclass(slots=True)
class OutgoingChatEvent:
    """The kernel's ``chat_event`` snapshot for ``room``, ordered with the blocks."""

    room: str
    event: dict[str, Any]


Outgoing = OutgoingBlock | OutgoingChatEvent

# What is fixed in the JSON text of the running text blocks of one stream: the text
# before the ts, between ts and seq, between seq and the payload text, after it; the
# stream's trace id; the task id's share of the inline size limit. Made once per stream
# and batch.
_Fixed = tuple[str, str, str, str, "str | None", int]
# The fixed parts of a text block, in characters, for the frame-size estimate.
_TEXT_BLOCK_CHARS = 256
# The fixed parts of a stream whose blocks the inline build does not take: no text fits.
_NOT_INLINE: _Fixed = ("", "", "", "", None, sys.maxsize)
# Placeholders for ts and seq when the fixed parts are cut out of a block's text.
_TS_MARK = 7_000_000_000_000_017
_SEQ_MARK = 7_000_000_000_000_019


def take(
    queue: deque[QueueItem],
    max_items: int,
    max_block_bytes: int,
    fast_chars: int,
    drop: Callable[..., None],
    wall_offset: float,
) -> list[Outgoing]:
    """Up to ``max_items`` items popped from ``queue``, built, in order (:func:`build`; what
    cannot be built is counted through ``drop`` and left out); ``wall_offset``: the wall
    clock minus the hub's clock now (:func:`wall_ms`)."""
    pop = queue.popleft
    out: list[Outgoing] = []
    append = out.append
    new = object.__new__
    streams: dict[tuple[str | None, str], _Fixed] = {}
    last_call: str | None = None
    last_task: str | None = None
    fixed = _NOT_INLINE
    task_chars = fixed[5]  # no stream yet: nothing fits
    try:
        for _ in range(max_items):
            raw = pop()
            room, call_id, task_id, state, at, item, seq, trace_id = raw
            # The common block — small running text — decided inline: what build() makes
            # of it (text_block, and wire_text of that for the sender), without its calls,
            # its wire form made when the sender reads it from what is fixed per stream
            # (this runs for every block, far cheaper than building its dicts here;
            # tests/core/test_fast_copies.py holds the two equal, block and text).
            if state == "running" and item.__class__ is str:
                if task_id is not last_task or call_id is not last_call:
                    last_call, last_task = call_id, task_id
                    fixed = _fixed_parts(streams, call_id, task_id, trace_id)
                    task_chars = fixed[5]
                if (size := len(item) + task_chars) <= fast_chars:
                    block = new(OutgoingBlock)  # OutgoingBlock(...) without its __init__
                    block.room = room
                    block._block = block._text = None
                    block._parts = (fixed, at, wall_offset, seq, item)
                    block.call_id = call_id
                    block.task_id = task_id
                    block.terminal = False
                    block.size = size + _TEXT_BLOCK_CHARS
                    append(block)
                    continue
            built = build(raw, max_block_bytes, fast_chars, drop, wall_offset)
            if built is not None:
                append(built)
    except IndexError:  # the queue is empty
        pass
    return out


def _fixed_parts(
    streams: dict[tuple[str | None, str], _Fixed],
    call_id: str | None,
    task_id: str,
    trace_id: str | None,
) -> _Fixed:
    """What is fixed in the running text blocks of the stream ``(call_id, task_id)`` (its
    ``trace_id`` included: the call's), made once per ``streams``; :data:`_NOT_INLINE` when
    its task id is not one the text path may trust (:func:`_trusted_task_id`: the general
    path's to judge)."""
    if task_id.__class__ is not str:  # a subclass too: its code must not run here
        return _NOT_INLINE
    key = (call_id, task_id)
    found = streams.get(key)
    if found is None:
        found = _text_parts(call_id, task_id, trace_id) if _trusted_task_id(task_id) else None
        found = streams[key] = found or _NOT_INLINE
    return found


def _text_parts(call_id: str | None, task_id: str, trace_id: str | None) -> _Fixed | None:
    """The fixed parts of the stream's running text blocks, cut out of the text of one made
    by the rule (text_block, wire_text) at its ``ts``, ``seq`` and payload text: outside a
    JSON string a key is the only quoted text followed by ``:``, so each cut is found
    once. ``None`` if one is not (the general path builds those blocks)."""
    text = wire_text(text_block(call_id, task_id, "running", _TS_MARK, _SEQ_MARK, "", trace_id))
    head, found_ts, rest = text.partition(f'"ts":{_TS_MARK}')
    mid, found_seq, rest = rest.partition(f'"seq":{_SEQ_MARK}')
    mid2, found_text, tail = rest.partition('"text":""')
    if not (found_ts and found_seq and found_text):
        return None
    return head + '"ts":', mid + '"seq":', mid2 + '"text":', tail, trace_id, len(task_id) * 2


def _trusted_task_id(task_id: str) -> bool:
    """Whether a text block may carry ``task_id`` unvalidated: 1–512 characters, all of
    them encodable in UTF-8 (a lone surrogate is not, and the block model refuses it)."""
    if not 0 < len(task_id) <= MAX_TASK_ID_CHARS:
        return False
    return is_well_formed(task_id)


def build(
    raw: QueueItem,
    max_block_bytes: int,
    fast_chars: int,
    drop: Callable[..., None],
    wall_offset: float,
) -> Outgoing | None:
    """The :class:`Outgoing` of a queue item, or ``None`` when a running block cannot be
    built (counted through ``drop(reason, call_id=…)``); ``wall_offset`` as for
    :func:`take`. Never raises."""
    room, call_id, task_id, state, at, item, seq, trace_id = raw
    if state == CHAT_EVENT_STATE:
        return OutgoingChatEvent(room, item)
    ts = wall_ms(at, wall_offset)
    terminal = state != "running"
    try:
        block, size = _wire(call_id, task_id, state, ts, item, seq, max_block_bytes, trace_id)
    except (DecodeError, ValueError, TypeError) as exc:
        if not terminal:
            reason = TOO_LARGE if isinstance(exc, BlockTooLargeError) else INVALID
            drop(reason, call_id=call_id)
            _rare(reason, "publish: running block of task %r dropped: %s", task_id, exc)
            return None
        drop(DEGRADED)  # counted, not dropped: the terminal goes out degraded
        _rare(DEGRADED, "publish: %s block of task %r rebuilt: %s", state, task_id, exc)
        try:
            block = fallback_terminal(
                call_id,
                str(task_id),
                "done" if state == "done" else "aborted",
                ts,
                seq,
                too_large=isinstance(exc, BlockTooLargeError),
                trace_id=trace_id,
            )
            Block.model_validate(block)
        except Exception:
            drop(ERROR)
            _rare(ERROR, "stream hub: terminal of task %r lost", task_id, exc_info=True)
            return None
        size = len(repr(block))
    except Exception:
        drop(ERROR)
        _rare(ERROR, "stream hub: could not build a block", exc_info=True)
        return None
    return OutgoingBlock(room, block, call_id, task_id, terminal, size)


def _wire(
    call_id: str | None,
    task_id: str,
    state: str,
    ts: int,
    item: Any,
    seq: int,
    max_block_bytes: int,
    trace_id: str | None = None,
) -> tuple[dict[str, Any], int]:
    """The wire dict of one block within the size bound (payload strings cut with the
    marker when needed) and an estimate of its encoded size in characters. Validated, but
    for a text block that is small by :func:`~kernel_ext.protocol.text_block_fast_limit`."""
    if item.__class__ is str and _trusted_task_id(task_id):
        wire = text_block(call_id, task_id, state, ts, seq, item, trace_id)
        if fits(wire, max_block_bytes):
            return wire, len(item) + len(task_id) * 2 + _TEXT_BLOCK_CHARS
        Block.model_validate(wire)
        return wire, len(encode_wire(wire, max_bytes=max_block_bytes))  # cut in place
    if isinstance(item, ToolCallItem):
        envelope: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "kind": "tool_call",
            "streamKey": task_id,
            "seq": seq,
            "status": "running",
            "payload": {"toolName": item.tool_name, "name": item.tool_name, "callId": item.call_id},
        }
    elif isinstance(item, Stopped):
        envelope = text_block(call_id, task_id, state, ts, seq, item.message)["envelope"]
        envelope["payload"][STOPPED_KEY] = True
    elif isinstance(item, Progress):
        envelope = {
            "v": PROTOCOL_VERSION,
            "kind": "progress",
            "streamKey": task_id,
            "seq": seq,
            "status": "running",
            "payload": item.payload(),
        }
    elif isinstance(item, Envelope):
        envelope = item.model_dump(by_alias=True, mode="json")
    elif isinstance(item, Mapping):
        envelope = decode_envelope(item).model_dump(by_alias=True, mode="json")
    elif isinstance(item, str):  # a task id the text path does not take: validated below
        envelope = text_block(call_id, task_id, state, ts, seq, item)["envelope"]
    else:
        raise DecodeError(
            f"invalid item: expected Envelope, mapping, Progress or str, got {type(item).__name__}"
        )
    wire = {
        "v": PROTOCOL_VERSION,
        "callId": call_id,
        "taskId": task_id,
        "state": state,
        "ts": ts,
        "envelope": envelope,
    }
    if trace_id is not None and call_id is not None:
        wire["traceId"] = trace_id
    Block.model_validate(wire)
    if fits(wire, max_block_bytes):
        return wire, len(repr(wire))
    return wire, len(encode_wire(wire, max_bytes=max_block_bytes))
