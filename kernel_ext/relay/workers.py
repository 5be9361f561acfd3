"""Gone workers: which streams each worker has open, and ending them once it is gone.

A worker process that dies mid-call can no longer send its open streams' terminals, and the
browsers' panes would stay open. The relay namespace (:class:`~kernel_ext.relay.ChatRelay`,
from its internal connections) and the Redis manager
(:class:`~kernel_ext.relay.RelayRedisManager`, from the tagged emits of write-only
workers) each keep an :class:`OpenStreams` and end a gone worker's streams through it, so
these rules live here once:

* **Open streams.** A stream opens on a running block with a callId (a block without one
  has no pane), or when its worker announces it (:meth:`OpenStreams.announce`), and closes
  at its terminal, whoever sends it; it belongs to the worker that sent its latest running
  block (a restarted process that goes on with its predecessor's stream takes it over); a
  worker has a record only while it has open streams.
* **Bounds.** ``max_streams`` per worker and ``max_workers`` records; beyond either the
  oldest is forgotten (counted ``<prefix>worker_streams_dropped`` /
  ``<prefix>workers_dropped``, logged rarely).
* **Grace.** A worker is gone ``grace`` seconds after its last connection left
  (:class:`ConnectionGrace`, the namespace's timers), or once it was last heard of more
  than ``max(grace, 3 × its heartbeat interval)`` seconds before the last time the Redis
  channel was heard (the manager's watch, :meth:`OpenStreams.overdue`).
* **Ending.** :meth:`OpenStreams.end` turns a gone worker's open streams into one valid
  ``aborted`` block each (:data:`WORKER_GONE_MESSAGE`, ``seq`` one above the highest seen,
  ``ts`` now) and remembers those streams (:data:`ENDED_MAX` of them, for
  :data:`ENDED_TTL` seconds) so that :meth:`OpenStreams.note` reports their late blocks;
  :meth:`OpenStreams.emit_ended` sends them, counts ``<prefix>workers_gone`` and
  ``<prefix>worker_aborted`` and logs one WARNING per worker.

Nothing here is persisted (T3). Used from the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

from kernel_ext._shared.bounded import BoundedMap
from kernel_ext.errors import check_positive_ints, check_positive_numbers
from kernel_ext.observability.count_names import (
    WORKER_ABORTED,
    WORKER_STREAMS,
    WORKER_STREAMS_DROPPED,
    WORKERS_DROPPED,
    WORKERS_GONE,
    WORKERS_RESUMED,
    WORKERS_TRACKED,
)
from kernel_ext.protocol import NAMESPACE, TERMINAL_STATES, WORKER_ID_PATTERN, Block, text_block
from kernel_ext.relay._log import logger, rare
from kernel_ext.relay.frames import Announced

__all__ = [
    "DEFAULT_WORKER_GRACE",
    "ENDED_MAX",
    "ENDED_TTL",
    "WORKER_GONE_MESSAGE",
    "ConnectionGrace",
    "OpenStreams",
    "WorkerRecord",
    "is_worker_id",
    "track_workers",
]

DEFAULT_WORKER_GRACE = 15.0
"""Seconds a worker may be gone (disconnected, or silent on Redis) before the relay ends its
open streams: longer than the loopback emitter's longest reconnect delay (5 s)."""
WORKER_GONE_MESSAGE = "the worker stopped before the call ended"
"""``envelope.payload.message`` of the ``aborted`` block that ends a gone worker's stream."""
ENDED_MAX = 4_096
"""Streams ended on a gone worker's behalf, remembered at most …"""
ENDED_TTL = 300.0
"""… for this many seconds, to drop their late blocks."""

_WORKER_ID = re.compile(WORKER_ID_PATTERN)

StreamKey = tuple[Any, Any]
"""``(callId, taskId)``."""
Count = Callable[[str, int], None]
"""``count(outcome, n)``: the owner's counter."""
Ended = list[tuple[str, dict[str, Any]]]
"""``(room, aborted block)`` for each stream of a gone worker."""
EmitOne = Callable[[str, dict[str, Any]], Awaitable[bool]]
"""``await emit(room, block)``: send one such block; whether it went out."""


