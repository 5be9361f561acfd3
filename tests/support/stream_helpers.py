"""Test helpers for the stream hub's tests (tests/stream/, their fixtures in its
conftest.py): the calls and the conversation they run in, and waiting for blocks."""

from __future__ import annotations

from typing import Any

from kernel_ext.context import ToolCall, use_tool_call

CALL = "00f067aa0ba902b7"

CALL2 = "00f067aa0ba902b8"

CONV = "conv-1"


def in_call(call_id: str = CALL, conversation: str | None = CONV) -> Any:
    """Run the block in tool call ``call_id`` of ``conversation`` (a context manager)."""
    return use_tool_call(ToolCall(call_id, "ask_colleague", conversation))


def n_blocks(n: int) -> Any:
    """A condition for ``MemoryEmitter.wait_for``: ``n`` blocks or more were sent."""
    return lambda records: len(records) >= n
