"""A2A → blocks: the adapter's rules, and every colleague variant end to end.

The colleague is kernel_ext.a2a_peer's real a2a-sdk server, served by uvicorn on
127.0.0.1 inside the test's loop; the caller is a real a2a-sdk client. Blocks are
observed through a recording test double of ``publish`` here, and through the real
StreamHub in the end-to-end section below.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from a2a.helpers import new_data_part, new_text_part
from a2a.types import (
    Artifact,
    Message,
    Part,
    Role,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from network import free_port, serve_asgi
from timing import FakeClock, wait_until

from kernel_ext.a2a import (
    A2AStreamAdapter,
    ColleagueReply,
    ask_colleague,
    integral_floats_to_ints,
    stream_colleague,
)
from kernel_ext.a2a_peer import COUNT_KEY, DELAY_KEY, SCRIPT_KEY, ScriptedPeer, script_of
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.errors import ColleagueError, ConfigError
from kernel_ext.protocol import Envelope, decode
from kernel_ext.stream import StreamHub, set_default_hub
from kernel_ext.tap import LiveCall, Tap
from kernel_ext.testing import MemoryEmitter

pytestmark = pytest.mark.timeout(30)

# -- a recording test double of kernel_ext.stream.publish ---------------------------------


@dataclass(frozen=True)
class Published:
    item: Any
    task_id: str | None
    state: str
    conversation_id: str | None
    tool_name: str
    provisional: bool = False

    @property
    def envelope(self) -> Envelope:
        assert isinstance(self.item, Envelope)
        return self.item


class RecordingPublisher:
    """Test double of ``publish``: records every call; ``wait_for`` polls with a deadline."""

    def __init__(self, *, fail: bool = False) -> None:
        self.calls: list[Published] = []
        self.fail = fail
        self._changed = asyncio.Event()

    def __call__(
        self,
        item: Any,
        *,
        task_id: str | None = None,
        state: str = "running",
        conversation_id: str | None = None,
        tool_name: str = "ask_colleague",
        provisional: bool = False,
    ) -> None:
        self.calls.append(Published(item, task_id, state, conversation_id, tool_name, provisional))
        self._changed.set()
        if self.fail:
            raise RuntimeError("publisher double told to fail")

    def terminals(self, task_id: str | None = ...) -> list[Published]:  # type: ignore[assignment]
        """Terminal publishes (provisional ones are not terminals yet)."""
        return [
            c
            for c in self.calls
            if c.state != "running"
            and not c.provisional
            and (task_id is ... or c.task_id == task_id)
        ]

    def provisionals(self) -> list[Published]:
        return [c for c in self.calls if c.provisional]

    def running(self) -> list[Published]:
        return [c for c in self.calls if c.state == "running"]

    async def wait_for(
        self, predicate: Callable[[list[Published]], bool], timeout: float = 10
    ) -> None:
        await wait_until(
            lambda: predicate(self.calls),
            timeout,
            lambda: f"condition not met; calls: {self.calls}",
            wake=self._changed,
        )


# -- hand-built A2A events for the adapter's unit tests ------------------------------------

TASK = "task-1"
CTX = "ctx-1"


def _task_event(task_id: str = TASK, state: int = TaskState.TASK_STATE_SUBMITTED) -> StreamResponse:
    return StreamResponse(task=Task(id=task_id, context_id=CTX, status=TaskStatus(state=state)))


def _status(state: int, parts: list[Part] | None = None, task_id: str = TASK) -> StreamResponse:
    status = TaskStatus(state=state)
    if parts is not None:
        status.message.CopyFrom(
            Message(
                role=Role.ROLE_AGENT, message_id="m", task_id=task_id, context_id=CTX, parts=parts
            )
        )
    return StreamResponse(
        status_update=TaskStatusUpdateEvent(task_id=task_id, context_id=CTX, status=status)
    )


def _envelope(seq: Any = 1, **extra: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "kind": "thinking",
        "streamKey": TASK,
        "seq": seq,
        "status": "running",
        "payload": {"text": "hm"},
    } | extra


WORKING = TaskState.TASK_STATE_WORKING
COMPLETED = TaskState.TASK_STATE_COMPLETED


def _adapter(publisher: RecordingPublisher) -> A2AStreamAdapter:
    return A2AStreamAdapter(publisher, conversation_id="conv-1", tool_name="ask_colleague")


def test_working_envelope_passes_through_with_integral_floats_back_to_ints() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    env = _envelope(
        seq=7, payload={"n": 3, "score": 0.75, "list": [1, 2.5, {"k": 4}]}, extra={"custom": 2}
    )
    adapter.feed(_task_event())
    adapter.feed(_status(WORKING, [new_data_part(env)]))

    [call] = publisher.calls
    assert (call.task_id, call.state, call.conversation_id) == (TASK, "running", "conv-1")
    wire = call.envelope.model_dump(by_alias=True, mode="json")
    assert wire == env
    assert type(wire["seq"]) is int
    assert type(wire["v"]) is int
    assert type(wire["payload"]["n"]) is int
    assert wire["payload"]["score"] == 0.75
    assert type(wire["payload"]["list"][2]["k"]) is int
    assert wire["payload"]["list"][1] == 2.5
    assert type(wire["extra"]["custom"]) is int


def test_integral_floats_to_ints_is_recursive_and_keeps_other_values() -> None:
    value = {"a": 3.0, "b": [1.0, 1.5, {"c": -2.0}], "d": "3.0", "e": True, "f": None}
    assert integral_floats_to_ints(value) == {
        "a": 3,
        "b": [1, 1.5, {"c": -2}],
        "d": "3.0",
        "e": True,
        "f": None,
    }
    assert type(integral_floats_to_ints(3.0)) is int
    assert integral_floats_to_ints(float("inf")) == float("inf")


def test_text_only_working_update_becomes_text_for_a_pseudo_envelope() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    adapter.feed(_status(WORKING, [new_text_part("looking"), new_text_part("it up")]))
    [call] = publisher.calls
    assert (call.item, call.task_id, call.state) == ("looking\nit up", TASK, "running")
    assert adapter.stats.texts == 1


def test_malformed_envelope_with_text_is_degraded_to_the_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    with caplog.at_level(logging.WARNING, logger="kernel_ext.a2a"):
        adapter.feed(_status(WORKING, [new_data_part(_envelope(seq=-1)), new_text_part("t")]))
    [call] = publisher.calls
    assert call.item == "t"
    assert (adapter.stats.degraded, adapter.stats.invalid) == (1, 0)
    assert "malformed envelope" in caplog.text
    assert "seq" in caplog.text


def test_malformed_envelope_without_text_is_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    with caplog.at_level(logging.WARNING, logger="kernel_ext.a2a"):
        adapter.feed(_status(WORKING, [new_data_part(_envelope(seq="ten"))]))
        adapter.feed(_status(WORKING, [new_data_part(["a", "list"])]))
        adapter.feed(_status(WORKING, [new_data_part({"seq": 1})]))
    assert publisher.calls == []
    assert adapter.stats.invalid == 3
    assert caplog.text.count("malformed envelope") == 1  # WARNING once per task, then DEBUG


def test_valid_envelopes_win_over_text_and_bad_siblings_are_dropped() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    adapter.feed(
        _status(
            WORKING,
            [new_data_part(_envelope(seq=1)), new_data_part(_envelope(seq=-5)), new_text_part("t")],
        )
    )
    [call] = publisher.calls
    assert call.envelope.seq == 1
    assert adapter.stats.invalid == 1


def test_once_a_task_sent_envelopes_text_only_updates_are_not_shown() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    adapter.feed(_status(WORKING, [new_text_part("before any envelope")]))
    adapter.feed(_status(WORKING, [new_data_part(_envelope(seq=5))]))
    adapter.feed(_status(WORKING, [new_text_part("text between envelopes")]))
    adapter.feed(_status(WORKING, [new_data_part(_envelope(seq=-1)), new_text_part("t")]))
    assert [c.item if isinstance(c.item, str) else c.envelope.seq for c in publisher.calls] == [
        "before any envelope",
        5,
    ]
    assert (adapter.stats.skipped, adapter.stats.invalid, adapter.stats.degraded) == (2, 1, 0)


@pytest.mark.parametrize(
    ("state", "block_state", "reply_state", "default"),
    [
        (TaskState.TASK_STATE_FAILED, "aborted", "failed", "the colleague failed"),
        (
            TaskState.TASK_STATE_CANCELED,
            "aborted",
            "canceled",
            "the colleague's task was cancelled",
        ),
        (TaskState.TASK_STATE_REJECTED, "aborted", "rejected", "the colleague rejected the task"),
    ],
)
def test_end_states_map_to_one_terminal_with_the_peers_message_or_a_default(
    state: int, block_state: str, reply_state: str, default: str
) -> None:
    for parts, text in (([new_text_part("why")], "why"), (None, default)):
        publisher = RecordingPublisher()
        adapter = _adapter(publisher)
        adapter.feed(_task_event())
        adapter.feed(_status(state, parts))
        [call] = publisher.calls
        assert (call.item, call.state, call.task_id) == (text, block_state, TASK)
        assert adapter.finished
        assert adapter.reply is not None
        assert adapter.reply.state == reply_state


@pytest.mark.parametrize(
    ("state", "block_state", "reply_state", "default"),
    [
        (
            TaskState.TASK_STATE_INPUT_REQUIRED,
            "done",
            "input_required",
            "the colleague needs more input",
        ),
        (
            TaskState.TASK_STATE_AUTH_REQUIRED,
            "aborted",
            "auth_required",
            "the colleague requires authentication",
        ),
    ],
)
def test_interrupted_states_show_the_question_and_leave_a_provisional_terminal(
    state: int, block_state: str, reply_state: str, default: str
) -> None:
    """input-required and auth-required are not terminal in A2A: the question is a running
    block and the stream's terminal is provisional (sent by the hub if the call ends)."""
    for parts, text in (([new_text_part("which one?")], "which one?"), (None, default)):
        publisher = RecordingPublisher()
        adapter = _adapter(publisher)
        adapter.feed(_task_event())
        adapter.feed(_status(state, parts))
        expected = [("which one?", "running", False)] if parts else []
        expected.append((text, block_state, True))
        assert [(c.item, c.state, c.provisional) for c in publisher.calls] == expected
        assert publisher.terminals() == []
        assert adapter.finished  # nothing more to read: the colleague waits
        assert adapter.open_task_ids == ()
        assert adapter.reply is not None
        assert (adapter.reply.state, adapter.reply.text) == (reply_state, text)
        # The stream ending here does not abort the waiting task.
        adapter.close("the colleague's stream ended without a final state")
        assert publisher.terminals() == []
        # The same task going on in the same adapter ends with its own terminal.
        adapter.feed(_status(WORKING, [new_text_part("thanks, looking")]))
        adapter.feed(_status(COMPLETED, [new_text_part("the real answer")]))
        assert [(c.item, c.state) for c in publisher.terminals()] == [("the real answer", "done")]