def is_worker_id(value: object) -> bool:
    """Whether ``value`` is a worker id: a string matching ``protocol.WORKER_ID_PATTERN``."""
    return isinstance(value, str) and _WORKER_ID.fullmatch(value) is not None


class WorkerRecord:
    """One worker with open streams: ``streams``, ``(callId, taskId) -> (room, highest seq
    seen)`` oldest first, and what tells whether it is gone: its grace ``timer`` (loopback
    path), or when it was last heard of (``seen``, monotonic) and its heartbeat
    ``interval`` (Redis path); ``namespace``, where its streams' rooms are."""

    __slots__ = ("interval", "namespace", "seen", "streams", "timer")

    def __init__(self, streams: BoundedMap[StreamKey, tuple[str, int]]) -> None:
        self.streams = streams
        self.timer: asyncio.TimerHandle | None = None
        self.seen = time.monotonic()
        self.interval = 0.0
        self.namespace = NAMESPACE


def track_workers(
    worker_grace: float | None,
    count: Count,
    prefix: str,
    *,
    max_workers: int,
    max_worker_streams: int,
) -> OpenStreams | None:
    """The :class:`OpenStreams` of a relay or a Redis manager, ``None`` when
    ``worker_grace`` is ``None`` (gone workers are not watched). Raises
    :class:`~kernel_ext.errors.ConfigError` for a bad bound or grace, even then."""
    if worker_grace is None:
        check_positive_ints(max_workers=max_workers, max_worker_streams=max_worker_streams)
        return None
    return OpenStreams(
        count, prefix, grace=worker_grace, max_workers=max_workers, max_streams=max_worker_streams
    )


