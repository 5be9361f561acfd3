"""The ledger: every name kernel_ext counts under, once (strings; no dependency).

The hub, the senders, the relay and the metrics count with these names and nothing else;
they are what users read — values of the ``outcome``, ``reason`` and ``event`` attributes of
the OpenTelemetry counters, keys of :meth:`kernel_ext.stream.StreamHub.stats`,
``Emitter.counts`` and the relay's stats (docs/operations.md lists them) — so a value never
changes. Other modules re-export the names they own by meaning
(:mod:`kernel_ext.stream.block_counts` the block outcomes and drop reasons,
:mod:`kernel_ext.emit.base` the senders' drop reasons, :mod:`kernel_ext.integrations.ag_ui`
the bridge's events): the same objects.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ACCEPTED",
    "ACKS",
    "ACK_PACE_TIMEOUTS",
    "ACK_TIMEOUTS",
    "ADMITTED",
    "AFTER_WORKER_ABORTED",
    "BAD_ANNOUNCE",
    "BAD_ARGUMENTS",
    "BAD_CURSOR",
    "BAD_EVENT_NAME",
    "BAD_FRAME",
    "BAD_JOIN",
    "BAD_LEAVE",
    "BAD_PACKET",
    "BAD_SECRET",
    "BAD_STOP",
    "BAD_WORKER",
    "BLOCKS_EMITTED",
    "BROWSERS",
    "BROWSERS_STALLED",
    "BROWSER_IDENTITIES",
    "BROWSER_LIMIT",
    "BROWSER_QUEUED",
    "BROWSER_QUEUED_BYTES",
    "BROWSER_QUEUE_FULL",
    "BROWSER_QUEUE_LONGEST",
    "BROWSER_QUEUE_LONGEST_BYTES",
    "BROWSER_QUEUE_PEAK",
    "BROWSER_QUEUE_PEAK_BYTES",
    "BROWSER_REFUSED",
    "BROWSER_ROOMS",
    "BUSY",
    "CALL_LIMIT",
    "CATCH_UP_INFLIGHT",
    "CATCH_UP_INFLIGHT_PEAK",
    "CATCH_UP_LIMITED",
    "CATCH_UP_POOL_WAITS",
    "CATCH_UP_WAITS",
    "CHAT_EVENTS",
    "CLOSED",
    "CONNECTS",
    "CONNECT_ERROR",
    "CONNECT_FAILURES",
    "CONNECT_REFUSED",
    "DEGRADED",
    "DELIVERED",
    "DISCONNECTED",
    "DISCONNECTS",
    "DROPPED",
    "DUPLICATE_TERMINAL",
    "ERROR",
    "EXPIRED",
    "FRAMES",
    "FRAME_TOO_LARGE",
    "HANDSHAKE_LIMIT",
    "HEARTBEATS",
    "HELD_TERMINALS",
    "IDENTITY_LIMIT",
    "IGNORED_CURSORS",
    "INTERNAL",
    "INTERNAL_CONNECTS",
    "INVALID",
    "JOINS",
    "JOIN_RATE",
    "JOIN_REFUSED",
    "LATE_TERMINALS",
    "NACKS",
    "NOT_BROWSER",
    "NOT_INTERNAL",
    "NO_LISTENER",
    "NO_ROOM",
    "NO_SENDER",
    "NO_TASK_ID",
    "NO_TOOL_CALL_ID",
    "OUTAGES",
    "PACED_ACKS",
    "QUEUE_FULL",
    "REDIS_AFTER_WORKER_ABORTED",
    "REDIS_DOWN",
    "REDIS_GIVEN_UP",
    "REDIS_JOIN_UNSUBSCRIBED",
    "REDIS_LOG_BLOCKS",
    "REDIS_LOG_UNREAD",
    "REDIS_PREFIX",
    "REDIS_PUBLISH_FAILED",
    "REDIS_REPUBLISHED",
    "REDIS_UNREACHABLE",
    "REDIS_WATCH_RESUMED",
    "REJECTED",
    "REJECTED_PREFIX",
    "REJOINS",
    "REPLAY_BLOCKS",
    "REPLAY_BYTES",
    "REPLAY_DROPPED_STREAMS",
    "REPLAY_GAVE_WAY",
    "REPLAY_IDLE_RELEASED",
    "REPLAY_MISSING",
    "REPLAY_ROOMS",
    "REPLAY_STREAMS",
    "ROOM_LIMIT",
    "RUN_ENDED_OPEN",
    "RUN_LIMIT",
    "STOPS_PREFIX",
    "STOP_ALREADY_ENDED",
    "STOP_FORBIDDEN",
    "STOP_NOT_JOINED",
    "STOP_NO_ANSWER",
    "STOP_PUBLISH_FAILED",
    "STOP_RATE",
    "STOP_REFUSED",
    "STOP_REPLY_FAILED",
    "STOP_STOPPING",
    "STOP_UNKNOWN",
    "STREAM_LIMIT",
    "SUPPRESSED_LOG_RECORDS",
    "SURROGATES_REPLACED",
    "TERMINALS_DEGRADED",
    "TERMINAL_EXPIRED",
    "TERMINAL_OVERFLOW",
    "TERMINAL_REEMITTED",
    "TERMINAL_RESENDS",
    "THROTTLED",
    "TOO_LARGE",
    "UNATTRIBUTED",
    "UNFLUSHED",
    "UNKNOWN_EVENT",
    "WINDOW_FULL",
    "WORKERS_DROPPED",
    "WORKERS_GONE",
    "WORKERS_IN_GRACE",
    "WORKERS_RESUMED",
    "WORKERS_TRACKED",
    "WORKER_ABORTED",
    "WORKER_STREAMS",
    "WORKER_STREAMS_DROPPED",
]

# -- Blocks: ``kernel_ext.blocks`` ``outcome`` (and HubStats counts) --------------------------
ADMITTED = "admitted"
DELIVERED = "delivered"
DEGRADED = "degraded"
DROPPED = "dropped"
"""The ``outcome`` of a drop; its ``reason`` is one of the names below."""

# Drop reasons of the stream layer (before admission, or while building):
THROTTLED = "throttled"
CLOSED = "closed"
DUPLICATE_TERMINAL = "duplicate_terminal"
"""Also the relay's count of a second terminal of a stream it dropped."""
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