def test_completed_takes_the_message_text_else_the_artifacts() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    adapter.feed(_status(COMPLETED, [new_text_part("the answer")]))
    assert publisher.calls[0].item == "the answer"

    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    chunk = TaskArtifactUpdateEvent(
        task_id=TASK,
        context_id=CTX,
        artifact=Artifact(artifact_id="a", parts=[new_text_part("Re")]),
    )
    more = TaskArtifactUpdateEvent(
        task_id=TASK,
        context_id=CTX,
        append=True,
        artifact=Artifact(artifact_id="a", parts=[new_text_part("port")]),
    )
    other = TaskArtifactUpdateEvent(
        task_id=TASK, context_id=CTX, artifact=Artifact(artifact_id="b", parts=[new_text_part("B")])
    )
    for update in (chunk, more, other):
        adapter.feed(StreamResponse(artifact_update=update))
    adapter.feed(_status(COMPLETED))
    assert publisher.calls == [Published("Report\nB", TASK, "done", "conv-1", "ask_colleague")]


def test_completed_task_snapshot_is_answered_from_its_artifacts() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    snapshot = Task(
        id=TASK,
        context_id=CTX,
        status=TaskStatus(state=COMPLETED),
        artifacts=[Artifact(artifact_id="a", parts=[new_text_part("final")])],
    )
    adapter.feed(StreamResponse(task=snapshot))
    assert [(c.item, c.state) for c in publisher.calls] == [("final", "done")]