class OpenStreams:
    """The open streams of each worker — what browsers would wait for forever if it died
    (module docstring for the rules).

    Args:
        count: the owner's counter, ``count(outcome, n)``.
        prefix: put before every outcome counted (``"redis_"`` for the Redis manager).
        grace: seconds a worker may be gone before its streams are ended.
        max_workers: workers with open streams tracked at once.
        max_streams: open streams tracked per worker.

    Raises:
        ConfigError: a bad bound or grace.
    """

    def __init__(
        self, count: Count, prefix: str, *, grace: float, max_workers: int, max_streams: int
    ) -> None:
        check_positive_ints(max_workers=max_workers, max_worker_streams=max_streams)
        check_positive_numbers(worker_grace=grace)
        self.grace = float(grace)
        self.max_workers = max_workers
        self.max_streams = max_streams
        self.workers: BoundedMap[str, WorkerRecord] = BoundedMap(
            max_workers, on_forget=self._worker_dropped
        )
        self.owner: dict[StreamKey, str] = {}
        self.ended: BoundedMap[StreamKey, bool] = BoundedMap(ENDED_MAX, ENDED_TTL)
        self._count = count
        self._prefix = prefix

    @property
    def open(self) -> int:
        """Open streams tracked, all workers together."""
        return len(self.owner)

    def sizes(self) -> dict[str, int]:
        """What is held now: ``<prefix>workers_tracked`` (workers with open streams) and
        ``<prefix>worker_streams`` (their open streams)."""
        return {
            self._prefix + WORKERS_TRACKED: len(self.workers),
            self._prefix + WORKER_STREAMS: self.open,
        }

    # -- open and close --------------------------------------------------------------------

    def note(self, worker: str, raw: Mapping[str, Any], room: str) -> bool:
        """Track one block of ``worker`` about to go to ``room``; ``False`` when its stream
        was ended on a gone worker's behalf already (the caller drops or dedups it)."""
        call_id = raw.get("callId")
        if call_id is None:
            return True
        key = (call_id, raw.get("taskId"))
        if self.ended and key in self.ended:
            return False
        state = raw.get("state")
        if state == "running":
            seq = _seq_of(raw)
            if seq is None or not isinstance(call_id, str) or not isinstance(key[1], str):
                return True  # not a block this relay validated (Redis path): not tracked
            self._running(worker, key, room, seq)
        elif state in TERMINAL_STATES:
            owner = self.owner.get(key)
            if owner is not None:
                self._close(owner, key)
        return True

    def _running(self, worker: str, key: StreamKey, room: str, seq: int) -> None:
        """A running block of ``key`` (``seq``, to ``room``) came from ``worker``."""
        owner = self.owner.get(key)
        if owner == worker:
            streams = self._record(worker).streams
            known = streams.get(key)
            assert known is not None
            if seq > known[1] or room != known[0]:
                streams.set(key, (room, max(seq, known[1])))
            return
        if owner is not None:  # taken over from another worker (a restarted process)
            seq = max(seq, self._close(owner, key)[1])
        self._open(worker, key, room, seq)

    def announce(
        self, worker: str, streams: Sequence[Announced], ended_here: Callable[[StreamKey], bool]
    ) -> int:
        """``worker`` says these streams are open (``kx_hello``; newest first, kept first):
        each is tracked as its running block of that seq would be, unless this relay ended
        it (for a gone worker, or ``ended_here(key)``: its terminal went out). How many."""
        tracked = 0
        for room, call_id, task_id, seq in reversed(streams):  # the newest last: kept
            key = (call_id, task_id)
            if key in self.ended or ended_here(key):
                continue
            self._running(worker, key, room, seq)
            tracked += 1
        return tracked

    def owner_of(self, call_id: str, room: str) -> str | None:
        """The worker that owns an open stream of ``call_id`` in ``room``, else ``None`` (a
        look at every open stream: for a browser's stop request, which is rate-limited)."""
        for key, worker in self.owner.items():
            if key[0] != call_id:
                continue
            record = self.workers.get(worker)
            entry = record.streams.get(key) if record is not None else None
            if entry is not None and entry[0] == room:
                return worker
        return None

    def _record(self, worker: str) -> WorkerRecord:
        record = self.workers.get(worker)
        assert record is not None  # a worker that owns a stream has a record
        return record

    def _open(self, worker: str, key: StreamKey, room: str, seq: int) -> None:
        record = self.workers.get(worker)
        if record is None:
            dropped = functools.partial(self._stream_dropped, worker)
            record = WorkerRecord(BoundedMap(self.max_streams, on_forget=dropped))
            self.workers.set(worker, record)  # forgets the oldest worker beyond the bound
        record.streams.set(key, (room, seq))  # forgets its oldest stream beyond the bound
        self.owner[key] = worker

    def _close(self, worker: str, key: StreamKey) -> tuple[str, int]:
        """Close ``key`` in ``worker``'s record (dropping an emptied record); its entry."""
        del self.owner[key]
        record = self._record(worker)
        entry = record.streams.pop(key)
        assert entry is not None
        if not record.streams:
            self.forget(worker)
        return entry

    def _stream_dropped(self, worker: str, key: StreamKey, entry: object, reason: str) -> None:
        del self.owner[key]
        self._count(self._prefix + WORKER_STREAMS_DROPPED, 1)
        rare(
            "worker_streams_dropped",
            "relay: more than %d open streams for worker %s; forgot the oldest",
            self.max_streams,
            worker,
        )

    def _worker_dropped(self, worker: str, record: WorkerRecord, reason: str) -> None:
        self._release(record)
        self._count(self._prefix + WORKERS_DROPPED, 1)
        rare(
            "workers_dropped",
            "relay: more than %d workers with open streams; forgot the oldest (%s)",
            self.max_workers,
            worker,
        )

    def forget(self, worker: str) -> WorkerRecord | None:
        """Drop ``worker``'s record (its timer cancelled); return it."""
        record = self.workers.pop(worker)
        if record is not None:
            self._release(record)
        return record

    def _release(self, record: WorkerRecord) -> None:
        for key in record.streams:
            del self.owner[key]
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None

    # -- grace -----------------------------------------------------------------------------

    def in_grace(self) -> int:
        """Workers whose grace timer runs."""
        return sum(1 for record in self.workers.values() if record.timer is not None)

    def overdue(self, heard: float) -> Iterator[tuple[str, WorkerRecord]]:
        """The workers last heard of more than ``max(grace, 3 × their heartbeat
        interval)`` seconds before ``heard`` (monotonic), oldest first; each judged when
        the iteration reaches it (a sign of life that arrives meanwhile counts)."""
        for worker, record in self.workers.items():
            if heard - record.seen > max(self.grace, 3 * record.interval):
                yield worker, record

    def restart_graces(self, now: float) -> None:
        """Count every worker as heard of at ``now`` at the latest (after a silence in which
        its signs of life may have been lost)."""
        for record in self.workers.values():
            record.seen = max(record.seen, now)

    # -- ending ----------------------------------------------------------------------------

    def end(self, worker: str) -> Ended:
        """Forget ``worker`` and return ``(room, aborted block)`` for each of its open
        streams (a valid block per :mod:`kernel_ext.protocol`: ``seq`` one above the
        highest seen, ``ts`` now); the streams are remembered as ended."""
        record = self.forget(worker)
        if record is None:
            return []
        ts = int(time.time() * 1000)
        ended = []
        for (call_id, task_id), (room, seq) in record.streams.items():
            raw = text_block(call_id, task_id, "aborted", ts, seq + 1, WORKER_GONE_MESSAGE)
            try:
                Block.model_validate(raw)
            except Exception:  # an unvalidated id (Redis path): no valid block can end it
                rare("worker_abort_invalid", "relay: cannot end stream %r", (call_id, task_id))
                continue
            ended.append((room, raw))
            self.ended.set((call_id, task_id), True, refresh=True)
        return ended

    async def emit_ended(
        self,
        worker: str,
        ended: Ended,
        emit: EmitOne,
        *,
        gone_for: float,
        how: str,
        audience: str = "",
    ) -> None:
        """Send the blocks :meth:`end` returned for ``worker``, each with
        ``await emit(room, block)`` (``True``: it went out); count ``workers_gone`` and
        ``worker_aborted`` and log one WARNING (the worker was ``how`` for ``gone_for``
        seconds; ``audience`` says who got the blocks)."""
        emitted = 0
        for room, raw in ended:
            if await emit(room, raw):
                emitted += 1
        self._count(self._prefix + WORKERS_GONE, 1)
        self._count(self._prefix + WORKER_ABORTED, emitted)
        logger.warning(
            "relay: worker %s %s for %.1f s; ended its %d open stream(s) with aborted%s",
            worker,
            how,
            gone_for,
            emitted,
            audience,
        )


