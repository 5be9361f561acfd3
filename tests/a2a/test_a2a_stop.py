"""A stopped ``ask_colleague`` stops its colleague (issue 35, point 4): the call, stopped by
:func:`kernel_ext.stop_call` while a real a2a-sdk colleague works, sends A2A
``tasks/cancel`` — the task ends ``canceled`` at the peer — returns the stopped result with
what the colleague had said so far, and its pane ends with one ``aborted`` block that says
*stopped*. A cancellation that is not a stop keeps its old ending."""

from __future__ import annotations

import asyncio

import pytest
from a2a.client import create_client
from a2a.types import GetTaskRequest, TaskState
from opentelemetry.sdk.trace import TracerProvider
from support.a2a_helpers import CONV, Colleague, Pane

from kernel_ext import ToolDescription, stop_call
from kernel_ext.a2a import ask_colleague
from kernel_ext.instrument._call import begin_scope, run_stoppable
from kernel_ext.stop import STOPPED_MESSAGE

pytestmark = pytest.mark.network

SAID = "This will take forever."  # what the peer's "hang" script says before it hangs


async def peer_state(colleague: Colleague, task_id: str) -> int:
    """The task's state as the peer reports it (``tasks/get`` over the wire)."""
    client = await create_client(colleague.url)
    try:
        task = await client.get_task(GetTaskRequest(id=task_id))
    finally:
        await client.close()
    return int(task.status.state)


async def asking(
    colleague: Colleague, pane: Pane, provider: TracerProvider
) -> tuple[str, asyncio.Task[str]]:
    """A wrapped ``ask_colleague`` call asking the peer's "hang" script, once its first
    block reached the pane: its call id and the task that runs it."""
    active = begin_scope(ToolDescription("ask_colleague", CONV), provider, pane.hub)
    assert active is not None
    assert active.call is not None
    call_id = active.call.call_id

    async def body() -> str:
        return await ask_colleague(colleague.url, "script:hang", publish=pane.hub.publish)

    task = asyncio.create_task(run_stoppable(active, body))
    await pane.emitter.wait_for(
        lambda records: any(b["callId"] == call_id for _, b in records), timeout=10
    )
    return call_id, task


async def test_a_stopped_ask_colleague_cancels_the_colleagues_task(
    colleague: Colleague, pane: Pane
) -> None:
    provider = TracerProvider()
    call_id, task = await asking(colleague, pane, provider)
    [first] = pane.blocks(call_id)
    task_id = first["taskId"]
    assert await peer_state(colleague, task_id) == TaskState.TASK_STATE_WORKING

    assert stop_call(call_id) == "stopping"
    result = await asyncio.wait_for(task, 20)
    assert result.startswith("The user stopped this tool call")
    assert SAID in result  # what the colleague had said so far reaches the model

    assert await peer_state(colleague, task_id) == TaskState.TASK_STATE_CANCELED
    await pane.wait_terminals(1)
    await pane.emitter.flush(2)
    ends = [b for b in pane.blocks(call_id) if b["state"] != "running"]
    assert len(ends) == 1
    assert (ends[0]["taskId"], ends[0]["state"], ends[0]["envelope"]["payload"]) == (
        task_id,
        "aborted",
        {"message": STOPPED_MESSAGE, "stopped": True},
    )
    provider.shutdown()


async def test_a_cancellation_that_is_not_a_stop_still_reads_cancelled(
    colleague: Colleague, pane: Pane
) -> None:
    provider = TracerProvider()
    call_id, task = await asking(colleague, pane, provider)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await pane.wait_terminals(1)
    await pane.emitter.flush(2)
    ends = [b for b in pane.blocks(call_id) if b["state"] != "running"]
    assert [b["envelope"]["payload"] for b in ends] == [{"message": "the call was cancelled"}]
    provider.shutdown()