def test_anything_after_a_terminal_is_ignored() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    adapter.feed(_status(COMPLETED, [new_text_part("first")]))
    adapter.feed(_status(COMPLETED, [new_text_part("second")]))
    adapter.feed(_status(WORKING, [new_data_part(_envelope())]))
    adapter.feed(_status(TaskState.TASK_STATE_FAILED, [new_text_part("late")]))
    adapter.close("closing")
    assert [(c.item, c.state) for c in publisher.calls] == [("first", "done")]
    assert adapter.stats.ignored == 3
    assert adapter.stats.terminals == 1


def test_each_task_keeps_its_own_task_id_and_terminal() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    adapter.feed(_status(WORKING, [new_text_part("a")], task_id="A"))
    adapter.feed(_status(WORKING, [new_text_part("b")], task_id="B"))
    adapter.feed(_status(COMPLETED, [new_text_part("done A")], task_id="A"))
    assert not adapter.finished
    assert adapter.open_task_ids == ("B",)
    reply = adapter.close("stream ended")
    assert [(c.task_id, c.state, c.item) for c in publisher.calls] == [
        ("A", "running", "a"),
        ("B", "running", "b"),
        ("A", "done", "done A"),
        ("B", "aborted", "stream ended"),
    ]
    assert reply.task_ids == ("A", "B")