class ConnectionGrace:
    """The loopback path's grace: a worker with open streams is gone once its last
    connection left and none came back within ``streams.grace`` seconds; then its streams
    are ended (:meth:`OpenStreams.end`) and sent with ``emit`` (:meth:`OpenStreams.emit_ended`)
    in a task of the running loop. A connection that comes back in time cancels that
    (counted ``workers_resumed``, logged at INFO). ``connected(worker)`` says whether the
    worker has a connection now."""

    def __init__(
        self,
        streams: OpenStreams,
        *,
        connected: Callable[[str], bool],
        emit: EmitOne,
        count: Count,
    ) -> None:
        self.streams = streams
        self._connected = connected
        self._emit = emit
        self._count = count
        self._ending: set[asyncio.Task[None]] = set()
        self._closed = False

    def arrived(self, worker: str) -> None:
        """A connection of ``worker`` arrived: its grace, if one runs, is cancelled."""
        record = self.streams.workers.get(worker)
        if record is not None and record.timer is not None:
            record.timer.cancel()
            record.timer = None
            self._count(WORKERS_RESUMED, 1)
            logger.info("relay: worker %s is back within the grace period", worker)

    def left(self, worker: str) -> None:
        """A connection of ``worker`` is gone (its frames emitted): if it was the worker's
        last one and the worker has open streams, its grace starts."""
        record = self.streams.workers.get(worker)
        if record is None or record.timer is not None or self._closed:
            return
        if self._connected(worker):
            return
        record.seen = time.monotonic()
        record.timer = asyncio.get_running_loop().call_later(self.streams.grace, self._gone, worker)

    def _gone(self, worker: str) -> None:
        streams = self.streams
        record = streams.workers.get(worker)
        if record is None:
            return
        record.timer = None
        if self._closed or self._connected(worker):
            return
        gone_for = time.monotonic() - record.seen
        ending = streams.emit_ended(
            worker, streams.end(worker), self._emit, gone_for=gone_for, how="gone"
        )
        task = asyncio.get_running_loop().create_task(ending)
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def aclose(self) -> None:
        """Cancel every grace timer and any ending in progress; no grace starts after.
        Idempotent."""
        self._closed = True
        for record in self.streams.workers.values():
            if record.timer is not None:
                record.timer.cancel()
                record.timer = None
        tasks = list(self._ending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
