"""The relay's watch of workers connected to it: a worker gone for longer than
``worker_grace`` has its open streams ended ``aborted`` (the rules:
:mod:`kernel_ext.relay.workers`).

A worker is the connect auth's ``worker`` id, else the connection's sid. Its streams are
known from its running blocks, and from the open streams it announces on each connection
(``kx_hello``): a relay restarted mid-call knows them before their next block. When the last
connection of a worker with open streams is gone and none of that worker comes back within
``worker_grace`` seconds, the relay emits one ``aborted`` block to the room of each of its
open streams (counted ``worker_aborted``); one that comes back in time cancels that
(``workers_resumed``) and ends its streams itself. Such a terminal is remembered like any
other, and later running blocks of those streams are dropped (``after_worker_aborted``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kernel_ext.observability.count_names import (
    AFTER_WORKER_ABORTED,
    BAD_ANNOUNCE,
    REJECTED_PREFIX,
    WORKERS_IN_GRACE,
)
from kernel_ext.protocol import KX_HELLO_MAX_OPEN
from kernel_ext.relay import frames
from kernel_ext.relay._log import count_frame, rare
from kernel_ext.relay.workers import ConnectionGrace, track_workers

__all__ = ["GoneWorkers"]


class GoneWorkers:
    """The open streams of the relay's workers, and the grace timers of those gone.
    ``connected(worker)``: whether a connection of it is here; ``emit(room, raw)``: emit
    one ``aborted`` block (whether it went out)."""

    def __init__(
        self,
        worker_grace: float | None,
        count: Callable[..., None],
        *,
        max_workers: int,
        max_worker_streams: int,
        connected: Callable[[str], bool],
        emit: Callable[[str, dict[str, Any]], Awaitable[bool]],
    ) -> None:
        streams = track_workers(
            worker_grace,
            count,
            "",
            max_workers=max_workers,
            max_worker_streams=max_worker_streams,
        )
        self._count = count
        self._streams = streams
        self.grace = streams.grace if streams is not None else None
        """Seconds a gone worker's streams wait (``None``: they are not ended)."""
        self._timers = (
            None
            if streams is None
            else ConnectionGrace(streams, connected=connected, emit=emit, count=count)
        )

    def owner_of(self, call_id: str, room: str) -> str | None:
        """The worker that owns an open stream of ``call_id`` in ``room`` (``None``: none,
        or gone workers are not watched: :meth:`OpenStreams.owner_of
        <kernel_ext.relay.workers.OpenStreams.owner_of>`)."""
        return None if self._streams is None else self._streams.owner_of(call_id, room)

    def note(self, worker: str, raw: Any, room: str) -> bool:
        """Note a block about to be emitted; ``False``: drop it (a running block of a stream
        this relay ended because its worker was gone)."""
        if self._streams is None or self._streams.note(worker, raw, room):
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

    def announced(
        self, worker: str, hello: Any, ended_here: Callable[[tuple[Any, Any]], bool]
    ) -> int:
        """``worker``'s ``kx_hello`` ``hello`` and the open streams it announces (``open``:
        ``{room, callId, taskId, seq}``, newest first), taken at once (before the later
        events of its connection): each is tracked as its running block would be, unless
        it ended here
        (:meth:`OpenStreams.announce <kernel_ext.relay.workers.OpenStreams.announce>`;
        ``ended_here(key)``: this relay emitted a terminal of that stream). An entry past
        :data:`~kernel_ext.protocol.KX_HELLO_MAX_OPEN`, or malformed
        (:func:`kernel_ext.relay.frames.announced`), is ignored and counted
        ``rejected_bad_announce``. How many are tracked (0 when gone workers are not
        watched). Never raises."""
        if not isinstance(hello, Mapping):
            return 0
        streams, ignored = frames.announced(hello, KX_HELLO_MAX_OPEN)
        if ignored:
            self._count(REJECTED_PREFIX + BAD_ANNOUNCE, ignored)
            count_frame(BAD_ANNOUNCE)
            rare(
                "relay_" + BAD_ANNOUNCE,
                "relay: ignored %d open-stream entries of %s's kx_hello",
                ignored,
                worker,
            )
        if self._streams is None or not streams:
            return 0
        return self._streams.announce(worker, streams, ended_here)

    def arrived(self, worker: str) -> None:
        """A connection of ``worker`` arrived."""
        if self._timers is not None:
            self._timers.arrived(worker)

    def left(self, worker: str) -> None:
        """A connection of ``worker`` is gone and its queued frames are out."""
        if self._timers is not None:
            self._timers.left(worker)

    def sizes(self) -> dict[str, int]:
        """What the watch holds now (the workers and their open streams, those in grace)."""
        if self._streams is None:
            return {}
        sizes = self._streams.sizes()
        sizes[WORKERS_IN_GRACE] = self._streams.in_grace()
        return sizes

    async def aclose(self) -> None:
        """Cancel every grace timer and any emission of ``aborted`` blocks in progress."""
        if self._timers is not None:
            await self._timers.aclose()