def test_close_without_any_task_publishes_one_local_aborted_block() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    reply = adapter.close("connection refused", "error")
    adapter.close("again", "error")
    assert [(c.item, c.task_id, c.state) for c in publisher.calls] == [
        ("connection refused", None, "aborted")
    ]
    assert (reply.state, reply.ok, reply.task_id) == ("error", False, None)


def test_direct_message_reply_is_the_answer() -> None:
    publisher = RecordingPublisher()
    adapter = _adapter(publisher)
    adapter.feed(
        StreamResponse(
            message=Message(role=Role.ROLE_AGENT, message_id="m", parts=[new_text_part("hi")])
        )
    )
    adapter.close("late")
    assert [(c.item, c.task_id, c.state) for c in publisher.calls] == [("hi", None, "done")]
    assert adapter.reply is not None
    assert adapter.reply.ok


def test_a_raising_publisher_never_reaches_the_caller() -> None:
    publisher = RecordingPublisher(fail=True)
    adapter = _adapter(publisher)
    adapter.feed(_status(WORKING, [new_data_part(_envelope())]))
    adapter.feed(_status(COMPLETED, [new_text_part("x")]))
    assert [c.state for c in publisher.calls] == ["running", "done"]
    assert adapter.finished


def test_script_selection_by_metadata_or_text() -> None:
    msg = Message(role=Role.ROLE_USER, message_id="m", parts=[new_text_part("script:fail now")])
    assert script_of(msg) == "fail"
    msg.metadata.update({SCRIPT_KEY: "hang"})
    assert script_of(msg) == "hang"
    assert script_of(Message(role=Role.ROLE_USER, parts=[new_text_part("script:nope")])) == "work"


# -- end to end: real peer, real client, recording publisher --------------------------------


@dataclass
class Colleague:
    url: str
    peer: ScriptedPeer


@pytest.fixture
async def colleague() -> AsyncIterator[Colleague]:
    port = free_port()
    peer = ScriptedPeer(f"http://127.0.0.1:{port}/", flood_count=100)
    async with serve_asgi(peer.app, port):
        try:
            yield Colleague(f"http://127.0.0.1:{port}", peer)
        finally:
            await peer.aclose()


async def _ask(
    colleague: Colleague, script: str, publisher: RecordingPublisher, **kwargs: Any
) -> Any:
    meta: Mapping[str, Any] = {SCRIPT_KEY: script, **kwargs.pop("metadata", {})}
    return await stream_colleague(
        colleague.url, f"where is order 42 ({script})?", metadata=meta, publish=publisher, **kwargs
    )


def _one_terminal(publisher: RecordingPublisher) -> Published:
    [terminal] = publisher.terminals()
    assert publisher.calls[-1] is terminal
    return terminal


@pytest.mark.network
async def test_working_colleague_streams_envelopes_then_one_done(colleague: Colleague) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "work", publisher)
    assert reply.ok
    assert reply.state == "completed"
    assert reply.text == "Order 42 shipped on Monday; it arrives Friday."
    envelopes = [c.envelope for c in publisher.running()]
    assert [e.kind for e in envelopes] == ["thinking", "tool_call", "tool_call", "text"]
    assert [e.seq for e in envelopes] == [1, 2, 3, 4]
    fetch = envelopes[2].payload
    assert fetch["args"] == {"id": 42, "score": 0.75, "weights": [1, 2.5]}
    assert type(fetch["args"]["id"]) is int
    terminal = _one_terminal(publisher)
    assert (terminal.state, terminal.item) == ("done", reply.text)
    assert {c.task_id for c in publisher.calls} == {reply.task_id}


@pytest.mark.network
async def test_ask_colleague_returns_the_final_text(colleague: Colleague) -> None:
    publisher = RecordingPublisher()
    answer = await ask_colleague(
        colleague.url, "where is my order?", publish=publisher, conversation_id="conv-9"
    )
    assert answer == "Order 42 shipped on Monday; it arrives Friday."
    assert {c.conversation_id for c in publisher.calls} == {"conv-9"}


