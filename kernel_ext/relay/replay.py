"""What a relay keeps of each conversation's streams, so that a browser that joins late,
reloads or reconnects is caught up: the spec's ``mode: "replay"``, in memory only.

:class:`ReplayMemory` holds the blocks this process emitted to each room's browsers, per
stream ``(callId, taskId)``, while the stream is live and for ``hold`` seconds after its
terminal; nothing is written anywhere (decision T3). Bounded in bytes and streams, what
gives way at a bound counted and told to a catch-up, released after its terminal or when
idle: the rules in full are docs/contracts.md's, "The relay's catch-up memory".

Used from the event loop's thread only.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kernel_ext._shared.bounded import BoundedMap
from kernel_ext.errors import ConfigError, check_positive_ints, check_positive_numbers
from kernel_ext.observability.count_names import (
    REPLAY_BYTES,
    REPLAY_DROPPED_STREAMS,
    REPLAY_GAVE_WAY,
    REPLAY_IDLE_RELEASED,
    REPLAY_ROOMS,
    REPLAY_STREAMS,
)
from kernel_ext.protocol import DEFAULT_MAX_BLOCK_BYTES, REPLAY_IDLE, compact_bytes

__all__ = [
    "DEFAULT_CONVERSATION_BYTES",
    "DEFAULT_STREAM_BYTES",
    "DEFAULT_TOTAL_BYTES",
    "MAX_SEQ",
    "Cursors",
    "ReplayMemory",
    "StreamKey",
    "read_cursors",
]

StreamKey = tuple[Any, Any]
"""``(callId, taskId)`` of a stream (``callId`` may be ``None``: an unattributed terminal)."""
Cursors = dict[StreamKey, tuple[int, bool]]
"""Per stream, the highest seq a browser holds, and whether it holds the stream's terminal
(whose seq need not be the highest: a colleague's blocks carry its own seqs)."""
Entry = tuple[int, bytes]
"""``(seq, its compact JSON)`` of a held block: its size is the length (the protocol's
measure), and bytes are compact and untracked by the garbage collector, where the parsed
block's dicts would cost about three times the memory and every collection's time."""

DEFAULT_STREAM_BYTES = 1 << 20
DEFAULT_CONVERSATION_BYTES = 4 << 20
DEFAULT_TOTAL_BYTES = 64 << 20
"""The default bounds (1 MiB, 4 MiB, 64 MiB), for the relay's options and its command."""

MAX_SEQ = 2**53 - 1
"""The largest seq a cursor may name (the largest integer a JSON number holds exactly)."""


def read_cursors(have: object, max_entries: int) -> tuple[Cursors, int]:
    """The cursors of a join's ``have`` list, and how many entries were ignored: not an
    object, a ``callId`` neither a string nor ``null``, a ``taskId`` not a non-empty string,
    a ``seq`` not an integer in 0 .. :data:`MAX_SEQ` (a bool is not one), an ``ended`` that
    is there and not a bool, or beyond the first ``max_entries``. A ``have`` that is absent
    (``None``) gives no cursor; one that is not a list counts as one ignored entry. Never
    raises."""
    if have is None:
        return {}, 0
    if not isinstance(have, list):
        return {}, 1
    cursors: Cursors = {}
    ignored = max(0, len(have) - max_entries)
    for entry in have[:max_entries]:
        if not isinstance(entry, Mapping):
            ignored += 1
            continue
        call_id, task_id, seq = entry.get("callId"), entry.get("taskId"), entry.get("seq")
        ended = entry.get("ended", False)
        if (
            (call_id is not None and not isinstance(call_id, str))
            or not isinstance(task_id, str)
            or not task_id
            or seq.__class__ is not int
            or not 0 <= seq <= MAX_SEQ
            or ended.__class__ is not bool
        ):
            ignored += 1
            continue
        key = (call_id, task_id)
        held, had_end = cursors.get(key, (seq, False))
        cursors[key] = (max(seq, held), ended or had_end)
    return cursors, ignored


class _Stream:
    """The held blocks of one stream: its first block, its running blocks in arrival order
    (the ones that may give way), its terminal; and what gave way."""

    __slots__ = (
        "first",
        "gone",
        "gone_last",
        "key",
        "refreshed",
        "room",
        "running",
        "size",
        "terminal",
    )

    def __init__(self, room: str, key: StreamKey) -> None:
        self.room = room
        self.key = key
        self.first: Entry | None = None
        self.running: deque[Entry] = deque()
        self.terminal: Entry | None = None
        self.size = 0
        self.gone = 0  # running blocks that gave way
        self.gone_last = -1  # the highest seq among them
        self.refreshed = -math.inf  # when its idle time last started (never, yet)

    def held(self) -> list[Entry]:
        """The blocks before the terminal, in seq order (a seq once)."""
        entries = sorted(self.running, key=_seq)
        if self.first is not None:
            entries.insert(0, self.first)  # the lowest seq held (add())
        seen: set[int] = set()
        ordered = []
        for entry in entries:
            if entry[0] not in seen:
                seen.add(entry[0])
                ordered.append(entry)
        return ordered


def _seq(entry: Entry) -> int:
    return entry[0]


class _Room:
    __slots__ = ("running", "size", "streams")

    def __init__(self) -> None:
        self.streams: dict[StreamKey, _Stream] = {}  # in the order the streams started
        self.running: dict[StreamKey, None] = {}  # streams holding running blocks, oldest first
        self.size = 0


class ReplayMemory:
    """The streams a relay holds for catch-up (module docstring for the guarantees).

    Args:
        stream_bytes: bytes held per stream (default 1 MiB).
        conversation_bytes: bytes held per conversation (default 4 MiB).
        total_bytes: bytes held in all (default 64 MiB).
        max_streams: streams held without a terminal (default 10,000), and as many after
            their terminal.
        max_block_bytes: the size bound of one block: ``stream_bytes`` must hold two (a
            stream's first block and its terminal always fit), ``conversation_bytes`` one
            stream, ``total_bytes`` one conversation.
        hold: seconds a stream is held after its terminal (default 30).
        idle: seconds a stream without a terminal is held after its last block (default 900).
        count: the relay's counter (``count(name, n)``).
        clock: the monotonic clock of ``hold`` and ``idle`` (tests pass a fake).

    Raises:
        ConfigError: a bound that is not a positive int or is smaller than the one it holds,
            a time not a positive number.
    """

    def __init__(
        self,
        *,
        stream_bytes: int = DEFAULT_STREAM_BYTES,
        conversation_bytes: int = DEFAULT_CONVERSATION_BYTES,
        total_bytes: int = DEFAULT_TOTAL_BYTES,
        max_streams: int = 10_000,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
        hold: float = 30.0,
        idle: float = REPLAY_IDLE,
        count: Callable[[str, int], None] = lambda name, n: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_positive_ints(
            stream_bytes=stream_bytes,
            conversation_bytes=conversation_bytes,
            total_bytes=total_bytes,
            max_streams=max_streams,
        )
        check_positive_numbers(hold=hold, idle=idle)
        for name, value, holds, what in (
            ("stream_bytes", stream_bytes, 2 * max_block_bytes, "two blocks"),
            ("conversation_bytes", conversation_bytes, stream_bytes, "stream_bytes"),
            ("total_bytes", total_bytes, conversation_bytes, "conversation_bytes"),
        ):
            if value < holds:
                raise ConfigError(f"{name} must hold {what} ({holds} bytes), got {value}")
        self.stream_bytes = stream_bytes
        self.conversation_bytes = conversation_bytes
        self.total_bytes = total_bytes
        self.max_streams = max_streams
        self.hold = float(hold)
        self.idle = float(idle)
        self._count = count
        self._clock = clock
        self._refresh_every = self.idle / 16
        self._adds = 0
        self._rooms: dict[str, _Room] = {}
        self._running: dict[tuple[str, StreamKey], None] = {}  # as _Room.running, all rooms
        self._size = 0
        # The live streams by their last block (released after `idle`), and the ended ones
        # by their terminal (released after `hold`); together at most `max_streams`.
        self._live: BoundedMap[tuple[str, StreamKey], _Stream] = BoundedMap(
            max_streams, idle, clock=clock, on_forget=self._forgotten
        )
        self._ended: BoundedMap[tuple[str, StreamKey], _Stream] = BoundedMap(
            max_streams, hold, clock=clock, on_forget=self._forgotten
        )

    # -- feeding: every block this process emits to a room's browsers -----------------------

    def add(self, room: str, block: Mapping[str, Any], data: bytes | None = None) -> None:
        """Hold ``block`` (a valid block, as emitted) of ``room``; ``data`` is its
        :func:`~kernel_ext.protocol.compact_bytes` when the caller has them (the relay's
        check made them), else they are made here. A block of a stream whose terminal is
        held already is not held again. On the relay's live path it costs a few dict
        steps."""
        self._adds += 1
        if not self._adds & 63:
            self.expire()  # expiry looks at the oldest entries only; every 64th block is enough
        envelope = block.get("envelope")
        seq = envelope.get("seq") if envelope.__class__ is dict else None
        if seq.__class__ is not int:
            return  # not a valid block: the relay emits only valid ones
        if data is None:
            data = compact_bytes(block)
        key: StreamKey = (block.get("callId"), block.get("taskId"))
        where = self._rooms.get(room)
        if where is None:
            where = self._rooms[room] = _Room()
        stream = where.streams.get(key)
        if stream is None:
            stream = where.streams[key] = _Stream(room, key)
        elif stream.terminal is not None:
            return
        entry: Entry = (seq, data)
        if block.get("state") == "running":
            first = stream.first
            if first is None and not stream.running and not stream.gone:
                stream.first = entry
            else:
                if first is not None and seq < first[0]:
                    # An older block than the first held (from a room's log, merged after
                    # live ones): it is the stream's first, the other a running one.
                    stream.first, entry = entry, first
                stream.running.append(entry)
                if key not in where.running:
                    where.running[key] = None
                    self._running[(room, key)] = None
            now = self._clock()
            if now - stream.refreshed >= self._refresh_every:  # the idle time starts again
                stream.refreshed = now
                self._live.set((room, key), stream, refresh=True)
        else:
            stream.terminal = entry
            handle = (room, key)
            self._live.pop(handle)
            self._ended.set(handle, stream)
        size = len(data)
        stream.size += size
        where.size += size
        self._size += size
        if (
            stream.size > self.stream_bytes
            or where.size > self.conversation_bytes
            or self._size > self.total_bytes
        ):
            self._bound(stream, where)

    def merge(self, room: str, blocks: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """Hold those of ``blocks`` (valid blocks of ``room``, oldest first, from elsewhere:
        a room's log on Redis) that this memory does not hold already, and return them: a
        running block whose seq its stream holds or let give way is skipped, and every block
        of a stream whose terminal it holds."""
        known: dict[StreamKey, tuple[set[int], int] | None] = {}
        taken: list[Mapping[str, Any]] = []
        for block in blocks:
            envelope = block.get("envelope")
            seq = envelope.get("seq") if envelope.__class__ is dict else None
            if seq.__class__ is not int:
                continue
            key: StreamKey = (block.get("callId"), block.get("taskId"))
            if key not in known:
                where = self._rooms.get(room)
                stream = where.streams.get(key) if where is not None else None
                if stream is None:
                    known[key] = (set(), -1)
                elif stream.terminal is not None:
                    known[key] = None
                else:
                    known[key] = ({entry[0] for entry in stream.held()}, stream.gone_last)
            seen = known[key]
            if seen is None:
                continue
            seqs, gone_last = seen
            if block.get("state") == "running":
                if seq in seqs or seq <= gone_last:
                    continue
                seqs.add(seq)
            else:
                known[key] = None
            self.add(room, block)
            taken.append(block)
        return taken

    def _bound(self, stream: _Stream, where: _Room) -> None:
        """Bring the stream, its conversation and the whole memory within their bounds."""
        while stream.size > self.stream_bytes and stream.running:
            self._give_way(stream)
        while where.size > self.conversation_bytes:
            oldest = next(iter(where.running), None)
            if oldest is not None:
                self._give_way(where.streams[oldest])
            else:
                self._drop_oldest(where.streams)
        while self._size > self.total_bytes:
            handle = next(iter(self._running), None)
            if handle is not None:
                self._give_way(self._rooms[handle[0]].streams[handle[1]])
            else:
                self._drop_oldest(
                    {key: s for room in self._rooms.values() for key, s in room.streams.items()}
                )

    def _give_way(self, stream: _Stream) -> None:
        """The stream's oldest running block gives way (counted)."""
        seq, data = stream.running.popleft()
        size = len(data)
        stream.gone += 1
        stream.gone_last = max(stream.gone_last, seq)
        self._shrink(stream, size)
        if not stream.running:
            self._rooms[stream.room].running.pop(stream.key, None)
            self._running.pop((stream.room, stream.key), None)
        self._count(REPLAY_GAVE_WAY, 1)

    def _drop_oldest(self, streams: Mapping[StreamKey, _Stream]) -> None:
        """Release the oldest stream (ended ones first) of ``streams``."""
        oldest = next((s for s in streams.values() if s.terminal is not None), None)
        if oldest is None:
            oldest = next(iter(streams.values()))
        self._release(oldest, REPLAY_DROPPED_STREAMS)

    def _shrink(self, stream: _Stream, size: int) -> None:
        stream.size -= size
        self._rooms[stream.room].size -= size
        self._size -= size

    def _release(self, stream: _Stream, reason: str | None) -> None:
        """Forget a stream entirely (counted ``reason`` unless ``None``)."""
        where = self._rooms.get(stream.room)
        if where is None or where.streams.get(stream.key) is not stream:
            return
        handle = (stream.room, stream.key)
        del where.streams[stream.key]
        where.running.pop(stream.key, None)
        self._running.pop(handle, None)
        self._live.pop(handle)
        self._ended.pop(handle)
        where.size -= stream.size
        self._size -= stream.size
        if not where.streams:
            del self._rooms[stream.room]
        if reason is not None:
            self._count(reason, 1)

    def _forgotten(self, handle: tuple[str, StreamKey], stream: _Stream, why: str) -> None:
        """A stream's time (``hold``, ``idle``) or the stream bound is up: release it."""
        if why != "expired":
            self._release(stream, REPLAY_DROPPED_STREAMS)
        else:
            self._release(stream, None if stream.terminal is not None else REPLAY_IDLE_RELEASED)

    def expire(self) -> None:
        """Release the streams whose hold or idle time is up."""
        self._ended.expire()
        self._live.expire()

    # -- catching a browser up ---------------------------------------------------------------

    def catch_up(
        self, room: str, cursors: Cursors
    ) -> tuple[list[Mapping[str, Any]], Cursors, dict[StreamKey, int]]:
        """What a browser that holds ``cursors`` lacks of ``room``: the blocks (stream by
        stream in the order the streams started, each in seq order: those above its cursor,
        then the terminal unless it holds it), the cursors after them, and per stream how
        many blocks the browser lacks that gave way (at most that many: the running blocks
        that gave way after its cursor)."""
        held, after, missing = self.catch_up_held(room, cursors)
        return [json.loads(data) for _, _, data, _ in held], after, missing

    def catch_up_held(
        self, room: str, cursors: Cursors
    ) -> tuple[list[tuple[StreamKey, int, bytes, bool]], Cursors, dict[StreamKey, int]]:
        """:meth:`catch_up` with each block as held: ``(stream, seq, compact JSON, whether
        it is the stream's terminal)``, nothing parsed."""
        self.expire()
        where = self._rooms.get(room)
        if where is None:
            return [], dict(cursors), {}
        blocks: list[tuple[StreamKey, int, bytes, bool]] = []
        after = dict(cursors)
        missing: dict[StreamKey, int] = {}
        for key, stream in where.streams.items():
            cursor, ended = cursors.get(key, (-1, False))
            if ended:
                continue  # it holds the terminal, so everything it will ever need
            if stream.gone and cursor < stream.gone_last:
                missing[key] = stream.gone
            highest = cursor
            for seq, data in stream.held():
                if seq > cursor:
                    blocks.append((key, seq, data, False))
                    highest = max(highest, seq)
            terminal = stream.terminal
            if terminal is not None:
                blocks.append((key, terminal[0], terminal[1], True))
                highest = max(highest, terminal[0])
            if highest != cursor or terminal is not None:
                after[key] = (highest, terminal is not None)
        return blocks, after, missing

    # -- sizes --------------------------------------------------------------------------------

    def sizes(self) -> dict[str, int]:
        """What is held now: ``replay_rooms``, ``replay_streams``, ``replay_bytes``."""
        self.expire()
        return {
            REPLAY_ROOMS: len(self._rooms),
            REPLAY_STREAMS: sum(len(room.streams) for room in self._rooms.values()),
            REPLAY_BYTES: self._size,
        }
