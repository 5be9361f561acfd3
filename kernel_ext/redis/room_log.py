"""A room's log on Redis read into the relay's catch-up memory: when a browser joins a
room (:meth:`RoomLog.joining`) and after an outage: a part of
:class:`~kernel_ext.redis.manager.RelayRedisManager`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import socketio

from kernel_ext._shared.compat import connect_redis
from kernel_ext.observability.count_names import (
    REDIS_JOIN_UNSUBSCRIBED,
    REDIS_LOG_BLOCKS,
    REDIS_LOG_UNREAD,
)
from kernel_ext.protocol import TOOL_EVENT_STREAM
from kernel_ext.redis.routing import RoutedPublish, read_log_entry, room_channel, room_log
from kernel_ext.relay._log import rare
from kernel_ext.relay.delivery import Delivery
from kernel_ext.relay.workers import OpenStreams

__all__ = ["RoomLog"]


class RoomLog(RoutedPublish, socketio.AsyncRedisManager):  # type: ignore[misc, unused-ignore]
    """Reads the rooms' logs (:mod:`kernel_ext.redis.routing`) for catch-up."""

    # Its state, set by the manager's constructor.
    _workers: OpenStreams | None
    _relays: dict[str, Delivery]
    _loading: dict[tuple[str, str], list[Mapping[str, Any]]]
    _read_logs: set[str]
    _asked: set[str]
    _wanted: dict[str, tuple[str, str]]
    _joining: dict[tuple[str, str], int]

    @contextlib.asynccontextmanager
    async def joining(self, namespace: str, room: str) -> AsyncIterator[None]:
        """Around a browser's entry into ``room``: this process subscribes to the room's
        channel (and waits, up to ``connect_timeout`` seconds, until Redis confirms it), then
        reads the room's log into the catch-up memory if it has not since it subscribed —
        so that a block published at any time before the entry reaches the browser by the
        catch-up, and every one after it live. Without routing (or when Redis does not
        answer: counted ``redis_join_unsubscribed``) it waits for nothing."""
        key = (namespace, room)
        self._joining[key] = self._joining.get(key, 0) + 1
        self._interest(namespace, room)
        try:
            channel = room_channel(self.channel, namespace, room)
            if self.routing:
                if not await self._until_subscribed(channel):
                    self._bump(REDIS_JOIN_UNSUBSCRIBED)
                elif channel not in self._read_logs:
                    await self._read_log(namespace, room, channel)
            yield
        finally:
            left = self._joining.get(key, 0) - 1
            if left > 0:
                self._joining[key] = left
            else:
                self._joining.pop(key, None)
            self._interest(namespace, room)

    async def _read_log(
        self, namespace: str, room: str, channel: str, *, recover: bool = False
    ) -> None:
        """Hold the room's log for catch-up (what this process does not hold yet,
        :meth:`ReplayMemory.merge <kernel_ext.relay.replay.ReplayMemory.merge>`), then what
        it emitted to the room meanwhile (held back while the log is read). ``recover``
        (after an outage of Redis): also emit what it did not hold to the room's browsers
        on this process. Counts ``redis_log_blocks`` (blocks taken from a log) and
        ``redis_log_unread`` (a log Redis did not give)."""
        delivery = self._relays.get(namespace)
        replay = delivery.memory if delivery is not None else None
        key = (namespace, room)
        if replay is None or key in self._loading:
            # No memory to fill (catch-up off); or another join of the room reads it now,
            # and what that one holds before the entry is what this one needs too.
            self._read_logs.add(channel)
            return
        held_back: list[Mapping[str, Any]] = []
        self._loading[key] = held_back
        taken: list[Mapping[str, Any]] = []
        try:
            try:
                connect_redis(self)
                pipe = self.redis.pipeline(transaction=False)
                pipe.time()
                pipe.xrange(room_log(self.channel, namespace, room))
                (seconds, micros), entries = await asyncio.wait_for(
                    pipe.execute(), self.connect_timeout
                )
            except asyncio.CancelledError:
                raise
            except Exception:
                self._bump(REDIS_LOG_UNREAD)
                rare("redis_log", "relay: reading a room's log on Redis failed", exc_info=True)
                return
            blocks = []
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            for block, worker in _recent(entries, now_ms, replay.hold, replay.idle):
                if worker is not None and self._workers is not None:
                    self._note_worker_emit(
                        worker,
                        {
                            "event": TOOL_EVENT_STREAM,
                            "data": [block],
                            "room": room,
                            "namespace": namespace,
                        },
                    )
                blocks.append(block)
            taken = replay.merge(room, blocks)
            if taken:
                self._bump(REDIS_LOG_BLOCKS, len(taken))
            if channel in self._asked:
                self._read_logs.add(channel)
        finally:
            self._loading.pop(key, None)
            replay.merge(room, [message["data"][0] for message in held_back])
        if recover:
            for raw in taken:
                await self.emit(
                    TOOL_EVENT_STREAM, raw, namespace=namespace, room=room, ignore_queue=True
                )

    async def _recover(self) -> None:
        """After Redis answered again: the rooms of this process's browsers get from their
        logs what was published while this process could not hear it."""
        for channel, (namespace, room) in list(self._wanted.items()):
            if self.rooms.get(namespace, {}).get(room):
                try:
                    if await self._until_subscribed(channel):
                        await self._read_log(namespace, room, channel, recover=True)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    rare("redis_recover", "relay: catching rooms up after an outage failed")


def _recent(
    entries: list[tuple[Any, Mapping[Any, Any]]], now_ms: int, hold: float, idle: float
) -> list[tuple[dict[str, Any], str | None]]:
    """The blocks (and worker tags) of a room's log whose stream this process would still
    hold had it heard them (:class:`~kernel_ext.relay.replay.ReplayMemory`'s rules, on
    Redis' clock: an entry's id starts with the time it was added): not of a stream whose
    terminal is older than ``hold`` seconds, nor of one without a terminal whose last block
    is older than ``idle``. Entries that are not a block are skipped."""
    last: dict[tuple[Any, Any], tuple[int, bool]] = {}
    read: list[tuple[tuple[Any, Any], dict[str, Any], str | None]] = []
    for entry_id, fields in entries:
        entry = read_log_entry(fields)
        text = entry_id.decode("ascii", "replace") if isinstance(entry_id, bytes) else entry_id
        try:
            added = int(str(text).split("-", 1)[0])
        except ValueError:
            continue
        if entry is None:
            continue
        block, worker = entry
        key = (block.get("callId"), block.get("taskId"))
        _, ended = last.get(key, (0, False))
        last[key] = (added, ended or block.get("state") != "running")
        read.append((key, block, worker))
    fresh = {
        key
        for key, (added, ended) in last.items()
        if now_ms - added <= (hold if ended else idle) * 1000
    }
    return [(block, worker) for key, block, worker in read if key in fresh]
