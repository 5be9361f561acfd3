"""Room-routed fan-out on Redis: the channel of each pub/sub message, and each room's log.

python-socketio's Redis manager publishes every message on one channel, so every web process
receives and decodes every emit, and skips those of rooms it has no browser in. kernel_ext's
Redis managers (:class:`~kernel_ext.relay.RelayRedisManager` in a web process, the manager
of :class:`~kernel_ext.emit.RedisEmitter` in a worker) route instead, with Redis doing the
routing:

* **An emit to one room** (``room`` a string, not a list) is published on that room's
  channel (:func:`room_channel`), to which only the web processes with a browser in the room
  subscribe (while they have one). Everything else — an emit to the whole namespace or to a
  list of rooms, python-socketio's room, disconnect and callback messages, kernel_ext's
  heartbeats — stays on the manager's channel, which every web process subscribes to.
* **A block** (``tool_event_stream``) is also appended to its room's log
  (:func:`room_log`, a Redis stream) in the same round trip: the room's last
  :data:`LOG_MAX_BLOCKS` blocks (trimmed approximately, as ``XADD MAXLEN ~`` does), kept
  until :data:`~kernel_ext.protocol.REPLAY_IDLE` seconds after the last one. A web process
  that subscribes to a room reads it, so that a browser that joins there is caught up with
  what was published before (docs/operations.md, "Catch-up").
* **Rolling upgrades.** A web process that routes also subscribes to the marker channel
  (:func:`marker_channel`). A publisher routes only while every subscriber of the manager's
  channel also subscribes to the marker (``PUBSUB NUMSUB``, looked at every
  :data:`ROUTE_CHECK_EVERY` seconds): while an older web process (or python-socketio's own
  manager) listens, everything goes on the one channel as before, and routing web processes
  take room emits from either. A publisher that finds such a web process says so at
  WARNING, and again when routing resumes.

Channel names carry the namespace's length, so that no two (namespace, room) pairs share a
channel. This module is the one home of these names and rules: both sides import it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any

from kernel_ext._shared.compat import connect_redis, publish_pipeline_supported
from kernel_ext.protocol import (
    REPLAY_IDLE,
    TOOL_EVENT_STREAM,
    WORKER_ID_PATTERN,
    WORKER_TAG,
    compact_bytes,
)
from kernel_ext.redis.publish_result import PublishResult

__all__ = [
    "LOG_MAX_BLOCKS",
    "ROUTE_CHECK_EVERY",
    "RoutedPublish",
    "log_entry",
    "marker_channel",
    "relay_stop_channel",
    "reply_channel",
    "room_channel",
    "room_log",
    "routed_room",
    "stop_channel",
    "stop_reply_channel",
]

_log = logging.getLogger("kernel_ext.redis")

LOG_MAX_BLOCKS = 4_096
"""Blocks a room's log keeps (about: Redis trims whole nodes of its stream)."""

ROUTE_CHECK_EVERY = 2.0
"""Seconds between a publisher's looks at who listens (rolling upgrades)."""

_LOG_TTL_MS = int(REPLAY_IDLE * 1000)

_SENDER = re.compile(WORKER_ID_PATTERN)

LOG_BLOCK = b"b"
LOG_WORKER = b"w"
"""The fields of a log entry: the block's compact JSON, the worker id its emit was tagged
with (when it was)."""


def marker_channel(channel: str) -> str:
    """The channel that web processes which route subscribe to, besides ``channel``."""
    return f"{channel}#kx-routed"


def room_channel(channel: str, namespace: str, room: str) -> str:
    """The channel of ``room``'s emits in ``namespace``."""
    return f"{channel}#kx-room#{len(namespace)}:{namespace}{room}"


def room_log(channel: str, namespace: str, room: str) -> str:
    """The key of ``room``'s log of blocks in ``namespace`` (a Redis stream)."""
    return f"{channel}#kx-log#{len(namespace)}:{namespace}{room}"


def stop_channel(channel: str, worker: str) -> str:
    """The channel on which web processes ask the write-only worker ``worker`` (its worker
    id) to stop one of its calls, and to which that worker subscribes
    (:mod:`kernel_ext.redis.stops`)."""
    return f"{channel}#kx-stop#{worker}"


def relay_stop_channel(channel: str) -> str:
    """The channel on which a web process asks the others to stop a call of a worker
    connected to one of them (loopback), and to which every web process subscribes
    (:mod:`kernel_ext.redis.stops`)."""
    return f"{channel}#kx-stop-relay"


def stop_reply_channel(channel: str, host_id: str) -> str:
    """The channel on which the web process ``host_id`` (its manager's ``host_id``) hears
    the answers to the stops it asked on Redis (of write-only workers, and forwarded)."""
    return f"{channel}#kx-stop-reply#{host_id}"


def reply_channel(channel: str, sender: object) -> str | None:
    """The reply channel (:func:`stop_reply_channel`) of a stop request's ``from``, or
    ``None`` when ``from`` is not a web process's id: a string of 1 to 128 letters, digits
    and ``._:@-`` (the shape of a worker id, :data:`~kernel_ext.protocol.WORKER_ID_PATTERN`,
    which python-socketio's host ids, hex UUIDs, have), so that no request names another
    kind of channel."""
    if not isinstance(sender, str) or _SENDER.fullmatch(sender) is None:
        return None
    return stop_reply_channel(channel, sender)


