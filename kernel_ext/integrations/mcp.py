"""MCP tool calls stream into the detail pane: :func:`call_mcp_tool`.

Needs the ``mcp`` extra (``pip install 'kernel-ext[mcp]'``, the MCP Python SDK ≥ 2.3). A
kernel tool that calls a tool of an MCP server uses it in place of ``session.call_tool``::

    from kernel_ext.integrations.mcp import call_mcp_tool

    result = await call_mcp_tool(session, "crawl", {"url": url})

``session`` is a ``mcp.ClientSession`` or a ``mcp.Client`` (the SDK's public
``call_tool``). The request gets a stream of its own (``task_id``, by default
``mcp-<tool name>-<12 hex digits>``) under the calling tool's call:

* each progress notification → one ``running`` ``progress`` block, ``seq`` strictly
  increasing; the T4 throttle applies (the rest counted ``throttled``), a non-finite
  number is dropped (``invalid``);
* exactly one terminal: the result's text → ``done``; an ``isError`` result, an
  ``MCPError``, any other exception or a cancellation → ``aborted`` with what happened;
* a report after the terminal is not published (counted in :attr:`McpToolStream.stats`).

A calling tool call stopped by :func:`kernel_ext.stop_call` cancels the request it awaits:
the MCP SDK then sends the server ``notifications/cancelled`` for it (its courtesy cancel on
abandon), and the stream's terminal reads stopped (``aborted``, ``payload.stopped``).

It returns the ``CallToolResult`` unchanged and raises what ``call_tool`` raises, after the
terminal was published. The blocks belong to the calling tool's call, although the SDK runs
progress callbacks elsewhere. Only the SDK's public API is used.
Design: docs/contracts.md, "MCP".
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kernel_ext.context import ToolCall, current_tool_call, use_tool_call
from kernel_ext.protocol import BlockState
from kernel_ext.stream import Progress, PublishItem

try:
    from mcp.shared.exceptions import MCPError
    from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT, CallToolResult, TextContent
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kernel_ext.integrations.mcp needs the 'mcp' extra: pip install 'kernel-ext[mcp]'"
    ) from exc

__all__ = [
    "DEFAULT_ERROR_TEXT",
    "McpToolStream",
    "ProgressCallback",
    "StreamStats",
    "ToolCaller",
    "call_mcp_tool",
    "result_text",
]

logger = logging.getLogger("kernel_ext.integrations.mcp")

DEFAULT_ERROR_TEXT = "the MCP tool reported an error"
"""The ``aborted`` message of an ``isError`` result without text."""

ProgressCallback = Callable[[float, "float | None", "str | None"], Awaitable[None]]
"""The SDK's ``ProgressFnT``: ``async (progress, total, message) -> None``."""


class ToolCaller(Protocol):
    """What :func:`call_mcp_tool` needs of a session: the SDK's public ``call_tool``
    (``mcp.ClientSession`` and ``mcp.Client`` have it)."""

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        progress_callback: Any = None,
    ) -> Any: ...


@dataclass
class StreamStats:
    """What one :class:`McpToolStream` did: ``reports`` progress notifications received,
    ``published`` of them handed to ``publish`` (the hub may still drop some, counted
    there: ``throttled``, ``invalid``), ``late`` received after the terminal (not
    published), ``terminals`` published (0 or 1)."""

    reports: int = 0
    published: int = 0
    late: int = 0
    terminals: int = 0


def result_text(result: CallToolResult) -> str:
    """A result's text: its text contents joined by newlines; when it has none, its
    structured content as compact JSON; else ``""``."""
    texts = [block.text for block in result.content if isinstance(block, TextContent)]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        try:
            return json.dumps(
                result.structured_content, ensure_ascii=False, separators=(",", ":"), default=str
            )
        except (TypeError, ValueError):
            return str(result.structured_content)
    return ""


def _error_text(error: BaseException) -> str:
    """The ``aborted`` message of a call that raised."""
    if isinstance(error, MCPError):
        if error.code == REQUEST_TIMEOUT:
            return f"the MCP tool call timed out: {error.message}"
        if error.code == CONNECTION_CLOSED:
            return f"the MCP server's connection closed: {error.message}"
        return f"the MCP server answered with an error ({error.code}): {error.message}"
    if isinstance(error, Exception):
        return f"the MCP tool call failed: {type(error).__name__}: {error}"
    return "the MCP tool call was cancelled"


