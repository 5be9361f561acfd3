"""Real stoppable calls for the tests of the relay's side of ``stop_call``: a tool call
running under the wrapped runtime (:func:`~kernel_ext.instrument._call.run_stoppable`) that
says one thing into its pane and waits until it is stopped, and a browser's request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from kernel_ext import ToolDescription, current_tool_call
from kernel_ext.instrument._call import begin_scope, run_stoppable
from kernel_ext.protocol import STOP_EVENT, STOPPED_KEY
from kernel_ext.stream import StreamHub
from support.relay_helpers import NS, Browser
from support.timing import CALL_TIMEOUT


@dataclass
class RunningCall:
    """A call that runs until it is stopped: its ``call_id``, its ``task`` (its result is
    what the wrapped call returned) and ``stop_seen`` (``stop_requested`` as the tool saw it
    when it was cancelled)."""

    call_id: str
    task: asyncio.Task[Any]
    stop_seen: list[bool] = field(default_factory=list)


@contextlib.asynccontextmanager
async def running_call(hub: StreamHub, room: str) -> AsyncIterator[RunningCall]:
    """A call of conversation ``room`` whose first running block went to ``hub``, running
    until it is stopped; cancelled at the end if it still runs."""
    async with _call(hub, room, "slow", asyncio.Event()) as call:
        yield call


@contextlib.asynccontextmanager
async def gated_call(hub: StreamHub, room: str, gate: asyncio.Event) -> AsyncIterator[RunningCall]:
    """A call of conversation ``room`` that answers ``"done"`` once ``gate`` opens (unless it
    is stopped first); its first running block went to ``hub``."""
    async with _call(hub, room, "gated", gate) as call:
        yield call


@contextlib.asynccontextmanager
async def _call(
    hub: StreamHub, room: str, tool_name: str, gate: asyncio.Event
) -> AsyncIterator[RunningCall]:
    """A wrapped call of tool ``tool_name`` that says one thing into its pane, then answers
    ``"done"`` once ``gate`` opens; cancelled at the end if it still runs."""
    provider = TracerProvider()
    live = asyncio.Event()
    seen: list[bool] = []

    async def tool() -> str:
        call = current_tool_call()
        assert call is not None
        hub.publish("working on it", task_id=call.call_id)
        live.set()
        try:
            await gate.wait()
        finally:
            seen.append(call.stop_requested)
        return "done"

    active = begin_scope(ToolDescription(tool_name, room), provider, hub)
    assert active is not None
    assert active.call is not None
    task = asyncio.create_task(run_stoppable(active, tool))
    await asyncio.wait_for(live.wait(), CALL_TIMEOUT)
    try:
        yield RunningCall(active.call.call_id, task, seen)
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await task
        provider.shutdown()


async def ask_stop(browser: Browser, data: Any) -> Any:
    """``browser``'s ``stop_call`` with ``data``: the relay's acknowledgement."""
    return await browser.client.call(STOP_EVENT, data, namespace=NS, timeout=CALL_TIMEOUT)


def stop(room: str, call_id: str) -> dict[str, Any]:
    """A well-formed stop request."""
    return {"v": 1, "room": room, "callId": call_id}


def stopped_terminals(blocks: list[dict[str, Any]], call_id: str) -> list[dict[str, Any]]:
    """The terminals of ``call_id`` among ``blocks``."""
    return [b for b in blocks if b["callId"] == call_id and b["state"] != "running"]


def is_stopped(block: dict[str, Any]) -> bool:
    """Whether ``block`` is an ``aborted`` block that says the user stopped the call."""
    payload = block["envelope"].get("payload") or {}
    return block["state"] == "aborted" and payload.get(STOPPED_KEY) is True
