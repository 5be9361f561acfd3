"""The stream rules (T4) for how streams end: a terminal is never throttled and sent exactly
once; the streams a call leaves open end with it, by how it ended (the stream of its nested
calls: done with the result text, or aborted); provisional terminals; closed streams
remembered per call, never written to again; a stream idle too long is ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.stream_helpers import CALL, CALL2, CONV, in_call, n_blocks
from support.timing import FakeClock

from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.protocol import block_size, decode
from kernel_ext.stream import ATTR_BLOCKS_ADMITTED, StreamHub
from kernel_ext.testing import MemoryEmitter

pytestmark = pytest.mark.usefixtures("_no_default_hub_leak")


async def test_terminal_is_never_throttled_and_sent_exactly_once(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    with in_call():
        for i in range(30):
            hub.publish(f"r{i}", task_id="t1")
        hub.publish("the answer", task_id="t1", state="done")
        hub.publish("again", task_id="t1", state="done")
        hub.publish("oops", task_id="t1", state="aborted")
        hub.publish("late", task_id="t1")
    await mem.wait_for(n_blocks(11))
    await mem.flush(1)
    terminals = mem.terminals()
    assert len(terminals) == 1
    final = terminals[0]
    assert final["state"] == "done"
    assert final["envelope"]["payload"] == {"text": "the answer"}
    assert final["envelope"]["seq"] == 11  # after the ten running blocks that were sent
    assert mem.blocks()[-1] is final
    stats = hub.stats()
    assert stats["duplicate_terminal"] == 2
    assert stats["closed"] == 1
    assert stats.streams == 0


async def test_nested_tool_call_block_and_abort_of_open_streams_on_end(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    parent = LiveCall(CALL, "ask_colleague", CONV)
    hub.tool_call_started(parent, LiveCall(CALL2, "web_search", CONV, parent_call_id=CALL))
    with in_call():
        hub.publish("working", task_id="task-a")
        hub.publish("working", task_id="task-b")
        hub.publish("done here", task_id="task-b", state="done")
    assert hub.call_attributes(CALL)[ATTR_BLOCKS_ADMITTED] == 4
    hub.tool_call_ended(parent, "boom")
    hub.tool_call_ended(parent, "boom again")  # a second end changes nothing
    records = await mem.wait_for(n_blocks(6))
    await mem.flush(1)
    assert len(records) == 6
    tool_call = records[0][1]
    assert tool_call["callId"] == CALL
    assert tool_call["taskId"] == CALL
    assert tool_call["envelope"]["kind"] == "tool_call"
    assert tool_call["envelope"]["payload"]["toolName"] == "web_search"
    assert tool_call["envelope"]["payload"]["callId"] == CALL2
    decode(tool_call)
    terminals = {(b["taskId"], b["state"]) for b in mem.terminals()}
    assert terminals == {("task-b", "done"), ("task-a", "aborted"), (CALL, "aborted")}
    aborted = next(b for b in mem.terminals() if b["taskId"] == "task-a")
    assert aborted["envelope"]["payload"]["message"] == "boom"
    assert hub.call_attributes(CALL) == {}
    assert hub.stats().streams == 0
    assert hub.stats().calls == 0


# -- the call's end: a stream the hub opened for nested calls ends by the call's outcome --


def nested_call(hub: StreamHub, parent: LiveCall, n: int = 1) -> None:
    """``n`` tool calls start inside ``parent`` (their tool_call lines on its local stream)."""
    for i in range(n):
        child = LiveCall(f"{i + 1:016x}", f"search_{i}", CONV, parent_call_id=parent.call_id)
        hub.tool_call_started(parent, child)


def local_stream(mem: MemoryEmitter, call_id: str = CALL) -> list[dict[str, Any]]:
    return [b for b in mem.blocks() if (b["callId"], b["taskId"]) == (call_id, call_id)]


def one_terminal_per_stream(mem: MemoryEmitter) -> None:
    streams = [(b["callId"], b["taskId"]) for b in mem.terminals()]
    assert len(streams) == len(set(streams))


async def test_the_stream_of_nested_calls_ends_done_with_the_result_text_when_the_call_returns(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    parent = LiveCall(CALL, "research", CONV)
    nested_call(hub, parent, 2)
    hub.tool_call_returned(parent, "Lyon has 3 train stations.")
    hub.tool_call_ended(parent, None)  # the span's end comes after: nothing more
    hub.tool_call_ended(parent, "late error")
    await mem.wait_for(n_blocks(3))
    await mem.flush(1)
    blocks = local_stream(mem)
    assert [(b["state"], b["envelope"]["seq"]) for b in blocks] == [
        ("running", 1),
        ("running", 2),
        ("done", 3),
    ]
    assert [b["envelope"]["payload"].get("toolName") for b in blocks[:2]] == [
        "search_0",
        "search_1",
    ]
    assert blocks[-1]["envelope"]["payload"] == {"text": "Lyon has 3 train stations."}
    for block in blocks:
        decode(block)
    stats = hub.stats()
    assert (stats["duplicate_terminal"], stats["error"], stats.calls, stats.streams) == (0,) * 4


@pytest.mark.parametrize(
    ("end", "outcome"),
    [
        (
            lambda hub, call: hub.tool_call_ended(call, None),
            ("done", "text", "the tool call finished"),
        ),
        (
            lambda hub, call: hub.tool_call_returned(call, None),
            ("done", "text", "the tool call finished"),
        ),
        (
            lambda hub, call: hub.tool_call_ended(call, "Boom: no trains"),
            ("aborted", "message", "Boom: no trains"),
        ),
        (
            lambda hub, call: hub.tool_call_ended(call, ""),
            ("aborted", "message", "the tool call ended before its stream did"),
        ),
    ],
    ids=["ended-returned", "returned-without-result", "failed", "failed-without-message"],
)
async def test_the_stream_of_nested_calls_follows_how_the_call_ended(
    hub: StreamHub, mem: MemoryEmitter, end: Any, outcome: tuple[str, str, str]
) -> None:
    parent = LiveCall(CALL, "research", CONV)
    nested_call(hub, parent)
    end(hub, parent)
    await mem.wait_for(n_blocks(2))
    await mem.flush(1)
    [terminal] = mem.terminals()
    state, key, text = outcome
    assert (terminal["taskId"], terminal["state"]) == (CALL, state)
    assert terminal["envelope"]["payload"] == {key: text}
    assert hub.stats().calls == 0


@pytest.mark.parametrize("tool_first", [False, True], ids=["lines-first", "text-first"])
async def test_a_local_stream_the_tool_published_on_keeps_the_old_rule_and_one_seq_counter(
    hub: StreamHub, mem: MemoryEmitter, tool_first: bool
) -> None:
    # The tool's own text and the nested calls' lines share the local stream: one counter
    # numbers both; the stream is the tool's, so a return that leaves it open aborts it.
    parent = LiveCall(CALL, "research", CONV)
    with in_call(CALL):
        if tool_first:
            hub.publish("looking it up")
        nested_call(hub, parent)
        hub.publish("found it")
        nested_call(hub, parent)
        if not tool_first:
            hub.publish("checking it")
    hub.tool_call_returned(parent, "the answer")
    await mem.wait_for(n_blocks(5))
    await mem.flush(1)
    blocks = local_stream(mem)
    assert [b["envelope"]["seq"] for b in blocks] == [1, 2, 3, 4, 5]
    assert [b["state"] for b in blocks] == ["running"] * 4 + ["aborted"]
    assert blocks[-1]["envelope"]["payload"] == {
        "message": "the tool call ended before its stream did"
    }


async def test_a_provisional_terminal_and_streams_the_tool_opened_keep_the_old_rules(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    parent = LiveCall(CALL, "research", CONV)
    nested_call(hub, parent)
    with in_call(CALL):
        hub.publish("which city?", state="done", provisional=True)  # on the local stream
        hub.publish("asking", task_id="task-a")
    hub.tool_call_returned(parent, "the answer")
    await mem.wait_for(n_blocks(4))
    await mem.flush(1)
    ends = {b["taskId"]: (b["state"], b["envelope"]["payload"]) for b in mem.terminals()}
    assert ends == {
        CALL: ("done", {"text": "which city?"}),
        "task-a": ("aborted", {"message": "the tool call ended before its stream did"}),
    }
    one_terminal_per_stream(mem)


async def test_a_huge_result_text_is_cut_with_the_marker_not_dropped(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    parent = LiveCall(CALL, "research", CONV)
    nested_call(hub, parent)
    hub.tool_call_returned(parent, "é" * 200_000)
    await mem.wait_for(n_blocks(2))
    [terminal] = mem.terminals()
    text = terminal["envelope"]["payload"]["text"]
    assert terminal["state"] == "done"
    assert text.startswith("é")
    assert "…[truncated " in text
    assert block_size(terminal) <= hub.max_block_bytes
    assert hub.stats()["degraded"] == 0


class _Message:
    """A chat message: LangChain's ToolMessage has a ``content`` like this."""

    def __init__(self, content: object) -> None:
        self.content = content