@pytest.mark.parametrize(
    ("script", "state", "message"),
    [
        ("fail", "failed", "the order database is unreachable"),
        ("cancel", "canceled", "cancelled by the colleague's operator"),
        ("reject", "rejected", "I do not handle refunds"),
    ],
)
@pytest.mark.network
async def test_failing_colleague_gives_one_aborted_then_ask_raises(
    colleague: Colleague, script: str, state: str, message: str
) -> None:
    publisher = RecordingPublisher()
    with pytest.raises(ColleagueError) as info:
        await ask_colleague(colleague.url, f"script:{script} please", publish=publisher)
    assert (info.value.state, str(info.value)) == (state, message)
    terminal = _one_terminal(publisher)
    assert (terminal.state, terminal.item, terminal.task_id) == (
        "aborted",
        message,
        info.value.task_id,
    )


@pytest.mark.network
async def test_text_only_colleague_gives_pseudo_envelope_texts(colleague: Colleague) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "text", publisher)
    assert [c.item for c in publisher.running()] == [
        "Reading your question",
        "Looking it up",
        "Writing the answer",
    ]
    assert (reply.text, _one_terminal(publisher).state) == (
        "Plain answer without envelopes.",
        "done",
    )


@pytest.mark.network
async def test_malformed_envelopes_are_degraded_or_dropped_never_raised(
    colleague: Colleague,
) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "malformed", publisher)
    assert reply.ok
    assert reply.text == "answer despite malformed envelopes"
    items = [c.item for c in publisher.running()]
    assert items[0] == "degraded to text"
    assert isinstance(items[1], Envelope)
    assert items[1].seq == 11
    assert len(items) == 2
    assert (reply.stats.degraded, reply.stats.invalid, reply.stats.skipped) == (1, 4, 1)


@pytest.mark.network
async def test_answer_from_artifacts_when_the_completed_message_is_empty(
    colleague: Colleague,
) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "artifact", publisher)
    assert reply.text == "Report: all orders shipped."
    assert _one_terminal(publisher).item == "Report: all orders shipped."


@pytest.mark.network
async def test_input_required_is_answered_with_the_question_and_can_be_followed_up(
    colleague: Colleague,
) -> None:
    publisher = RecordingPublisher()
    reply = await _ask(colleague, "input", publisher)
    assert (reply.state, reply.text) == ("input_required", "Which order do you mean?")
    assert publisher.terminals() == []
    [provisional] = publisher.provisionals()
    assert (provisional.state, provisional.item) == ("done", "Which order do you mean?")
    shown = [c.envelope.payload.get("text") for c in publisher.running()]
    assert "Which order do you mean?" in shown  # the question, shown as a running block
    asked = len(publisher.calls)
    answer = await _ask(
        colleague, "work", publisher, context_id=reply.context_id, task_id=reply.task_id
    )
    assert answer.ok
    assert answer.task_id == reply.task_id
    assert _one_terminal(publisher).item == "Order 42 shipped on Monday; it arrives Friday."
    seqs = [c.envelope.seq for c in publisher.running()]
    assert seqs == sorted(set(seqs))  # the follow-up continues the task's seq space
    assert all(c.task_id == reply.task_id for c in publisher.calls[asked:])


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


@pytest.mark.network
async def test_follow_up_under_one_call_is_its_own_stream(colleague: Colleague) -> None:
    publisher = RecordingPublisher()
    first = await _ask(colleague, "text", publisher)
    second = await _ask(colleague, "work", publisher, context_id=first.context_id)
    assert first.task_id != second.task_id
    assert first.context_id == second.context_id
    for task_id in (first.task_id, second.task_id):
        assert len(publisher.terminals(task_id)) == 1
    assert {c.task_id for c in publisher.calls} == {first.task_id, second.task_id}


async def test_bad_arguments_raise_config_error_before_any_network() -> None:
    publisher = RecordingPublisher()
    with pytest.raises(ConfigError, match="timeout"):
        await ask_colleague("http://127.0.0.1:9", "hi", timeout=0, publish=publisher)
    with pytest.raises(ConfigError, match="text"):
        await ask_colleague("http://127.0.0.1:9", "  ", publish=publisher)
    with pytest.raises(ConfigError, match="metadata"):
        await ask_colleague("http://127.0.0.1:9", "hi", metadata={"x": object()}, publish=publisher)
    assert publisher.calls == []


