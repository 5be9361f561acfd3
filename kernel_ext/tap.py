"""The trajectory tap: the live tool calls of each conversation, fed by the span processor.

(Interface part; the Tap itself is built by the attribution work.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["CallSink", "LiveCall"]


@dataclass(frozen=True, slots=True)
class LiveCall:
    """A tool call whose ``execute_tool`` span has started and not ended."""

    call_id: str
    tool_name: str
    conversation_id: str | None
    llm_call_id: str | None = None
    parent_call_id: str | None = None
    started_ns: int = 0


class CallSink(Protocol):
    """What the span processor tells the stream layer about tool calls.

    Implementations must be enqueue-only and must never raise: they run on the thread
    that starts or ends the span, inside the traced code.
    """

    def tool_call_started(self, parent: LiveCall, child: LiveCall) -> None:
        """A tool call ``child`` started while ``parent`` was live (a nested tool call):
        emit a ``tool_call`` block (child's tool name, start marker) attributed to parent."""

    def tool_call_ended(self, call: LiveCall, error: str | None) -> None:
        """``call``'s span ended: every stream of it with no terminal yet gets exactly one
        ``aborted`` terminal (``error`` or a default message)."""