class _Hostile:
    def __str__(self) -> str:
        raise RuntimeError("no str")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    @property
    def content(self) -> str:
        raise RuntimeError("no content")


class _HostileStr(str):
    def __str__(self) -> str:
        raise RuntimeError("no str")


NEUTRAL = "the tool call finished"


@pytest.mark.parametrize(
    ("result", "text"),
    [
        ("plain text", "plain text"),
        (_HostileStr("a str subclass"), "a str subclass"),
        (_Message("the message's text"), "the message's text"),
        (_Message(["a", "list"]), NEUTRAL),
        (_Message(""), NEUTRAL),
        ("", NEUTRAL),
        (None, NEUTRAL),
        ({"answer": 42}, NEUTRAL),
        (b"bytes", NEUTRAL),
        (42, NEUTRAL),
        (_Hostile(), NEUTRAL),
    ],
    ids=[
        "str",
        "str-subclass",
        "message",
        "message-with-list",
        "empty-message",
        "empty-str",
        "none",
        "dict",
        "bytes",
        "int",
        "hostile",
    ],
)
async def test_any_result_gives_a_defined_done_text_and_never_raises(
    hub: StreamHub, mem: MemoryEmitter, result: object, text: str
) -> None:
    parent = LiveCall(CALL, "research", CONV)
    nested_call(hub, parent)
    hub.tool_call_returned(parent, result)
    await mem.wait_for(n_blocks(2))
    [terminal] = mem.terminals()
    assert terminal["envelope"]["payload"] == {"text": text}
    assert type(terminal["envelope"]["payload"]["text"]) is str
    assert hub.stats()["error"] == 0