# Drop reasons of the senders (after admission):
DISCONNECTED = "disconnected"
REJECTED = "rejected"
TERMINAL_EXPIRED = "terminal_expired"
TERMINAL_OVERFLOW = "terminal_overflow"
REDIS_DOWN = "redis_down"
NO_LISTENER = "no_listener"
"""Also the Redis sender's event of a publish no web process received."""

# -- Sender events: ``Emitter.counts`` and ``kernel_ext.sender.events`` ``event`` -----------
CONNECTS = "connects"
DISCONNECTS = "disconnects"
CONNECT_FAILURES = "connect_failures"
CONNECT_REFUSED = "connect_refused"
ACK_TIMEOUTS = "ack_timeouts"
ACKS = "acks"
NACKS = "nacks"
WINDOW_FULL = "window_full"
TERMINAL_RESENDS = "terminal_resends"
TERMINALS_DEGRADED = "terminals_degraded"
OUTAGES = "outages"
HEARTBEATS = "heartbeats"
STOP_REPLY_FAILED = "stop_reply_failed"
"""A write-only worker's answer to a stop that Redis did not take (the Redis sender): the
web process that asked answers its browser ``unreachable`` when its wait runs out."""
NO_TOOL_CALL_ID = "no_tool_call_id"
"""A pane whose call has no tool-call id when the AG-UI bridge takes its first block (its
span carried none, it ended ``ended_ttl`` seconds or more before, or it was evicted from a
full tap): its ``toolCallId`` is ``null`` and its colleagues have no parent tool call."""
RUN_ENDED_OPEN = "run_ended_open"
"""A colleague still open when its AG-UI run closed: ended with ``SUBAGENT_ERROR``."""
RUN_LIMIT = "run_limit"
"""An AG-UI run registered past ``max_runs``: it gets no panes."""
SURROGATES_REPLACED = "surrogates_replaced"
"""A block, ``chat_event`` snapshot or run event holding a lone surrogate, which the
AG-UI bridge passed on with each one replaced by U+FFFD
(:func:`kernel_ext.protocol.well_formed`): AG-UI's encoder cannot carry one."""

