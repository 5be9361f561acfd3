"""The ``ask_colleague`` tool helper: ask a colleague over A2A, stream its progress.

:func:`ask_colleague` / :func:`stream_colleague` wrap :class:`~kernel_ext.a2a.A2AStreamAdapter`
around a real a2a-sdk client with timeouts that suit slow colleagues (module
:mod:`kernel_ext.a2a` for the guarantees).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Any

from kernel_ext.a2a.adapter import A2AStreamAdapter, ColleagueReply, Publisher
from kernel_ext.context import current_tool_call
from kernel_ext.errors import ColleagueError, ConfigError
from kernel_ext.protocol import well_formed
from kernel_ext.stop import STOPPED_MESSAGE, record_so_far

try:
    import httpx
    from a2a.client import A2AClientTimeoutError, Client, ClientConfig, create_client
    from a2a.types import (
        AgentCard,
        CancelTaskRequest,
        Message,
        Part,
        Role,
        SendMessageRequest,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kernel_ext.a2a needs the 'a2a' extra: pip install 'kernel-ext[a2a]'"
    ) from exc

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "ask_colleague",
    "colleague_http_client",
    "stream_colleague",
]

logger = logging.getLogger("kernel_ext.a2a")

DEFAULT_TIMEOUT = 600.0
"""Overall deadline of one :func:`ask_colleague` call, seconds."""
DEFAULT_CONNECT_TIMEOUT = 10.0
"""Connect (and write/pool) timeout of the HTTP client, seconds."""
_CANCEL_TIMEOUT = 5.0


def colleague_http_client(
    *,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    idle_timeout: float | None = None,
) -> httpx.AsyncClient:
    """An httpx client suited to A2A streams: ``idle_timeout`` as the read timeout.

    ``idle_timeout=None`` (the default) never cuts a silent stream off; the overall
    deadline of :func:`ask_colleague` bounds the call instead. The caller owns (closes)
    the client.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=connect_timeout, read=idle_timeout, write=connect_timeout, pool=connect_timeout
        )
    )