class _StaleOnce(dict):  # type: ignore[type-arg]
    """The hub's streams, whose next lookup returns ``stale`` (as a lookup without the lock
    can, when the stream is closed by another thread right after it)."""

    stale: Any = None

    def get(self, key: Any, default: Any = None) -> Any:
        stale, self.stale = self.stale, None
        return stale if stale is not None else super().get(key, default)


def test_a_stream_closed_after_a_lookup_without_the_lock_is_not_written_to(
    hub: StreamHub, clock: FakeClock, loop: asyncio.AbstractEventLoop
) -> None:
    hub.attach_sender(loop)
    streams = _StaleOnce()
    hub._streams = streams
    with in_call():
        hub.publish("first")
        stale = streams[(CALL, CALL)]
        hub.publish("the end", state="done")
        assert stale.closed
        clock.advance(1.0)
        streams.stale = stale
        hub.publish("late")  # the lookup without the lock sees the closed stream
    assert streams.stale is None
    assert stale.seq == 1  # the stale stream took nothing after its terminal
    assert [raw[5] for raw in hub._queue] == ["first", "the end"]
    assert hub.stats()["closed"] == 1


# -- closed streams live with their call; provisional terminals (terminal edges 5, 6) ------


async def test_closed_streams_are_remembered_per_call_up_to_its_bound(
    clock: FakeClock, tap: Tap
) -> None:
    hub = StreamHub(clock=clock, tap=tap, max_closed_per_call=3)
    async with MemoryEmitter(hub=hub) as mem:
        with in_call():
            for task in ("a", "b", "c"):  # exactly at the bound: every one remembered
                hub.publish("x", task_id=task)
                hub.publish("end", task_id=task, state="done")
            clock.advance(3600)
            for task in ("a", "b", "c"):
                hub.publish("late", task_id=task)
                hub.publish("again", task_id=task, state="done")
            assert hub.stats()["closed"] == 3
            assert hub.stats()["duplicate_terminal"] == 3
            hub.publish("end", task_id="d", state="done")  # one past it: "a" is forgotten
            assert hub.stats().closed == 3
            hub.publish("late", task_id="b")
            hub.publish("late", task_id="a")
        await mem.flush(5)
        assert [(b["taskId"], b["state"]) for b in mem.blocks()][-2:] == [
            ("d", "done"),
            ("a", "running"),
        ]
        assert hub.stats()["closed"] == 4


