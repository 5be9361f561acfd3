"""Frames of one internal connection emitted in arrival order, whatever the server's
``async_handlers`` setting.

:class:`InternalSender` is one internal sender's connection: its ordered queue of jobs
(a frame's valid blocks, or a chat event) and the task that empties it, and the worker
process it belongs to. What a job does is the relay's (``run``, given at construction).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["InternalSender", "Run"]

Run = Callable[["InternalSender", str, str, Any], Awaitable[int]]
"""Emit one job of a connection (``kind``, ``room``, ``payload``); how many blocks went out."""


class InternalSender:
    """One internal sender's connection: its ordered emit queue and the task that empties it
    (:meth:`start`), and the worker process it belongs to (its ``worker`` auth field, else
    ``sid/<sid>``).

    A frame is emitted at once by its own handler when nothing of the connection is queued,
    held or being emitted (``idle`` set, ``holding`` false; the common case, without a hop
    through the queue's task); otherwise it is queued behind the others. The queue's task
    takes a job (``holding``), waits for ``idle`` and emits it: frames keep arrival order."""

    __slots__ = ("holding", "idle", "queue", "run", "task", "worker")

    def __init__(self, worker: str, run: Run) -> None:
        self.queue: asyncio.Queue[tuple[str, str, Any, asyncio.Future[int]] | None] = (
            asyncio.Queue()
        )
        self.task: asyncio.Task[None] | None = None
        self.worker = worker
        self.run = run
        self.idle = asyncio.Event()
        self.idle.set()
        self.holding = False

    def free(self) -> bool:
        """Whether a new job may run at once (nothing queued, held or running)."""
        return self.idle.is_set() and not self.holding and self.queue.empty()

    def start(self, ended: Callable[[str], None]) -> None:
        """Start the task that emits the queued jobs; ``ended(worker)`` once the connection
        is gone and its queued jobs are out (:meth:`close`)."""
        self.task = asyncio.get_running_loop().create_task(self._emit_queued(ended))

    def close(self) -> None:
        """The connection is gone: its queued jobs are still emitted, then the task ends."""
        self.queue.put_nowait(None)

    async def submit(self, kind: str, room: str, payload: Any) -> int:
        """Emit a job now when the connection is free, else queue it behind the others (in
        arrival order either way); how many blocks went out."""
        if self.free():
            self.idle.clear()
            try:
                return await self.run(self, kind, room, payload)
            finally:
                self.idle.set()
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((kind, room, payload, done))
        return await done

    async def _emit_queued(self, ended: Callable[[str], None]) -> None:
        """Emit the connection's queued jobs in arrival order, one after the other."""
        while True:
            job = await self.queue.get()
            self.holding = True
            try:
                await self.idle.wait()  # a frame its handler is emitting goes first
            finally:
                self.holding = False
            if job is None:
                ended(self.worker)
                return
            kind, room, payload, done = job
            self.idle.clear()
            try:
                emitted = await self.run(self, kind, room, payload)
            except asyncio.CancelledError:
                if not done.done():
                    done.cancel()
                raise
            finally:
                self.idle.set()
            if not done.done():
                done.set_result(emitted)
