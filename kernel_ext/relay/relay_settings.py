""":class:`RelaySettings`: every option of a relay but its secret and its two hooks.

:class:`~kernel_ext.relay.ChatRelay` takes them as keywords (``ChatRelay(secret,
catch_up=False)``, as :func:`~kernel_ext.relay.mount_relay` and
:func:`~kernel_ext.relay.create_app` pass theirs) or as one ``settings=RelaySettings(...)``;
each part of the relay reads its own group. Each bound is checked by the part that keeps it
(one rule, one home), when the relay is made; the frame bounds here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernel_ext.errors import check_positive_ints, check_positive_numbers
from kernel_ext.protocol import DEFAULT_MAX_BLOCK_BYTES, NAMESPACE, REPLAY_IDLE
from kernel_ext.relay.backpressure import (
    DEFAULT_BROWSER_QUEUE_BYTES,
    DEFAULT_BROWSER_STALL_TIMEOUT,
    DEFAULT_CATCH_UP_INFLIGHT_BYTES,
    BackPressure,
)
from kernel_ext.relay.catch_up import DEFAULT_CATCH_UP_BUDGET
from kernel_ext.relay.emitted_terminals import EmittedTerminals
from kernel_ext.relay.limits import (
    DEFAULT_JOIN_RATE,
    DEFAULT_MAX_BROWSER_ROOMS,
    DEFAULT_MAX_BROWSERS,
    DEFAULT_MAX_PER_IDENTITY,
    DEFAULT_STOP_BURST,
    DEFAULT_STOP_RATE,
    Admission,
)
from kernel_ext.relay.replay import (
    DEFAULT_CONVERSATION_BYTES,
    DEFAULT_STREAM_BYTES,
    DEFAULT_TOTAL_BYTES,
    ReplayMemory,
)
from kernel_ext.relay.workers import DEFAULT_WORKER_GRACE

__all__ = ["RelaySettings", "SettingsAttributes"]

Count = Callable[..., None]
Reject = Callable[[str, str, str], None]


@dataclass(frozen=True)
class RelaySettings:
    """A relay's options, by the part that uses them, with their defaults.

    Raises:
        ConfigError: a frame bound that is not a positive integer (the other bounds: when
            the relay is made, by the part that keeps each).
    """

    namespace: str = NAMESPACE
    """The Socket.IO namespace (default ``/chat``)."""

    # -- frames (kernel_ext.relay.frames, kernel_ext.relay.ordering) ------------------------
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES
    """The size bound of one block (encoded JSON)."""
    max_frame_blocks: int = 1_000
    """Blocks per ``kx_blocks`` frame (and rooms per frame)."""
    max_pending_frames: int = 10_000
    """Frames queued per internal connection before ``busy``."""

    # -- terminals emitted (kernel_ext.relay.emitted_terminals) -------------------------------
    dedup_terminals: int = 4_096
    """Terminals remembered to suppress re-sends (0 disables)."""
    dedup_ttl: float = 300.0
    """Seconds a terminal is remembered."""
    hold_terminals: int = 256
    """Terminals kept for late joiners of empty rooms (0 disables); not used with
    ``catch_up`` (the held streams have their terminals)."""
    hold_ttl: float = 30.0
    """Seconds such a terminal is kept."""

    # -- gone workers (kernel_ext.relay.workers) --------------------------------------------
    worker_grace: float | None = DEFAULT_WORKER_GRACE
    """Seconds a worker may stay disconnected before the relay ends its open streams with
    ``aborted`` (``None`` disables)."""
    max_workers: int = 1_024
    """Workers with open streams tracked at once."""
    max_worker_streams: int = 10_000
    """Open streams tracked per worker."""

    # -- catch-up (kernel_ext.relay.replay, kernel_ext.relay.catch_up) ----------------------
    catch_up: bool = True
    """Keep the conversations' streams in memory and catch joining browsers up
    (docs/operations.md, "Catch-up")."""
    replay_stream_bytes: int = DEFAULT_STREAM_BYTES
    """The bounds of that memory (:class:`~kernel_ext.relay.replay.ReplayMemory`): bytes
    held per stream, per conversation and in all, streams held, seconds a finished stream
    and an idle one are held."""
    replay_conversation_bytes: int = DEFAULT_CONVERSATION_BYTES
    replay_total_bytes: int = DEFAULT_TOTAL_BYTES
    replay_max_streams: int = 10_000
    replay_hold: float = 30.0
    replay_idle: float = REPLAY_IDLE
    max_cursors: int = 1_000
    """Entries of a join's ``have`` list read at most."""
    catch_up_inflight_bytes: int = DEFAULT_CATCH_UP_INFLIGHT_BYTES
    """Catch-up bytes queued to this process's browsers, and not yet written, at most in
    all; more catch-ups wait their turn."""
    catch_up_budget: int | None = DEFAULT_CATCH_UP_BUDGET
    """Bytes of catch-up one connection may receive a minute (refilled continuously; at
    least ``replay_conversation_bytes``; ``None``: no budget); past it a join's catch-up is
    limited and its acknowledgement says so."""

    # -- back-pressure (kernel_ext.relay.backpressure) --------------------------------------
    browser_queue_max: int | None = 2_000
    """Packets queued for one browser of this process at which it gets no more running
    blocks until it reads (``None``: no bound, and acknowledgements are not paced — the
    relay's behaviour before back-pressure). A frame's acknowledgement waits until every
    browser of its rooms has fewer than a quarter of that queued, at most
    ``ack_pace_timeout`` seconds; a browser that made it wait that long is not waited for
    again until it has caught up to that quarter."""
    ack_pace_timeout: float = 1.0
    """Seconds an acknowledgement waits for the browsers at most."""
    browser_queue_bytes: int | None = DEFAULT_BROWSER_QUEUE_BYTES
    """Bytes queued for one browser past which, as past ``browser_queue_max`` packets, it
    gets no running block and no catch-up block until it reads (``None``: no byte bound;
    neither bound without ``browser_queue_max``)."""
    browser_stall_timeout: float | None = DEFAULT_BROWSER_STALL_TIMEOUT
    """Seconds a browser may stay at a bound (a running block skipped it, or a catch-up
    waits for it) without reading down to a quarter of it, before it is disconnected
    (``browsers_stalled``; ``None``: never)."""

    # -- admission (kernel_ext.relay.limits) ------------------------------------------------
    max_browsers: int | None = DEFAULT_MAX_BROWSERS
    """The admission caps of this process's browsers (``None``: no cap;
    :class:`~kernel_ext.relay.limits.Admission`): browsers, browsers of one identity,
    conversations one browser holds, its joins per second and at once."""
    max_per_identity: int | None = DEFAULT_MAX_PER_IDENTITY
    max_browser_rooms: int | None = DEFAULT_MAX_BROWSER_ROOMS
    join_rate: float | None = DEFAULT_JOIN_RATE
    join_burst: int | None = None
    stop_rate: float | None = DEFAULT_STOP_RATE
    """A browser's stop requests per second once ``stop_burst`` are spent (``None``: no
    rate; :mod:`kernel_ext.relay.stops`)."""
    stop_burst: int = DEFAULT_STOP_BURST

    # -- stops (kernel_ext.relay.stops) -----------------------------------------------------
    stop_timeout: float = 5.0
    """Seconds a browser's stop waits for the worker's answer, or for Redis's, at most."""

    def __post_init__(self) -> None:
        check_positive_ints(
            max_block_bytes=self.max_block_bytes,
            max_frame_blocks=self.max_frame_blocks,
            max_pending_frames=self.max_pending_frames,
            max_cursors=self.max_cursors,
        )
        check_positive_numbers(stop_timeout=self.stop_timeout)

    # -- the parts, each made from its group ------------------------------------------------

    def admission(self, reject: Reject) -> Admission:
        """The admission caps of the relay's browsers."""
        return Admission(
            max_browsers=self.max_browsers,
            max_per_identity=self.max_per_identity,
            max_browser_rooms=self.max_browser_rooms,
            join_rate=self.join_rate,
            join_burst=self.join_burst,
            stop_rate=self.stop_rate,
            stop_burst=self.stop_burst,
            reject=reject,
        )

    def back_pressure(self, count: Count) -> BackPressure:
        """What each browser may have queued, and catch-ups in all."""
        return BackPressure(
            self.namespace,
            count,
            browser_queue_max=self.browser_queue_max,
            ack_pace_timeout=self.ack_pace_timeout,
            browser_queue_bytes=self.browser_queue_bytes,
            browser_stall_timeout=self.browser_stall_timeout,
            catch_up_inflight_bytes=self.catch_up_inflight_bytes,
            max_block_bytes=self.max_block_bytes,
        )

    def catch_up_memory(self, count: Count) -> ReplayMemory | None:
        """The memory of the conversations' streams (``None`` without ``catch_up``)."""
        if not self.catch_up:
            return None
        return ReplayMemory(
            stream_bytes=self.replay_stream_bytes,
            conversation_bytes=self.replay_conversation_bytes,
            total_bytes=self.replay_total_bytes,
            max_streams=self.replay_max_streams,
            max_block_bytes=self.max_block_bytes,
            hold=self.replay_hold,
            idle=self.replay_idle,
            count=count,
        )

    def emitted_terminals(self, count: Count) -> EmittedTerminals:
        """What the relay remembers of the terminals it emitted (with catch-up it holds none
        for late joiners: the held streams keep their terminals)."""
        return EmittedTerminals(
            remember=self.dedup_terminals,
            remember_ttl=self.dedup_ttl,
            hold=0 if self.catch_up else self.hold_terminals,
            hold_ttl=self.hold_ttl,
            count=count,
        )


class SettingsAttributes:
    """A relay's options read as its own attributes (``relay.browser_queue_max`` …), as
    before they were grouped: each is its :attr:`settings`' field, in effect."""

    settings: RelaySettings
    back_pressure: BackPressure

    @property
    def max_block_bytes(self) -> int:
        return self.settings.max_block_bytes

    @property
    def max_frame_blocks(self) -> int:
        return self.settings.max_frame_blocks

    @property
    def max_pending_frames(self) -> int:
        return self.settings.max_pending_frames

    @property
    def max_cursors(self) -> int:
        return self.settings.max_cursors

    @property
    def dedup_terminals(self) -> int:
        return self.settings.dedup_terminals

    @property
    def dedup_ttl(self) -> float:
        return self.settings.dedup_ttl

    @property
    def hold_terminals(self) -> int:
        """0 with catch-up (the held streams keep their terminals)."""
        return 0 if self.settings.catch_up else self.settings.hold_terminals

    @property
    def hold_ttl(self) -> float:
        return self.settings.hold_ttl

    @property
    def browser_queue_max(self) -> int | None:
        return self.settings.browser_queue_max

    @property
    def ack_pace_timeout(self) -> float:
        return self.back_pressure.ack_pace_timeout