async def test_a_call_that_ended_gets_nothing_more_from_tasks_that_outlive_it(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    call = ToolCall(CALL, "ask_colleague", CONV)
    with use_tool_call(call):
        hub.publish("working", task_id="t")
    hub.tool_call_ended(LiveCall(CALL, "ask_colleague", CONV), None)
    assert call.ended
    with use_tool_call(call):  # a task the tool started, still running
        hub.publish("late", task_id="t")
        hub.publish("late answer", task_id="t", state="done")
        hub.publish("a new stream", task_id="u")
    await mem.flush(5)
    assert [(b["taskId"], b["state"]) for b in mem.blocks()] == [("t", "running"), ("t", "aborted")]
    stats = hub.stats()
    assert stats["closed"] == 3
    assert (stats.streams, stats.calls, stats.closed) == (0, 0, 0)


async def test_terminals_without_a_call_id_are_sent_once(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    hub.publish("an answer", task_id="orphan", state="done", conversation_id=CONV)
    hub.publish("again", task_id="orphan", state="done", conversation_id=CONV)
    await mem.flush(5)
    assert [b["callId"] for b in mem.terminals()] == [None]
    assert hub.stats()["duplicate_terminal"] == 1


async def test_a_provisional_terminal_ends_the_stream_only_if_the_call_ends_first(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    with in_call():
        hub.publish("what is the budget?", task_id="asked")
        hub.publish("what is the budget?", task_id="asked", state="done", provisional=True)
        hub.publish("which region?", task_id="followed-up")
        hub.publish("which region?", task_id="followed-up", state="done", provisional=True)
        hub.publish("thanks, working on it", task_id="followed-up")
        hub.publish("the real answer", task_id="followed-up", state="done")
    hub.tool_call_ended(LiveCall(CALL, "ask_colleague", CONV), "ValueError: late failure")
    await mem.flush(5)
    asked = [b for b in mem.blocks() if b["taskId"] == "asked"]
    assert [b["state"] for b in asked] == ["running", "done"]
    assert asked[-1]["envelope"]["payload"] == {"text": "what is the budget?"}
    assert asked[-1]["envelope"]["seq"] == 2
    followed = [b for b in mem.blocks() if b["taskId"] == "followed-up"]
    assert [b["state"] for b in followed] == ["running", "running", "done"]
    assert followed[-1]["envelope"]["payload"] == {"text": "the real answer"}
    stats = hub.stats()
    assert (stats.streams, stats.calls) == (0, 0)


async def test_a_stream_whose_call_never_ends_is_ended_once_it_is_idle_too_long(
    clock: FakeClock, tap: Tap
) -> None:
    hub = StreamHub(clock=clock, tap=tap, stream_idle_ttl=60)
    async with MemoryEmitter(hub=hub) as mem:
        with in_call():
            hub.publish("working", task_id="plain")
            hub.publish("which one?", task_id="asked")
            hub.publish("which one?", task_id="asked", state="done", provisional=True)
        clock.advance(60)  # exactly the idle bound: not yet
        with in_call(CALL2):
            hub.publish("wake the sweep")
        await mem.flush(5)
        assert mem.terminals() == []
        clock.advance(1.5)  # past it (the sweep runs about once a second)
        with in_call(CALL2):
            hub.publish("wake the sweep again")
        await mem.flush(5)
        by_task = {b["taskId"]: b for b in mem.terminals() if b["callId"] == CALL}
        assert by_task["plain"]["state"] == "aborted"
        assert "idle too long" in by_task["plain"]["envelope"]["payload"]["message"]
        assert by_task["asked"]["state"] == "done"
        assert by_task["asked"]["envelope"]["payload"] == {"text": "which one?"}
        assert len(mem.terminals()) == 2
        with in_call():  # still no second terminal
            hub.publish("late", task_id="plain")
            hub.publish("late", task_id="plain", state="done")
        await mem.flush(5)
        assert len(mem.terminals()) == 2
        assert hub.stats()["expired"] == 2
