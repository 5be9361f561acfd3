"""A2A → blocks: the adapter's rules, on hand-built A2A events through a recording test double
of ``publish``.
"""

from __future__ import annotations

import logging

import pytest
from a2a.helpers import new_data_part, new_text_part
from a2a.types import (
    Artifact,
    Message,
    Role,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
)
from support.a2a_helpers import (
    COMPLETED,
    CTX,
    TASK,
    WORKING,
    Published,
    RecordingPublisher,
    _adapter,
    _envelope,
    _status,
    _task_event,
)

from kernel_ext.a2a import (
    integral_floats_to_ints,
)
from kernel_ext.testing.a2a_peer import SCRIPT_KEY, script_of

pytestmark = pytest.mark.timeout(30)


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
