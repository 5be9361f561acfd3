"""A2A end to end through the real StreamHub and a MemoryEmitter: each colleague variant's
blocks on the wire, ordered and attributed to their call, one terminal each; and a question
(input-required) under one call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from a2a.helpers import new_text_part
from a2a.types import (
    TaskState,
)
from support.a2a_helpers import (
    CALL_A,
    CALL_B,
    CONV,
    TASK,
    Colleague,
    Pane,
    _check_stream,
    _ended,
    _in_call,
    _status,
    _task_event,
)
from support.network import free_port

from kernel_ext.a2a import (
    A2AStreamAdapter,
    ColleagueReply,
    ask_colleague,
    stream_colleague,
)
from kernel_ext.attribution.tap import LiveCall
from kernel_ext.errors import ColleagueError
from kernel_ext.stream import set_default_hub
from kernel_ext.testing.a2a_peer import COUNT_KEY, DELAY_KEY, SCRIPT_KEY

pytestmark = pytest.mark.timeout(30)


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