# -- end to end through the real StreamHub and a MemoryEmitter ------------------------------

CALL_A = "00f067aa0ba902b7"
CALL_B = "5b8aa5a2d2c872e8"
CONV = "conv-a2a"


@dataclass
class Pane:
    hub: StreamHub
    emitter: MemoryEmitter
    clock: FakeClock

    def blocks(self, call_id: str | None = None) -> list[dict[str, Any]]:
        return [b for b in self.emitter.blocks(CONV) if call_id is None or b["callId"] == call_id]

    async def wait_terminals(self, n: int = 1) -> None:
        await self.emitter.wait_for(
            lambda records: sum(b["state"] != "running" for _, b in records) >= n, timeout=10
        )


@pytest.fixture
async def pane() -> AsyncIterator[Pane]:
    clock = FakeClock(5000.0)
    hub = StreamHub(clock=clock, tap=Tap())
    emitter = MemoryEmitter(hub=hub)
    await emitter.start()
    try:
        yield Pane(hub, emitter, clock)
    finally:
        await emitter.stop(timeout=2)


def _in_call(call_id: str) -> Any:
    return use_tool_call(ToolCall(call_id, "ask_colleague", CONV))


def _check_stream(
    blocks: list[dict[str, Any]], call_id: str, task_id: str | None
) -> dict[str, Any]:
    """Every block valid on the wire, attributed to the call, ordered by seq, one terminal last."""
    assert blocks, "no blocks"
    for block in blocks:
        decode(block)
        assert (block["callId"], block["taskId"]) == (call_id, task_id or call_id)
    running = [b["envelope"]["seq"] for b in blocks if b["state"] == "running"]
    assert running == sorted(set(running))
    terminals = [b for b in blocks if b["state"] != "running"]
    assert len(terminals) == 1
    assert blocks[-1] is terminals[0]
    return terminals[0]


@pytest.mark.parametrize(
    ("script", "state", "text"),
    [
        ("work", "done", "Order 42 shipped on Monday; it arrives Friday."),
        ("text", "done", "Plain answer without envelopes."),
        ("malformed", "done", "answer despite malformed envelopes"),
        ("fail", "aborted", "the order database is unreachable"),
        ("cancel", "aborted", "cancelled by the colleague's operator"),
        ("reject", "aborted", "I do not handle refunds"),
        ("repeat-completed", "done", "the first answer"),
        ("close-early", "aborted", "the colleague's stream ended without a final state"),
    ],
)
@pytest.mark.network
async def test_each_variant_through_the_hub_gives_ordered_blocks_and_one_terminal(
    colleague: Colleague, pane: Pane, script: str, state: str, text: str
) -> None:
    with _in_call(CALL_A):
        reply = await stream_colleague(
            colleague.url,
            "where is order 42?",
            metadata={SCRIPT_KEY: script},
            publish=pane.hub.publish,
        )
    await pane.wait_terminals()
    terminal = _check_stream(pane.blocks(), CALL_A, reply.task_id)
    key = "text" if state == "done" else "message"
    assert (terminal["state"], terminal["envelope"]["payload"][key]) == (state, text)


@pytest.mark.network
async def test_peer_envelopes_reach_the_wire_unchanged_with_integers(
    colleague: Colleague, pane: Pane
) -> None:
    with _in_call(CALL_A):
        answer = await ask_colleague(colleague.url, "script:work", publish=pane.hub.publish)
    await pane.wait_terminals()
    running = [b["envelope"] for b in pane.blocks() if b["state"] == "running"]
    assert [e["kind"] for e in running] == ["thinking", "tool_call", "tool_call", "text"]
    assert running[2]["payload"] == {
        "name": "fetch_order",
        "args": {"id": 42, "score": 0.75, "weights": [1, 2.5]},
    }
    assert type(running[2]["payload"]["args"]["id"]) is int
    assert answer == pane.blocks()[-1]["envelope"]["payload"]["text"]