def _check_timeout(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds or None, got {value!r}")


def _user_message(
    text: str, context_id: str | None, task_id: str | None, metadata: Mapping[str, Any] | None
) -> Message:
    message = Message(
        role=Role.ROLE_USER,
        message_id=uuid.uuid4().hex,
        parts=[Part(text=well_formed(text))],  # protobuf refuses a lone surrogate
        context_id=context_id or "",
        task_id=task_id or "",
    )
    if metadata:
        try:
            message.metadata.update(dict(metadata))
        except (TypeError, ValueError) as error:
            raise ConfigError(f"metadata must be a JSON object: {error}") from None
    return message


async def _aclose(stream: object) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def _cancel_remote(client: Client, task_ids: tuple[str, ...]) -> None:
    """Ask the colleague to stop tasks we gave up on; best effort, bounded, never raises."""
    for task_id in task_ids:
        try:
            await asyncio.wait_for(
                client.cancel_task(CancelTaskRequest(id=task_id)), _CANCEL_TIMEOUT
            )
        except Exception as error:  # the colleague may have finished or be unreachable
            logger.debug("a2a: could not cancel task %s: %s", task_id, error)


async def _ask(
    colleague: Client | AgentCard | str,
    request: SendMessageRequest,
    adapter: A2AStreamAdapter,
    stack: AsyncExitStack,
    clients: list[Client],
    http_client: httpx.AsyncClient | None,
    connect_timeout: float,
    idle_timeout: float | None,
) -> None:
    """:func:`stream_colleague`'s work within its deadline: connect (a client made here is
    closed with ``stack``; the one used is appended to ``clients``), send the message and
    feed the colleague's events to ``adapter`` until it has the final state."""
    client: Client
    if isinstance(colleague, (str, AgentCard)):
        http = http_client
        if http is None:
            http = colleague_http_client(connect_timeout=connect_timeout, idle_timeout=idle_timeout)
            stack.push_async_callback(http.aclose)
        client = await create_client(
            colleague, client_config=ClientConfig(streaming=True, httpx_client=http)
        )
        stack.push_async_callback(client.close)
    else:
        client = colleague
    clients.append(client)
    events = client.send_message(request)
    try:
        async for event in events:
            adapter.feed(event)
            if adapter.finished:
                return
    finally:  # release the HTTP stream now, also when leaving early
        await _aclose(events)


async def stream_colleague(
    colleague: Client | AgentCard | str,
    text: str,
    *,
    conversation_id: str | None = None,
    context_id: str | None = None,
    task_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    idle_timeout: float | None = None,
    cancel_on_timeout: bool = True,
    http_client: httpx.AsyncClient | None = None,
    publish: Publisher | None = None,
    tool_name: str = "ask_colleague",
) -> ColleagueReply:
    """Ask a colleague over A2A, stream its progress into blocks, return how it ended.

    ``colleague`` is an a2a-sdk ``Client`` (used as is, and not closed: its HTTP
    timeouts are the caller's), an ``AgentCard`` or the agent's base URL (then a client
    is made with :func:`colleague_http_client`, or over ``http_client``, and closed).
    ``context_id`` continues a conversation with the colleague, ``task_id`` continues a
    task that asked for input; ``metadata`` goes on the message. ``text`` goes with each
    lone surrogate replaced by U+FFFD (:func:`kernel_ext.protocol.well_formed`): A2A's
    protobuf cannot carry one.

    ``timeout`` is the overall deadline (``None``: none), ``idle_timeout`` the longest
    silence allowed between events, ``connect_timeout`` bounds connecting. On a deadline
    the colleague's open task is cancelled when ``cancel_on_timeout``.

    Guarantees: every stream (callId, taskId) it starts gets exactly one terminal block;
    nothing raises out of it except :class:`~kernel_ext.errors.ConfigError` for bad
    arguments (before any network) and ``asyncio.CancelledError`` when the calling task
    is cancelled, which is re-raised after one ``aborted`` block ("the call was
    cancelled") was published. When the cancellation is a stop of the running call
    (:func:`kernel_ext.stop_call`), the colleague's open tasks are cancelled first (A2A
    ``tasks/cancel``, bounded, best effort), what the colleague said so far is recorded for
    the stopped result the model gets, and the block reads stopped.
    """
    _check_timeout("timeout", timeout)
    _check_timeout("connect_timeout", connect_timeout)
    _check_timeout("idle_timeout", idle_timeout)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"text must be a non-empty string, got {type(text).__name__}")
    adapter = A2AStreamAdapter(publish, conversation_id=conversation_id, tool_name=tool_name)
    request = SendMessageRequest(message=_user_message(text, context_id, task_id, metadata))
    clients: list[Client] = []
    async with AsyncExitStack() as stack:
        try:
            await asyncio.wait_for(
                _ask(
                    colleague,
                    request,
                    adapter,
                    stack,
                    clients,
                    http_client,
                    connect_timeout,
                    idle_timeout,
                ),
                timeout,
            )
        except asyncio.CancelledError:
            call = current_tool_call()
            if call is None or not call.stop_requested:
                adapter.close("the call was cancelled", "error")
                raise
            # Stopped by the user (kernel_ext.stop_call): the model gets what the colleague
            # said so far, the pane one stopped terminal, the colleague tasks/cancel.
            record_so_far(adapter.said_so_far)
            unfinished = adapter.open_task_ids
            adapter.close(STOPPED_MESSAGE, "canceled")
            if clients and unfinished:
                await _cancel_remote(clients[0], unfinished)
            raise
        except asyncio.TimeoutError:
            unfinished = adapter.open_task_ids
            adapter.close(f"the colleague did not finish within {timeout:g} s", "timeout")
            if cancel_on_timeout and clients and unfinished:
                await _cancel_remote(clients[0], unfinished)
        except A2AClientTimeoutError:
            limits = f"connect timeout {connect_timeout:g} s"
            if idle_timeout is not None:
                limits += f", idle timeout {idle_timeout:g} s"
            adapter.close(f"the colleague did not respond in time ({limits})", "timeout")
        except Exception as error:
            logger.info("a2a: colleague stream failed: %r", error)
            adapter.close(f"the colleague could not be reached or failed: {error}", "error")
        else:
            if not adapter.finished:
                adapter.close("the colleague's stream ended without a final state")
        final = adapter.reply
    assert final is not None  # close() always leaves one
    return final


# ask_colleague repeats stream_colleague's parameters on purpose: the tool's signature is
# read by people and by agent frameworks that build a tool schema from it.
async def ask_colleague(
    colleague: Client | AgentCard | str,
    text: str,
    *,
    conversation_id: str | None = None,
    context_id: str | None = None,
    task_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    idle_timeout: float | None = None,
    cancel_on_timeout: bool = True,
    http_client: httpx.AsyncClient | None = None,
    publish: Publisher | None = None,
    tool_name: str = "ask_colleague",
) -> str:
    """The ``ask_colleague`` tool body: stream the colleague's progress, return its answer.

    Returns the final answer text (or, when the colleague asks for input, its question).
    When the colleague gives no answer — it failed, was cancelled or rejected the task,
    its stream broke or ended early, or a deadline passed — raises
    :class:`~kernel_ext.errors.ColleagueError` whose message is the reason, *after* the
    stream's ``aborted`` block was published; the tool runtime reports that as the tool's
    error. Arguments and other guarantees: :func:`stream_colleague`.
    """
    reply = await stream_colleague(
        colleague,
        text,
        conversation_id=conversation_id,
        context_id=context_id,
        task_id=task_id,
        metadata=metadata,
        timeout=timeout,
        connect_timeout=connect_timeout,
        idle_timeout=idle_timeout,
        cancel_on_timeout=cancel_on_timeout,
        http_client=http_client,
        publish=publish,
        tool_name=tool_name,
    )
    if reply.ok:
        return reply.text
    raise ColleagueError(
        reply.text, state=reply.state, task_id=reply.task_id, context_id=reply.context_id
    )
