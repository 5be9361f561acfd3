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
OpenTelemetry counter in batches of 64 per path (an SDK meter provider's ``Counter.add`` is
too dear for every publish; docs/performance.md); :func:`flush_metrics` adds the rest, and
the span processor calls it from ``force_flush`` and ``shutdown``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kernel_ext.attribution.tap import Tap, default_tap
from kernel_ext.context import ToolCall, current_tool_call
from kernel_ext.observability import otel_metrics
from kernel_ext.observability._rare_log import BatchedCount

__all__ = ["Resolution", "ResolutionPath", "attribute", "flush_metrics", "resolve_call_id"]

CONTEXT = "context"
NEAR_MATCH = "near_match"


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


_COUNTS = {
    path: BatchedCount(otel_metrics.resolutions, {"path": path.value}) for path in ResolutionPath
}
count_context = _COUNTS[ResolutionPath.CONTEXT].add_one
"""``count_context()``: count one attribution by the active call (path ``context``), for
:meth:`kernel_ext.stream.StreamHub.publish`, which takes that case of :func:`attribute` inline."""

# Resolutions of the context path by call id: the same call publishes many blocks, and
# building a frozen dataclass per block is dear. Bounded; cleared whole when full.
_CACHE_SIZE = 256
_context_cache: dict[str, Resolution] = {}
_NO_CONVERSATION = {
    path: Resolution(None, path, None) for path in (ResolutionPath.AMBIGUOUS, ResolutionPath.NONE)
}


def attribute(
    conversation_id: str | None, tool_name: str, tap: Tap | None
) -> tuple[str | None, str | None, str, ToolCall | None]:
    """The attribution rule of T2, once: ``(call_id, conversation_id, path, call)``.

    The active tool call of this context wins (path ``context``; ``call`` is it, and the
    conversation is its own when it has one). Otherwise the ``tap`` (default:
    :func:`kernel_ext.attribution.tap.default_tap`) gives the one live call named ``tool_name`` in
    ``conversation_id`` (``near_match``), or no id (``ambiguous``: more than one, or one
    evicted while live; ``none``: no candidate). Counted per path; never raises. A plain
    tuple: ``publish`` calls this per block (:func:`resolve_call_id` is the readable form);
    :meth:`kernel_ext.stream.StreamHub.publish` takes the first case (the active call)
    inline, for speed, and calls this for the rest.
    """
    call = current_tool_call()
    if call is not None:
        count_context()
        return call.call_id, call.conversation_id or conversation_id, CONTEXT, call
    try:
        live, count = (tap if tap is not None else default_tap()).near_match(
            conversation_id, tool_name
        )
    except Exception:  # a broken tap must not reach the publisher
        live, count = None, 0
    if live is not None:
        _COUNTS[ResolutionPath.NEAR_MATCH].add_one()
        return live.call_id, conversation_id, NEAR_MATCH, None
    path = ResolutionPath.AMBIGUOUS if count else ResolutionPath.NONE
    _COUNTS[path].add_one()
    return None, conversation_id, path.value, None


def resolve_call_id(
    conversation_id: str | None = None,
    tool_name: str = "ask_colleague",
    *,
    tap: Tap | None = None,
) -> Resolution:
    """Which tool call a block of ``conversation_id`` belongs to, and how that was decided
    (:func:`attribute`'s rule, as a :class:`Resolution`).

    ``conversation_id=None`` asks about calls whose span had no conversation id. Never
    raises; the returned object may be shared between calls (it is immutable).
    """
    call_id, conversation, path, call = attribute(conversation_id, tool_name, tap)
    if call is not None:
        resolution = _context_cache.get(call.call_id)
        if resolution is None or resolution.conversation_id != conversation:
            resolution = Resolution(call.call_id, ResolutionPath.CONTEXT, conversation)
            if len(_context_cache) >= _CACHE_SIZE:
                _context_cache.clear()
            _context_cache[call.call_id] = resolution
        return resolution
    if call_id is not None:
        return Resolution(call_id, ResolutionPath.NEAR_MATCH, conversation)
    resolved = ResolutionPath(path)
    if conversation is None:
        return _NO_CONVERSATION[resolved]
    return Resolution(None, resolved, conversation)


def flush_metrics() -> None:
    """Add the resolutions counted since the last full batch to ``kernel_ext.resolutions``."""
    for count in _COUNTS.values():
        count.flush()
