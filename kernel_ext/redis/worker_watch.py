"""Gone workers on the write-only path: a part of
:class:`~kernel_ext.redis.manager.RelayRedisManager` that tracks write-only workers' open
streams from their tagged emits and heartbeats and ends a silent worker's streams for this
process's browsers (the rules of :mod:`kernel_ext.relay.workers`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import socketio

from kernel_ext._shared.compat import connect_redis
from kernel_ext.observability.count_names import REDIS_WATCH_RESUMED
from kernel_ext.protocol import TOOL_EVENT_STREAM, WORKER_HEARTBEAT
from kernel_ext.redis.routing import RoutedPublish
from kernel_ext.relay._log import rare
from kernel_ext.relay.workers import OpenStreams, is_worker_id

__all__ = ["WorkerWatch"]


class WorkerWatch(RoutedPublish, socketio.AsyncRedisManager):  # type: ignore[misc, unused-ignore]
    """Watches the write-only workers
    (the rules: docs/contracts.md, "The relay's Redis manager")."""

    # Its state, set by the manager's constructor.
    _watching: asyncio.Task[None] | None
    _workers: OpenStreams | None
    _heard: float
    _watch_step: float
    _deaf_after: float

    def worker_sizes(self) -> dict[str, int]:
        """What the gone-worker watch holds now: ``redis_workers_tracked`` (workers with
        open streams) and ``redis_worker_streams`` (their open streams)."""
        return self._workers.sizes() if self._workers is not None else {}

    def _note_worker_emit(self, worker: Any, message: Mapping[str, Any]) -> bool:
        """Track a tagged emit; ``False`` when it belongs to a stream ended already."""
        workers = self._workers
        data = message.get("data")
        room = message.get("room")
        if (
            workers is None
            or not is_worker_id(worker)
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
        """The channel's messages (python-socketio's transport hook), less the heartbeats
        (handled here)."""
        async for message in self._subscribed():
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
            workers.restart_graces(now)
            self._bump(REDIS_WATCH_RESUMED)
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
        probe = json.dumps({"method": WORKER_HEARTBEAT, "worker": None, "host_id": self.host_id})
        while workers.workers:
            try:
                with contextlib.suppress(Exception):
                    # python-socketio's publishing client, made as its publish makes it
                    # (the subscription is a client of this manager's own).
                    connect_redis(self)
                    await asyncio.wait_for(
                        self.redis.publish(self.channel, probe), self._watch_step
                    )
                await asyncio.sleep(self._watch_step)
                # Judged at the last time this process heard the channel (its own checks
                # come back every step while Redis works): a worker is gone only if it was
                # overdue while this process could hear it.
                heard = self._heard
                for worker, record in workers.overdue(heard):
                    await self._end_worker_locally(worker, record.namespace, heard - record.seen)
            except asyncio.CancelledError:
                raise
            except Exception:
                rare("worker_watch", "relay: watching workers failed", exc_info=True)

    async def _end_worker_locally(self, worker: str, namespace: str, silent_for: float) -> None:
        workers = self._workers
        assert workers is not None

        async def emit(room: str, raw: dict[str, Any]) -> bool:
            # This process's browsers only: each web process ends the streams for its own
            # (and holds what it emits for its catch-ups).
            self._hold(
                {"event": TOOL_EVENT_STREAM, "data": [raw], "room": room, "namespace": namespace}
            )
            await self.emit(
                TOOL_EVENT_STREAM, raw, namespace=namespace, room=room, ignore_queue=True
            )
            return True

        await workers.emit_ended(
            worker,
            workers.end(worker),
            emit,
            gone_for=silent_for,
            how="silent on Redis",
            audience=" for this process's browsers",
        )

    async def stop_watching(self) -> None:
        """Cancel the gone-worker watch (when the server stops). Idempotent."""
        task, self._watching = self._watching, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


_HEARTBEAT_BYTES = WORKER_HEARTBEAT.encode()


def _is_heartbeat(message: Any) -> bool:
    if isinstance(message, (bytes, bytearray)):
        return _HEARTBEAT_BYTES in message
    return isinstance(message, str) and WORKER_HEARTBEAT in message