# -- Relay counters: the relay's stats ----------------------------------------------------
INTERNAL = "internal"
BROWSERS = "browsers"
WORKERS_IN_GRACE = "workers_in_grace"
INTERNAL_CONNECTS = "internal_connects"
BROWSER_REFUSED = "browser_refused"
JOIN_REFUSED = "join_refused"
JOINS = "joins"
LATE_TERMINALS = "late_terminals"
IGNORED_CURSORS = "ignored_cursors"
REPLAY_BLOCKS = "replay_blocks"
REPLAY_MISSING = "replay_missing"
REPLAY_GAVE_WAY = "replay_gave_way"
FRAMES = "frames"
PACED_ACKS = "acks_paced"
ACK_PACE_TIMEOUTS = "ack_pace_timeouts"
BROWSER_QUEUE_FULL = "browser_queue_full"
BROWSER_QUEUED = "browser_queued"
BROWSER_QUEUE_LONGEST = "browser_queue_longest"
BROWSER_QUEUED_BYTES = "browser_queued_bytes"
BROWSER_QUEUE_LONGEST_BYTES = "browser_queue_longest_bytes"
BROWSER_QUEUE_PEAK = "browser_queue_peak"
BROWSER_QUEUE_PEAK_BYTES = "browser_queue_peak_bytes"
BROWSERS_STALLED = "browsers_stalled"
"""Browsers disconnected for staying at their queue bound (relay/backpressure.py)."""
CATCH_UP_INFLIGHT = "catch_up_inflight"
CATCH_UP_INFLIGHT_PEAK = "catch_up_inflight_peak"
CATCH_UP_POOL_WAITS = "catch_up_pool_waits"
CATCH_UP_WAITS = "catch_up_waits"
CATCH_UP_LIMITED = "catch_up_limited"
"""Joins whose catch-up the connection's budget limited (relay/catch_up.py)."""
REJOINS = "rejoins"
CHAT_EVENTS = "chat_events"
BLOCKS_EMITTED = "blocks_emitted"
AFTER_WORKER_ABORTED = "after_worker_aborted"
TERMINAL_REEMITTED = "terminal_reemitted"
HELD_TERMINALS = "held_terminals"
WORKERS_RESUMED = "workers_resumed"
WORKERS_TRACKED = "workers_tracked"
WORKER_STREAMS = "worker_streams"
WORKER_STREAMS_DROPPED = "worker_streams_dropped"
WORKERS_DROPPED = "workers_dropped"
WORKERS_GONE = "workers_gone"
WORKER_ABORTED = "worker_aborted"
SUPPRESSED_LOG_RECORDS = "suppressed_log_records"
REPLAY_ROOMS = "replay_rooms"
REPLAY_STREAMS = "replay_streams"
REPLAY_BYTES = "replay_bytes"
REPLAY_DROPPED_STREAMS = "replay_dropped_streams"
REPLAY_IDLE_RELEASED = "replay_idle_released"
BROWSER_IDENTITIES = "browser_identities"
"""Identities with a browser connected to this web process now (``True``, the identity of
an open relay, not among them: :mod:`kernel_ext.relay.limits`)."""
BROWSER_ROOMS = "browser_rooms"
"""Conversations this process's browsers hold now, summed over the browsers (the rooms
cap's count: :mod:`kernel_ext.relay.limits`)."""
REJECTED_PREFIX = "rejected_"
"""A refused frame or connection is counted ``rejected_<its outcome below>``."""

