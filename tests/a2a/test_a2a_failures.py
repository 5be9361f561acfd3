"""A colleague that fails: it crashes, repeats its end, closes or drops the stream, cannot be
reached, hangs past the deadline or goes silent, or its task or the tool is cancelled; each
gives one terminal. A real a2a-sdk server and client on 127.0.0.1, blocks observed through a
recording test double of ``publish``.
"""

from __future__ import annotations

import asyncio

import pytest
from a2a.types import (
    TaskState,
)
from support.a2a_helpers import (
    Colleague,
    RecordingPublisher,
    _ask,
    _one_terminal,
)
from support.network import free_port

from kernel_ext.a2a import (
    ask_colleague,
)
from kernel_ext.errors import ColleagueError

pytestmark = pytest.mark.timeout(30)


@pytest.mark.network
async def test_crashing_colleague_gives_one_aborted_with_its_error(colleague: Colleague) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "crash", publisher)
    assert reply.state in ("error", "failed")
    assert "simulated crash" in reply.text
    assert _one_terminal(publisher).state == "aborted"


@pytest.mark.network
async def test_repeated_completed_from_a_fault_injecting_peer_gives_one_done(
    colleague: Colleague,
) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "repeat-completed", publisher)
    assert reply.text == "the first answer"
    assert [c.state for c in publisher.calls] == ["running", "done"]


@pytest.mark.network
async def test_stream_closing_without_a_terminal_gives_one_aborted(colleague: Colleague) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "close-early", publisher)
    assert reply.state == "incomplete"
    terminal = _one_terminal(publisher)
    assert (terminal.state, terminal.item) == (
        "aborted",
        "the colleague's stream ended without a final state",
    )
    assert terminal.task_id == reply.task_id


@pytest.mark.network
async def test_disconnect_mid_stream_gives_one_aborted_transport_error(
    colleague: Colleague,
) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "disconnect", publisher)
    assert reply.state == "error"
    assert "could not be reached or failed" in reply.text
    terminal = _one_terminal(publisher)
    assert (terminal.state, terminal.task_id) == ("aborted", reply.task_id)
    assert [c.state for c in publisher.calls] == ["running", "aborted"]


async def test_unreachable_colleague_gives_one_local_aborted() -> None:
    publisher = RecordingPublisher()
    with pytest.raises(ColleagueError) as info:
        await ask_colleague(
            f"http://127.0.0.1:{free_port()}", "hello?", publish=publisher, connect_timeout=5
        )
    assert info.value.state in ("error", "timeout")
    assert [(c.task_id, c.state) for c in publisher.calls] == [(None, "aborted")]


@pytest.mark.network
async def test_hanging_colleague_hits_the_deadline_and_its_task_is_cancelled(
    colleague: Colleague,
) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "hang", publisher, timeout=1.0)
    assert reply.state == "timeout"
    assert "did not finish within 1 s" in reply.text
    assert [c.state for c in publisher.calls] == ["running", "aborted"]
    # cancel_on_timeout asked the colleague to stop: the task is terminal on its side.
    from a2a.client import ClientConfig, create_client
    from a2a.types import GetTaskRequest

    from kernel_ext.a2a import colleague_http_client

    async with colleague_http_client() as http:
        client = await create_client(colleague.url, client_config=ClientConfig(httpx_client=http))
        task = await client.get_task(GetTaskRequest(id=reply.task_id))
        assert task.status.state == TaskState.TASK_STATE_CANCELED


@pytest.mark.network
async def test_idle_timeout_cuts_a_silent_colleague_off(colleague: Colleague) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "hang", publisher, idle_timeout=0.5)
    assert reply.state == "timeout"
    assert "idle timeout 0.5 s" in reply.text
    assert [c.state for c in publisher.calls] == ["running", "aborted"]


@pytest.mark.network
async def test_colleague_cancelled_by_another_client_gives_one_aborted(
    colleague: Colleague,
) -> None:
    from a2a.client import ClientConfig, create_client
    from a2a.types import CancelTaskRequest

    from kernel_ext.a2a import colleague_http_client

    publisher = RecordingPublisher()
    call = asyncio.create_task(_ask(colleague, "hang", publisher))
    await publisher.wait_for(lambda calls: len(calls) >= 1)
    task_id = publisher.calls[0].task_id
    async with colleague_http_client() as http:
        client = await create_client(colleague.url, client_config=ClientConfig(httpx_client=http))
        await client.cancel_task(CancelTaskRequest(id=task_id))
    reply = await asyncio.wait_for(call, 10)
    assert (reply.state, reply.text) == ("canceled", "cancelled on request")
    assert [c.state for c in publisher.calls] == ["running", "aborted"]


@pytest.mark.network
async def test_cancelling_the_tool_publishes_one_aborted_and_reraises(
    colleague: Colleague,
) -> None:
    publisher = RecordingPublisher()
    call = asyncio.create_task(_ask(colleague, "hang", publisher))
    await publisher.wait_for(lambda calls: len(calls) >= 1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert [(c.state, c.item) for c in publisher.calls][1:] == [
        ("aborted", "the call was cancelled")
    ]