def routed_room(message: Mapping[str, Any]) -> str | None:
    """The room of a pub/sub message that goes on a room's channel: an ``emit`` to one room
    (a string); ``None`` for every other message."""
    room = message.get("room")
    if room.__class__ is str and message.get("method") == "emit":
        return room
    return None


def log_entry(message: Mapping[str, Any]) -> dict[bytes, bytes] | None:
    """The log entry of a routed emit when it is a block (its compact JSON, and its worker
    tag if any), else ``None``."""
    if message.get("event") != TOOL_EVENT_STREAM:
        return None
    data = message.get("data")
    if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], Mapping):
        return None
    try:
        entry = {LOG_BLOCK: compact_bytes(data[0])}
    except (TypeError, ValueError):
        return None

    worker = message.get(WORKER_TAG)
    if isinstance(worker, str):
        entry[LOG_WORKER] = worker.encode()
    return entry


def read_log_entry(fields: Mapping[Any, Any]) -> tuple[dict[str, Any], str | None] | None:
    """A log entry's block and worker id, or ``None`` when it is not one."""
    raw = fields.get(LOG_BLOCK)
    if not isinstance(raw, (bytes, str)):
        return None
    try:
        block = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(block, dict):
        return None
    worker = fields.get(LOG_WORKER)
    if isinstance(worker, bytes):
        worker = worker.decode("utf-8", "replace")
    return block, worker if isinstance(worker, str) else None


def _count(counts: Mapping[Any, Any], channel: str) -> int:
    """A channel's subscribers in a ``PUBSUB NUMSUB`` reply (keys bytes or str)."""
    count = counts.get(channel.encode(), counts.get(channel, 0))
    return count if isinstance(count, int) else 0


class RoutedPublish(PublishResult):
    """A mixin for python-socketio's ``AsyncRedisManager`` (before it among the bases):
    :class:`~kernel_ext.redis.publish_result.PublishResult`, publishing by the rules of
    this module when ``routing`` is true (and python-socketio's client can be pipelined,
    :func:`~kernel_ext._shared.compat.publish_pipeline_supported`). A routed block's
    receivers are the web processes that got it live, or 1 when none did but it reached the
    room's log while web processes listen on the channel (one catches a browser up with
    it)."""

    routing: bool = True
    route_all: bool = False
    """Whether emits to a room go on the room's channel now (every listener routes)."""
    _route_looked = False
    listening = 0
    """The subscribers of the manager's channel at the last look (web processes)."""
    _route_checked = -math.inf

    async def _before_publish(self) -> None:
        if not self.routing:
            return
        now = time.monotonic()
        if now - self._route_checked < ROUTE_CHECK_EVERY:
            return
        self._route_checked = now
        manager: Any = self
        try:
            if not publish_pipeline_supported():
                return
            connect_redis(manager)
            counts = dict(
                await manager.redis.pubsub_numsub(manager.channel, marker_channel(manager.channel))
            )
        except Exception:
            return  # Redis does not answer: the publish says so; keep the last answer
        channel = _count(counts, manager.channel)
        marker = marker_channel(manager.channel)
        routed = _count(counts, marker)
        self.listening = channel
        route_all = routed >= channel
        first, self._route_looked = not self._route_looked, True
        if route_all != self.route_all or (first and not route_all):
            self.route_all = route_all
            if route_all:
                _log.log(
                    logging.INFO if first else logging.WARNING,
                    "kernel_ext: every web process on Redis channel %r routes: emits to a room "
                    "go on the room's channel",
                    manager.channel,
                )
            else:
                _log.warning(
                    "kernel_ext: %d of %d web processes on Redis channel %r do not route "
                    "(an older version?): every emit goes on the channel until they are gone",
                    channel - routed,
                    channel,
                    manager.channel,
                )

    def _route(self, message: Any) -> str | None:
        """The room channel of ``message``, or ``None`` (the manager's channel, no log)."""
        if not self.route_all or not isinstance(message, dict):
            return None
        room = routed_room(message)
        if room is None:
            return None
        manager: Any = self
        return room_channel(manager.channel, message.get("namespace") or "/", room)

    def _queue(self, pipe: Any, message: Any, dumps: Any, after: dict[str, Any]) -> int:
        """Queue ``message``'s commands on ``pipe`` (the log's expiry once per pipeline, in
        ``after``); how many replies they give (the first is the publish's)."""
        manager: Any = self
        channel = self._route(message)
        pipe.publish(channel or manager.channel, dumps(message))
        entry = log_entry(message) if channel is not None else None
        if entry is None:
            return 1
        key = room_log(manager.channel, message.get("namespace") or "/", message["room"])
        pipe.xadd(key, entry, maxlen=LOG_MAX_BLOCKS, approximate=True)
        after[key] = ("PEXPIRE", key, _LOG_TTL_MS)
        return 2

    def _receivers(self, replies: list[Any]) -> int | None:
        """A message's receiver count from its replies (:meth:`_queue`): for a block no web
        process heard live, 1 when it reached the room's log while web processes listen on
        the channel (one catches a browser up with it), else 0."""
        count = replies[0]
        if not isinstance(count, int) or isinstance(count, bool):
            return None
        if count == 0 and len(replies) > 1 and isinstance(replies[1], (bytes, str)):
            return 1 if self.listening else 0
        return count
