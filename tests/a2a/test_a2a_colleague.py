"""Every colleague variant end to end: kernel_ext.testing.a2a_peer's real a2a-sdk server, served by
uvicorn on 127.0.0.1 inside the test's loop, asked by a real a2a-sdk client; blocks observed
through a recording test double of ``publish``.
"""

from __future__ import annotations

import pytest
from support.a2a_helpers import (
    Colleague,
    RecordingPublisher,
    _ask,
    _one_terminal,
)

from kernel_ext.a2a import (
    ask_colleague,
)
from kernel_ext.errors import ColleagueError, ConfigError
from kernel_ext.protocol import Envelope

pytestmark = pytest.mark.timeout(30)


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


@pytest.mark.network
async def test_a_question_with_a_lone_surrogate_reaches_the_colleague_replaced(
    colleague: Colleague,
) -> None:
    # A2A's protobuf refuses a lone surrogate: the question goes with U+FFFD instead.
    publisher = RecordingPublisher()
    answer = await ask_colleague(colleague.url, "where is \ud800 order 42?", publish=publisher)
    assert answer == "Order 42 shipped on Monday; it arrives Friday."
    thinking = publisher.running()[0].envelope.payload["text"]
    assert thinking == "The question is: 'where is \ufffd order 42?'. Check orders first."


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