class McpToolStream:
    """The blocks of one MCP tool call: its progress reports and its one terminal (rules:
    module docstring). :meth:`on_progress` is the ``progress_callback`` to hand the SDK.

    Guarantees: no method raises (a failing publisher is logged); at most one terminal is
    published, and nothing after it; every block is published with ``call`` active (the
    call given, else the one active when the stream was made).
    """

    def __init__(
        self,
        tool_name: str,
        *,
        task_id: str | None = None,
        conversation_id: str | None = None,
        publish: Callable[..., None] | None = None,
        call: ToolCall | None = None,
        then: ProgressCallback | None = None,
    ) -> None:
        if publish is None:
            from kernel_ext.stream import publish as default_publish

            publish = default_publish
        self._publish: Callable[..., None] = publish
        self.tool_name = tool_name
        self.task_id = task_id or f"mcp-{tool_name[:64]}-{uuid.uuid4().hex[:12]}"
        """The stream's taskId (default ``mcp-<tool_name>-<12 hex digits>``)."""
        self._conversation_id = conversation_id
        self._call = call if call is not None else current_tool_call()
        self._then = then
        self.stats = StreamStats()

    @property
    def ended(self) -> bool:
        """Whether the terminal was published."""
        return self.stats.terminals > 0

    async def on_progress(self, progress: float, total: float | None, message: str | None) -> None:
        """The SDK's progress callback: one ``running`` progress block, unless the stream
        has ended; then the ``then`` callback, if any (its exception is the SDK's to log)."""
        self.stats.reports += 1
        if self.ended:
            self.stats.late += 1
        else:
            self.stats.published += 1
            self._emit(Progress(progress, total, message), "running")
        if self._then is not None:
            await self._then(progress, total, message)

    def finish(self, result: CallToolResult) -> None:
        """The terminal of a result: ``done`` with its text, ``aborted`` if ``isError``."""
        if not isinstance(result, CallToolResult):  # a session's own result shape
            self._terminal("done", "")
        elif result.is_error:
            self._terminal("aborted", result_text(result) or DEFAULT_ERROR_TEXT)
        else:
            self._terminal("done", result_text(result))

    def fail(self, error: BaseException) -> None:
        """The terminal of a call that raised (or was cancelled): ``aborted``."""
        self._terminal("aborted", _error_text(error))

    def _terminal(self, state: BlockState, text: str) -> None:
        if self.ended:
            return
        self.stats.terminals += 1
        self._emit(text, state)

    def _emit(self, item: PublishItem, state: BlockState) -> None:
        try:
            with use_tool_call(self._call):
                self._publish(
                    item,
                    task_id=self.task_id,
                    state=state,
                    conversation_id=self._conversation_id,
                    tool_name=self.tool_name,
                )
        except Exception:  # publish never raises by contract; never let it reach the tool
            logger.exception("mcp: publish raised; block lost")


async def call_mcp_tool(
    session: ToolCaller,
    name: str,
    arguments: dict[str, Any] | None = None,
    *,
    read_timeout_seconds: float | None = None,
    progress_callback: ProgressCallback | None = None,
    task_id: str | None = None,
    conversation_id: str | None = None,
    tool_name: str | None = None,
    publish: Callable[..., None] | None = None,
) -> CallToolResult:
    """Call the MCP tool ``name`` through ``session``, stream its progress, return its result.

    ``arguments``, ``read_timeout_seconds`` (the SDK's request timeout; ``None``: the
    session's) and ``progress_callback`` (also called, after the block is published) go to
    ``session.call_tool``. ``task_id`` names the stream (default
    ``mcp-<name>-<12 hex digits>``); ``conversation_id`` and ``tool_name`` (default
    ``name``) are for ``publish`` outside an attributed call; ``publish`` defaults to
    ``kernel_ext.stream.publish``.

    Returns the ``CallToolResult`` as ``call_tool`` returned it; raises what it raises
    (``MCPError`` for a protocol error, a timeout or a closed connection), each time after
    the stream's one terminal was published (module docstring).
    """
    stream = McpToolStream(
        tool_name or name,
        task_id=task_id or f"mcp-{name[:64]}-{uuid.uuid4().hex[:12]}",
        conversation_id=conversation_id,
        publish=publish,
        then=progress_callback,
    )
    try:
        result: CallToolResult = await session.call_tool(
            name, arguments, read_timeout_seconds, progress_callback=stream.on_progress
        )
    except BaseException as error:
        stream.fail(error)
        raise
    stream.finish(result)
    return result