# -- The relay's Redis manager: its counts ------------------------------------------------
REDIS_PREFIX = "redis_"
"""The gone-worker counts of the write-only path are the relay's, prefixed so."""
REDIS_PUBLISH_FAILED = "redis_publish_failed"
REDIS_GIVEN_UP = "redis_given_up"
REDIS_REPUBLISHED = "redis_republished"
REDIS_AFTER_WORKER_ABORTED = "redis_after_worker_aborted"
REDIS_WATCH_RESUMED = "redis_watch_resumed"
REDIS_JOIN_UNSUBSCRIBED = "redis_join_unsubscribed"
REDIS_LOG_UNREAD = "redis_log_unread"
REDIS_LOG_BLOCKS = "redis_log_blocks"
REDIS_UNREACHABLE = "redis_unreachable"

# -- Stop requests in the worker: ``kernel_ext.stop_counts()``, ``kernel_ext.stops`` ``answer``
# (the answers of :func:`kernel_ext.stop_call`, which are these very strings).
STOP_STOPPING: Final = "stopping"
"""The stop won: the call is being stopped."""
STOP_ALREADY_ENDED: Final = "already_ended"
"""The call had ended (returned, failed, or stopped) before the stop arrived."""
STOP_UNKNOWN: Final = "unknown"
"""No such call in this process (or one not on the convergence path: not stoppable)."""
STOP_REFUSED: Final = "refused"
"""The request was malformed (a call id that is not 16 lower-case hex digits)."""

# -- Relay frames: ``kernel_ext.relay.frames`` ``outcome`` --------------------------------
ACCEPTED = "accepted"
BAD_SECRET = "bad_secret"
BAD_WORKER = "bad_worker"
NOT_BROWSER = "not_browser"
NOT_INTERNAL = "not_internal"
BAD_JOIN = "bad_join"
BAD_CURSOR = "bad_cursor"
BAD_LEAVE = "bad_leave"
BAD_FRAME = "bad_frame"
BAD_ANNOUNCE = "bad_announce"
"""An entry of the open streams a ``kx_hello`` announced that the relay ignored: malformed
(:func:`kernel_ext.relay.frames.announced`) or past
:data:`~kernel_ext.protocol.KX_HELLO_MAX_OPEN`; counted ``rejected_bad_announce`` per entry."""
FRAME_TOO_LARGE = "frame_too_large"
BUSY = "busy"
UNKNOWN_EVENT = "unknown_event"
BAD_EVENT_NAME = "bad_event_name"
BAD_ARGUMENTS = "bad_arguments"
CONNECT_ERROR = "connect_error"
BAD_PACKET = "bad_packet"
# The admission caps (:mod:`kernel_ext.relay.limits`); a join refused by one answers
# ``{"ok": false, "error": <its name>}``.
BROWSER_LIMIT = "browser_limit"
IDENTITY_LIMIT = "identity_limit"
ROOM_LIMIT = "room_limit"
JOIN_RATE = "join_rate"
# A browser's stop request the relay refuses (:mod:`kernel_ext.relay.stops`), counted
# ``rejected_<reason>`` and answered ``refused``.
BAD_STOP = "bad_stop"
"""Malformed: not ``{v: 1, room, callId}``, a room not a conversation id, a callId not 16
lower-case hex digits."""
STOP_NOT_JOINED = "stop_not_joined"
"""The browser has not joined the request's room on this web process."""
STOP_FORBIDDEN = "stop_forbidden"
"""The application's ``authorize_stop`` hook said no (or failed)."""
STOP_RATE = "stop_rate"
"""Past the browser's stop rate (``stop_rate`` a second, ``stop_burst`` at once)."""
# -- The relay's answers to stop requests (:mod:`kernel_ext.relay.stops`): ``stops_<answer>``
STOPS_PREFIX = "stops_"
"""Before each answer the relay gave a browser's ``stop_call`` (``stops_stopping`` …)."""
STOP_NO_ANSWER = "stop_no_answer"
"""A worker asked on its connection (``kx_stop``) gave no usable answer in time: answered
``unreachable``."""
STOP_PUBLISH_FAILED = "stop_publish_failed"
"""A stop for a write-only worker could not be published on Redis: answered
``unreachable``."""
HANDSHAKE_LIMIT = "handshake_limit"
"""A new connection refused because ``max_handshake_waiting`` others wait for their
handshake (:mod:`kernel_ext.relay.turnstile`), counted ``rejected_handshake_limit``."""