@pytest.mark.network
async def test_flood_is_throttled_to_ten_running_per_second_and_the_terminal_is_intact(
    colleague: Colleague, pane: Pane
) -> None:
    count = 1200

    def flood_clock_publisher(item: Any, **kwargs: Any) -> None:
        # The hub sees the flood at its nominal rate: one update per millisecond.
        if kwargs.get("state", "running") == "running":
            pane.clock.now += 0.001
        pane.hub.publish(item, **kwargs)

    with _in_call(CALL_A):
        reply = await stream_colleague(
            colleague.url,
            "flood",
            metadata={SCRIPT_KEY: "flood", COUNT_KEY: count},
            publish=flood_clock_publisher,
        )
    await pane.wait_terminals()
    blocks = pane.blocks()
    terminal = _check_stream(blocks, CALL_A, reply.task_id)
    assert terminal["envelope"]["payload"]["text"] == f"flooded {count} updates"
    running = [b for b in blocks if b["state"] == "running"]
    assert reply.stats.envelopes == count
    # 1.2 s of hub time: the first second's 10 blocks, then 10 more from t = 1 s on.
    assert len(running) == 20
    assert pane.hub.stats()["throttled"] == count - len(running)


@pytest.mark.network
async def test_tool_cancellation_through_the_hub_ends_the_stream_once(
    colleague: Colleague, pane: Pane
) -> None:
    async def tool() -> str:
        with _in_call(CALL_A):
            return await ask_colleague(colleague.url, "script:hang", publish=pane.hub.publish)

    call = asyncio.create_task(tool())
    await pane.emitter.wait_for(lambda records: len(records) >= 1, timeout=10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await pane.wait_terminals()
    terminal = _check_stream(pane.blocks(), CALL_A, pane.blocks()[0]["taskId"])
    assert terminal["envelope"]["payload"]["message"] == "the call was cancelled"


async def test_unreachable_colleague_ends_the_calls_local_stream(pane: Pane) -> None:
    with _in_call(CALL_A), pytest.raises(ColleagueError):
        await ask_colleague(f"http://127.0.0.1:{free_port()}", "hello?", publish=pane.hub.publish)
    await pane.wait_terminals()
    terminal = _check_stream(pane.blocks(), CALL_A, None)
    assert terminal["state"] == "aborted"


@pytest.mark.network
async def test_two_calls_at_once_in_one_conversation_are_each_attributed_to_their_call(
    colleague: Colleague, pane: Pane
) -> None:
    async def tool(call_id: str, script: str) -> ColleagueReply:
        with _in_call(call_id):
            return await stream_colleague(
                colleague.url,
                f"script:{script} go",
                publish=pane.hub.publish,
                metadata={DELAY_KEY: 0.01},
            )

    reply_a, reply_b = await asyncio.gather(tool(CALL_A, "work"), tool(CALL_B, "text"))
    await pane.wait_terminals(2)
    assert reply_a.task_id != reply_b.task_id
    a = _check_stream(pane.blocks(CALL_A), CALL_A, reply_a.task_id)
    b = _check_stream(pane.blocks(CALL_B), CALL_B, reply_b.task_id)
    assert a["envelope"]["payload"]["text"] == "Order 42 shipped on Monday; it arrives Friday."
    assert b["envelope"]["payload"]["text"] == "Plain answer without envelopes."
    kinds_a = [x["envelope"]["kind"] for x in pane.blocks(CALL_A) if x["state"] == "running"]
    texts_b = [
        x["envelope"]["payload"]["text"] for x in pane.blocks(CALL_B) if x["state"] == "running"
    ]
    assert kinds_a == ["thinking", "tool_call", "tool_call", "text"]
    assert texts_b == ["Reading your question", "Looking it up", "Writing the answer"]
    assert len(pane.blocks()) == len(pane.blocks(CALL_A)) + len(pane.blocks(CALL_B))


@pytest.mark.network
async def test_follow_up_under_one_call_is_a_second_stream_through_the_hub(
    colleague: Colleague, pane: Pane
) -> None:
    with _in_call(CALL_A):
        first = await stream_colleague(colleague.url, "script:input", publish=pane.hub.publish)
        second = await stream_colleague(
            colleague.url, "script:work", publish=pane.hub.publish, context_id=first.context_id
        )
    pane.hub.tool_call_ended(LiveCall(CALL_A, "ask_colleague", CONV), None)  # the tool returns
    await pane.wait_terminals(2)
    assert first.task_id != second.task_id
    for reply in (first, second):
        _check_stream(
            [b for b in pane.blocks() if b["taskId"] == reply.task_id], CALL_A, reply.task_id
        )


@pytest.mark.network
async def test_default_publisher_is_the_module_level_publish(
    colleague: Colleague, pane: Pane
) -> None:
    previous = set_default_hub(pane.hub)
    try:
        with _in_call(CALL_B):
            answer = await ask_colleague(colleague.url, "script:text")
    finally:
        set_default_hub(previous)
    await pane.wait_terminals()
    terminal = _check_stream(pane.blocks(), CALL_B, pane.blocks()[0]["taskId"])
    assert terminal["envelope"]["payload"]["text"] == answer


# -- input-required under one call (issue: terminal edges, item 6) -------------------------


def _ended(pane: Pane, call_id: str) -> None:
    """The tool call ends (what the instrumented runtime or the span processor tells)."""
    pane.hub.tool_call_ended(LiveCall(call_id, "ask_colleague", CONV), None)


@pytest.mark.network
async def test_a_question_followed_up_in_the_same_call_ends_with_one_done_of_the_answer(
    colleague: Colleague, pane: Pane
) -> None:
    with _in_call(CALL_A):
        asked = await stream_colleague(colleague.url, "script:input", publish=pane.hub.publish)
        assert asked.state == "input_required"
        answered = await stream_colleague(
            colleague.url,
            "order 42, please",
            publish=pane.hub.publish,
            context_id=asked.context_id,
            task_id=asked.task_id,
        )
        assert answered.state == "completed"
    _ended(pane, CALL_A)
    await pane.wait_terminals(1)
    await pane.emitter.flush(5)
    blocks = pane.blocks(CALL_A)
    terminal = _check_stream(blocks, CALL_A, asked.task_id)
    assert terminal["state"] == "done"
    assert terminal["envelope"]["payload"]["text"] == answered.text
    texts = [b["envelope"]["payload"].get("text") for b in blocks if b["state"] == "running"]
    assert "Which order do you mean?" in texts  # the question was shown while it waited
    assert pane.hub.stats().streams == 0


@pytest.mark.network
async def test_a_question_the_tool_returns_ends_its_stream_with_done_of_the_question(
    colleague: Colleague, pane: Pane
) -> None:
    with _in_call(CALL_A):
        answer = await ask_colleague(colleague.url, "script:input", publish=pane.hub.publish)
    assert answer == "Which order do you mean?"
    await pane.emitter.flush(5)
    assert [b for b in pane.blocks(CALL_A) if b["state"] != "running"] == []  # still open
    _ended(pane, CALL_A)  # the tool returned the question to the model
    await pane.wait_terminals(1)
    terminal = _check_stream(pane.blocks(CALL_A), CALL_A, pane.blocks(CALL_A)[0]["taskId"])
    assert (terminal["state"], terminal["envelope"]["payload"]) == (
        "done",
        {"text": "Which order do you mean?"},
    )


@pytest.mark.network
async def test_a_follow_up_in_a_later_call_is_that_calls_own_stream(
    colleague: Colleague, pane: Pane
) -> None:
    with _in_call(CALL_A):
        asked = await stream_colleague(colleague.url, "script:input", publish=pane.hub.publish)
    _ended(pane, CALL_A)
    with _in_call(CALL_B):
        answered = await stream_colleague(
            colleague.url,
            "order 42, please",
            publish=pane.hub.publish,
            context_id=asked.context_id,
            task_id=asked.task_id,
        )
    _ended(pane, CALL_B)
    await pane.wait_terminals(2)
    await pane.emitter.flush(5)
    first = _check_stream(pane.blocks(CALL_A), CALL_A, asked.task_id)
    assert first["envelope"]["payload"] == {"text": "Which order do you mean?"}
    second = _check_stream(pane.blocks(CALL_B), CALL_B, asked.task_id)
    assert second["envelope"]["payload"] == {"text": answered.text}


async def test_auth_required_that_the_tool_gives_up_on_ends_with_one_aborted(
    pane: Pane,
) -> None:
    adapter = A2AStreamAdapter(pane.hub.publish, conversation_id=CONV)
    with _in_call(CALL_A):
        adapter.feed(_task_event())
        adapter.feed(_status(TaskState.TASK_STATE_AUTH_REQUIRED, [new_text_part("log in first")]))
        adapter.close("the colleague's stream ended without a final state")
    pane.hub.tool_call_ended(LiveCall(CALL_A, "ask_colleague", CONV), "ColleagueError: log in")
    await pane.wait_terminals(1)
    await pane.emitter.flush(5)
    terminal = _check_stream(pane.blocks(CALL_A), CALL_A, TASK)
    assert terminal["state"] == "aborted"
    assert terminal["envelope"]["payload"] == {"message": "log in first"}
