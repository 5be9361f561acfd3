"""callId resolution (decision T2): the contextvar first, then the near-match, else none.

:func:`resolve_call_id` answers which tool call a block belongs to, and which path gave
the answer (:class:`ResolutionPath`):

``context``
    A tool call is active in this context (:func:`kernel_ext.current_tool_call`): its id.
    Right every time, also for concurrent calls of the same tool.
``near_match``
    No active call, and exactly one live call named ``tool_name`` in the conversation
    (read from the trajectory tap): its id.
``ambiguous``
    No active call, and two or more live candidates: no id. A wrong callId is a defect;
    a missing one is the designed fallback.
``none``
    No active call and no live candidate: no id.

Every resolution is counted on ``kernel_ext.resolutions`` by ``path``. Counts reach the
OpenTelemetry counter in batches of 64 per path (one ``Counter.add`` costs about 5 µs with
an SDK meter provider); :func:`flush_metrics` adds the rest, and the span processor calls
it from ``force_flush`` and ``shutdown``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kernel_ext import metrics
from kernel_ext._telemetry import BatchedCount
from kernel_ext.context import current_tool_call
from kernel_ext.tap import Tap, default_tap

__all__ = ["Resolution", "ResolutionPath", "flush_metrics", "resolve_call_id"]


class ResolutionPath(str, enum.Enum):
    """Which path of :func:`resolve_call_id` gave the answer; the value is the wire/metric name."""

    CONTEXT = "context"
    NEAR_MATCH = "near_match"
    AMBIGUOUS = "ambiguous"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Resolution:
    """The answer of :func:`resolve_call_id`.

    ``call_id`` is set exactly when ``path`` is ``context`` or ``near_match``.
    ``conversation_id`` is the conversation the block belongs to: the active call's when it
    has one, else the ``conversation_id`` that was asked about.
    """

    call_id: str | None
    path: ResolutionPath
    conversation_id: str | None = None

    def __bool__(self) -> bool:
        """True when a call id was found."""
        return self.call_id is not None


_COUNTS = {path: BatchedCount(metrics.resolutions, {"path": path.value}) for path in ResolutionPath}
_count_context = _COUNTS[ResolutionPath.CONTEXT].add_one

# Resolutions of the context path by call id: the same call publishes many blocks, and a
# frozen dataclass costs ~0.5 µs to build. Bounded; cleared whole when full.
_CACHE_SIZE = 256
_context_cache: dict[str, Resolution] = {}
_NO_CONVERSATION = {
    path: Resolution(None, path, None) for path in (ResolutionPath.AMBIGUOUS, ResolutionPath.NONE)
}


def resolve_call_id(
    conversation_id: str | None = None,
    tool_name: str = "ask_colleague",
    *,
    tap: Tap | None = None,
) -> Resolution:
    """Which tool call a block of ``conversation_id`` belongs to, and how that was decided.

    The active tool call of this context wins (``context``). Otherwise the ``tap`` (default:
    :func:`kernel_ext.default_tap`) is asked for the live calls named ``tool_name`` in
    ``conversation_id`` (``None`` asks about calls whose span had no conversation id):
    exactly one gives ``near_match``, more give ``ambiguous``, none give ``none``.

    Never raises; costs about one contextvar lookup and one dict lookup on the context
    path (the returned object may be shared between calls; it is immutable).
    """
    call = current_tool_call()
    if call is not None:
        _count_context()
        conversation = call.conversation_id or conversation_id
        resolution = _context_cache.get(call.call_id)
        if resolution is None or resolution.conversation_id != conversation:
            resolution = Resolution(call.call_id, ResolutionPath.CONTEXT, conversation)
            if len(_context_cache) >= _CACHE_SIZE:
                _context_cache.clear()
            _context_cache[call.call_id] = resolution
        return resolution
    try:
        live, count = (tap if tap is not None else default_tap()).near_match(
            conversation_id, tool_name
        )
    except Exception:  # a broken tap must not reach the publisher
        live, count = None, 0
    if live is not None:
        _COUNTS[ResolutionPath.NEAR_MATCH].add_one()
        return Resolution(live.call_id, ResolutionPath.NEAR_MATCH, conversation_id)
    path = ResolutionPath.AMBIGUOUS if count else ResolutionPath.NONE
    _COUNTS[path].add_one()
    if conversation_id is None:
        return _NO_CONVERSATION[path]
    return Resolution(None, path, conversation_id)


def flush_metrics() -> None:
    """Add the resolutions counted since the last full batch to ``kernel_ext.resolutions``."""
    for count in _COUNTS.values():
        count.flush()
