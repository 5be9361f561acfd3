"""What a stream hub holds: per call, per stream, and the snapshot it reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kernel_ext.context import CallLife

__all__ = ["CallState", "HubStats", "StreamState"]


class CallState:
    """What the hub holds for one live call: counters, open streams, closed stream keys
    (an insertion-ordered set, oldest first) and the call's life when it was seen."""

    __slots__ = ("admitted", "closed", "dropped", "life", "open", "path", "touched", "trace_id")

    def __init__(self, path: str, now: float) -> None:
        self.admitted = 0
        self.dropped = 0
        self.path = path
        self.open: dict[str, StreamState] = {}
        self.closed: dict[str, None] = {}
        self.life: CallLife | None = None
        self.touched = now
        self.trace_id: str | None = None  # the traceId of the call's blocks, when known


class StreamState:
    __slots__ = (
        "call",
        "closed",
        "cursor",
        "ours",
        "provisional",
        "ring",
        "room",
        "seq",
        "touched",
        "trace_id",
    )

    def __init__(self, room: str, call: CallState, ring_size: int, now: float) -> None:
        # Set (under the hub's lock) when the stream leaves the hub's streams: a publisher
        # that looked it up without the lock then knows to look again.
        self.closed = False
        self.room = room
        self.call = call
        self.ring = [-math.inf] * ring_size  # admission times; ``cursor`` is the oldest
        self.cursor = 0
        self.seq = 0
        self.touched = now
        self.trace_id = call.trace_id  # queued with each block (the call's; fixed)
        # (state, item) of the terminal to send if the call ends with the stream open.
        self.provisional: tuple[str, Any] | None = None
        # Opened by the hub for the call's nested tool calls (their tool_call lines), and
        # nothing of the tool's admitted on it since: its terminal follows the call's outcome.
        self.ours = False


@dataclass(frozen=True)
class HubStats:
    """A snapshot of a hub: counts since it was made, and its current sizes.

    ``counts`` keys are ``admitted``, ``delivered``, ``degraded`` and the drop reasons
    (``throttled``, ``closed``, …, :mod:`kernel_ext.observability.count_names`). ``closed`` is
    the number of closed streams remembered (with their live calls).
    """

    counts: dict[str, int] = field(default_factory=dict)
    streams: int = 0
    calls: int = 0
    closed: int = 0
    queue: int = 0
    consumer: bool = False

    def __getitem__(self, reason: str) -> int:
        return self.counts.get(reason, 0)
