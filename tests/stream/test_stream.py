"""The stream rules (T4): attribution, pseudo seq, throttle, terminals exactly once, bounds."""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.timing import FakeClock

from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.ledger import REJECTED, UNFLUSHED
from kernel_ext.protocol import (
    FALLBACK_INVALID,
    Envelope,
    block_size,
    decode,
    text_block_fast_limit,
)
from kernel_ext.stream import (
    ATTR_BLOCKS_ADMITTED,
    ATTR_BLOCKS_DROPPED,
    ATTR_CALL_ID_PATH,
    OutgoingBlock,
    StreamHub,
    get_default_hub,
    publish,
    set_default_hub,
)
from kernel_ext.stream import hub as hub_module
from kernel_ext.stream.consumer import ToolCallItem, build, take
from kernel_ext.testing import MemoryEmitter

CALL = "00f067aa0ba902b7"
CALL2 = "00f067aa0ba902b8"
CONV = "conv-1"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def tap() -> Tap:
    return Tap()


@pytest.fixture
def hub(clock: FakeClock, tap: Tap) -> StreamHub:
    return StreamHub(clock=clock, tap=tap)


@pytest.fixture
async def mem(hub: StreamHub) -> AsyncIterator[MemoryEmitter]:
    emitter = MemoryEmitter(hub=hub)
    await emitter.start()
    try:
        yield emitter
    finally:
        await emitter.stop(timeout=1)


def in_call(call_id: str = CALL, conversation: str | None = CONV) -> Any:
    return use_tool_call(ToolCall(call_id, "ask_colleague", conversation))


def n_blocks(n: int) -> Any:
    return lambda records: len(records) >= n


async def test_running_text_becomes_pseudo_envelope_with_increasing_seq(
    hub: StreamHub, mem: MemoryEmitter, clock: FakeClock
) -> None:
    with in_call():
        for i in range(3):
            hub.publish(f"step {i}")
            clock.advance(0.2)
    await mem.wait_for(n_blocks(3))
    room, first = mem.records[0]
    assert room == CONV
    assert first["callId"] == CALL
    assert first["taskId"] == CALL
    assert first["state"] == "running"
    assert first["envelope"] == {
        "v": 1,
        "kind": "text",
        "streamKey": CALL,
        "seq": 1,
        "status": "running",
        "payload": {"text": "step 0"},
    }
    assert [b["envelope"]["seq"] for b in mem.blocks()] == [1, 2, 3]
    for _, block in mem.records:
        decode(block)  # every block is valid on the wire


async def test_throttle_lets_ten_per_second_and_counts_drops_per_stream(
    hub: StreamHub, mem: MemoryEmitter, clock: FakeClock
) -> None:
    with in_call():
        for i in range(25):
            hub.publish(f"a{i}", task_id="t1")
        hub.publish("other stream", task_id="t2")
        clock.advance(1.0)
        hub.publish("after a second", task_id="t1")
        attributes = hub.call_attributes(CALL)
    await mem.wait_for(n_blocks(12))
    texts = [b["envelope"]["payload"]["text"] for b in mem.blocks() if b["taskId"] == "t1"]
    assert texts == [f"a{i}" for i in range(10)] + ["after a second"]
    assert hub.stats()["throttled"] == 15
    assert attributes[ATTR_BLOCKS_ADMITTED] == 12
    assert attributes[ATTR_BLOCKS_DROPPED] == 15
    assert attributes[ATTR_CALL_ID_PATH] == "context"


async def test_sliding_window_never_lets_more_than_ten_in_any_second(
    hub: StreamHub, mem: MemoryEmitter, clock: FakeClock
) -> None:
    accepted_at: list[float] = []
    with in_call():
        for i in range(200):
            before = hub.stats()["admitted"]
            hub.publish(f"b{i}")
            if hub.stats()["admitted"] > before:
                accepted_at.append(clock.now)
            clock.advance(0.037)
    for i, t in enumerate(accepted_at):
        in_window = [u for u in accepted_at[i:] if u - t < 1.0]
        assert len(in_window) <= 10


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


async def test_aborted_text_goes_to_payload_message(hub: StreamHub, mem: MemoryEmitter) -> None:
    with in_call():
        hub.publish("peer failed", state="aborted")
    records = await mem.wait_for(n_blocks(1))
    block = records[0][1]
    assert block["state"] == "aborted"
    assert block["envelope"]["payload"] == {"message": "peer failed"}
    decode(block)


async def test_unattributed_running_is_not_sent_but_terminal_goes_with_null_call_id(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    hub.publish("nobody's", task_id="task-9", conversation_id=CONV)
    hub.publish("final", task_id="task-9", state="done", conversation_id=CONV)
    records = await mem.wait_for(n_blocks(1))
    await mem.flush(1)
    assert len(records) == 1
    room, block = records[0]
    assert room == CONV
    assert block["callId"] is None
    assert block["taskId"] == "task-9"
    assert block["state"] == "done"
    assert hub.stats()["unattributed"] == 1


async def test_near_match_attributes_the_single_live_call_and_ambiguity_gives_none(
    hub: StreamHub, mem: MemoryEmitter, tap: Tap
) -> None:
    tap.add(LiveCall(CALL, "ask_colleague", CONV))
    hub.publish("via the tap", task_id="task-1", conversation_id=CONV)
    records = await mem.wait_for(n_blocks(1))
    assert records[0][1]["callId"] == CALL
    assert hub.call_attributes(CALL)[ATTR_CALL_ID_PATH] == "near_match"
    tap.add(LiveCall(CALL2, "ask_colleague", CONV))
    hub.publish("which one?", task_id="task-1", conversation_id=CONV)
    hub.publish("final", task_id="task-2", state="done", conversation_id=CONV)
    records = await mem.wait_for(n_blocks(2))
    assert records[1][1]["callId"] is None  # never a wrong callId
    assert hub.stats()["unattributed"] == 1


async def test_envelopes_pass_through_and_bad_mappings_are_dropped(
    hub: StreamHub, mem: MemoryEmitter, clock: FakeClock
) -> None:
    envelope = Envelope(
        kind="thinking", stream_key="s", seq=7, status="running", payload={"text": "hmm"}
    )
    raw = {"v": 1, "kind": "mystery", "streamKey": "s", "seq": 8.0, "status": "x", "extra": 1}
    with in_call():
        hub.publish(envelope, task_id="task-1")
        hub.publish(raw, task_id="task-1")
        hub.publish({"kind": "text", "seq": -1}, task_id="task-1")
        hub.publish(12345, task_id="task-1")  # type: ignore[arg-type]
        hub.publish(
            {"v": 1, "kind": "text", "streamKey": "s", "seq": 9, "status": "done"},
            task_id="task-1",
            state="done",
        )
    records = await mem.wait_for(n_blocks(3))
    blocks = [b for _, b in records]
    assert blocks[0]["envelope"]["kind"] == "thinking"
    assert blocks[0]["envelope"]["seq"] == 7
    assert blocks[1]["envelope"]["kind"] == "mystery"
    assert blocks[1]["envelope"]["seq"] == 8
    assert blocks[1]["envelope"]["extra"] == 1
    # A done envelope without payload.text is rebuilt, never lost.
    assert blocks[2]["state"] == "done"
    assert blocks[2]["envelope"]["payload"] == {"text": FALLBACK_INVALID}
    stats = hub.stats()
    assert stats["invalid"] == 2
    assert stats["degraded"] == 1
    assert hub.call_attributes(CALL)[ATTR_BLOCKS_DROPPED] == 2


async def test_huge_text_is_truncated_with_a_marker(hub: StreamHub, mem: MemoryEmitter) -> None:
    with in_call():
        hub.publish("x" * 200_000, state="done")
    records = await mem.wait_for(n_blocks(1))
    text = records[0][1]["envelope"]["payload"]["text"]
    assert "…[truncated" in text
    assert len(text) < 70_000


async def test_no_room_and_no_sender_are_counted(clock: FakeClock, tap: Tap) -> None:
    hub = StreamHub(clock=clock, tap=tap)
    with in_call(conversation=None):
        hub.publish("where to?")
    with in_call():
        hub.publish("nobody listens")
        hub.publish("final", state="done")
    stats = hub.stats()
    assert stats["no_room"] == 1
    assert stats["no_sender"] == 2
    assert stats.queue == 0
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


async def test_state_is_released_after_many_finished_calls(clock: FakeClock, tap: Tap) -> None:
    hub = StreamHub(clock=clock, tap=tap)
    mem = MemoryEmitter(hub=hub)
    async with mem:
        for i in range(2000):
            call_id = f"{i:016x}"
            with in_call(call_id):
                hub.publish("step")
                hub.publish("answer", state="done")
            hub.tool_call_ended(LiveCall(call_id, "ask_colleague", CONV), None)
            if i % 200 == 0:
                await mem.flush(5)
        await mem.flush(5)
        clock.advance(60)
        with in_call():
            hub.publish("wake the sweep")
        await mem.flush(5)
        stats = hub.stats()
        assert len(mem.terminals()) == 2000
        assert stats.streams == 1
        assert stats.calls == 1
        assert stats.closed == 0
        assert stats.queue == 0


async def test_queue_bound_drops_running_but_keeps_terminals(clock: FakeClock, tap: Tap) -> None:
    hub = StreamHub(clock=clock, tap=tap, max_queue=5)
    consumer = hub.consumer()  # attached, not taking: the queue fills up
    with in_call():
        for i in range(8):
            hub.publish("r", task_id=f"t{i}")
        hub.publish("final", task_id="t7", state="done")
    stats = hub.stats()
    assert stats["queue_full"] == 3
    assert stats.queue == 6
    items = consumer.take_nowait(100)
    assert [getattr(i, "terminal", None) for i in items][-1] is True
    consumer.close()
    assert hub.stats()["no_sender"] == 0


async def test_stream_bound(clock: FakeClock, tap: Tap) -> None:
    hub = StreamHub(clock=clock, tap=tap, max_streams=3)
    hub.consumer()
    with in_call():
        for i in range(5):
            hub.publish("r", task_id=f"t{i}")
        hub.publish("final", task_id="t4", state="done")  # a terminal is never refused
    stats = hub.stats()
    assert stats["stream_limit"] == 2
    assert stats.streams == 3
    assert stats.queue == 4


async def test_chat_event_goes_before_the_blocks_published_after_it(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    with in_call():
        hub.publish_chat_event({"eventId": CALL, "status": "running"})
        hub.publish("first block")
    await mem.wait_for(n_blocks(1))
    assert [(kind, room) for kind, room, _ in mem.order] == [
        ("chat_event", CONV),
        ("tool_event_stream", CONV),
    ]
    assert mem.chat_events == [(CONV, {"eventId": CALL, "status": "running"})]


async def test_publish_from_many_threads_keeps_every_rule(tap: Tap) -> None:
    hub = StreamHub(tap=tap, max_running_per_second=None)
    mem = MemoryEmitter(hub=hub)
    n_threads, per_thread = 8, 300

    def tool(call_id: str) -> None:
        with in_call(call_id):
            for i in range(per_thread):
                hub.publish(f"{i}")
            # Two racing terminals per call: exactly one may win.
            racer = threading.Thread(
                target=contextvars.copy_context().run,
                args=(hub.publish, "lost race"),
                kwargs={"state": "aborted"},
            )
            racer.start()
            hub.publish("answer", state="done")
            racer.join()

    async with mem:
        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(tool, f"{i:016x}"))
            for i in range(n_threads)
        ]
        for t in threads:
            t.start()
        await asyncio.wait_for(
            asyncio.gather(*(asyncio.to_thread(t.join) for t in threads)), timeout=30
        )
        await mem.wait_for(n_blocks(n_threads * (per_thread + 1)), timeout=20)
        await mem.flush(5)
    by_call: dict[str, list[dict[str, Any]]] = {}
    for _, block in mem.records:
        by_call.setdefault(block["callId"], []).append(block)
    assert len(by_call) == n_threads
    for blocks in by_call.values():
        seqs = [b["envelope"]["seq"] for b in blocks]
        assert seqs == sorted(seqs)
        assert len(set(seqs)) == len(seqs)
        assert sum(b["state"] != "running" for b in blocks) == 1
        assert blocks[-1]["state"] != "running"
    assert hub.stats()["duplicate_terminal"] == n_threads
    assert hub.stats()["error"] == 0


async def test_module_publish_uses_the_default_hub(tap: Tap) -> None:
    previous = set_default_hub(StreamHub(tap=tap))
    try:
        mem = MemoryEmitter()
        async with mem:
            with in_call():
                publish("via the module")
            records = await mem.wait_for(n_blocks(1))
        assert records[0][1]["envelope"]["payload"]["text"] == "via the module"
        assert mem.hub is get_default_hub()
    finally:
        set_default_hub(previous)


def test_publish_never_raises_even_when_attribution_breaks(
    monkeypatch: pytest.MonkeyPatch, hub: StreamHub
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("resolver bug")

    monkeypatch.setattr(hub_module, "attribute", broken)
    hub.publish("x")
    hub.publish("x", state="done")
    assert hub.stats()["error"] == 2


@pytest.fixture(autouse=True)
def _no_default_hub_leak() -> Iterator[None]:
    before = set_default_hub(None)
    set_default_hub(before)
    yield
    set_default_hub(before)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop that never runs: the consumer only needs one to be attached."""
    new = asyncio.new_event_loop()
    yield new
    new.close()


@pytest.mark.parametrize(
    "task_id",
    [None, "t", "t" * 512, "t" * 513, ""],
    ids=["call-id", "short", "longest", "too-long", "empty"],
)
def test_the_consumer_builds_running_text_as_the_general_path_does(
    hub: StreamHub, task_id: str | None, loop: asyncio.AbstractEventLoop
) -> None:
    # _take builds running text blocks inline; the result must be what consumer.build makes
    # (and valid on the wire), and anything it does not cover must still take that path.
    hub.consumer(loop)
    with in_call():
        hub.publish("hello", task_id=task_id)
    [raw] = list(hub._queue)
    before = time.time()
    taken = hub._take(10)
    after = time.time()
    # the same instant on the wall clock as _take saw it: the offset of either side of it
    expected = build(raw, hub.max_block_bytes, hub._fast_chars, lambda *a, **k: None, 0.0)
    if task_id is not None and not 0 < len(task_id) <= 512:
        # the general path validates it: an empty or over-long task id is invalid
        assert expected is None
        assert taken == []
        return
    [block] = taken
    assert expected is not None
    # ts: the publish instant on the wall clock as _take read it (the hub's clock is a fake
    # that stood still here, so: when _take ran)
    assert int(before * 1000) <= block.block["ts"] <= int(after * 1000) + 1
    expected.block["ts"] = block.block["ts"]
    assert block == expected
    decode(block.block)


class _TaskId(str):
    """A task id of a ``str`` subclass (the general path's to judge)."""


_SMALL_BOUND = 2048  # a block bound whose inline limit generated texts cross
# Streams as (call id, task id): the call's default one (task id None: the call id object),
# one task id on two calls, a call's id as the other call's task id, and task ids the
# inline build must leave to the general one.
_STREAMS = [
    (CALL, None),
    (CALL, "t"),
    (CALL2, "t"),
    (CALL2, CALL),
    (CALL2, None),
    (CALL, "t" * 512),
    (CALL, "t" * 513),
    (CALL, ""),
    (CALL2, _TaskId("t")),
]


# The traceId the hub queues with a call's items: the call's own (one with, one without).
_TRACES = {CALL: "4bf92f3577b34da6a3ce929d0e0e4736", CALL2: None}


@st.composite
def _queued(draw: st.DrawFn) -> tuple[Any, ...]:
    """One queue item as the hub queues it: running or terminal, text or not, on one of a
    few streams (a task id equal to an earlier one's but not the same object, too)."""
    call_id, task_id = draw(st.sampled_from(_STREAMS))
    if task_id is None:
        task_id = call_id  # the hub's default: the very call id object
    elif task_id.__class__ is str and len(task_id) > 1 and draw(st.booleans()):
        task_id = (task_id + ".")[:-1]  # equal, not identical
    state = draw(st.sampled_from(["running"] * 4 + ["done", "aborted"]))
    fast = text_block_fast_limit(_SMALL_BOUND)
    item = draw(
        st.sampled_from(["", "a", "step 2", "中文 😀"])
        | st.integers(fast - 520, fast + 2).map(lambda n: "x" * max(n, 0))
        | st.sampled_from([ToolCallItem("search", CALL2), 42])
    )
    at = draw(st.floats(0, 1e7, allow_nan=False))
    seq = draw(st.integers(0, 2**31))
    return (CONV, call_id, task_id, state, at, item, seq, _TRACES[call_id])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_queued(), max_size=40),
    st.integers(1, 50),
    st.floats(1.6e9, 1.9e9, allow_nan=False),
)
@example(  # one task id on two calls, one after the other (one with a traceId)
    [
        (CONV, CALL, "t", "running", 1e5, "a", 1, _TRACES[CALL]),
        (CONV, CALL2, "t", "running", 1e5, "a", 1, _TRACES[CALL2]),
    ],
    10,
    1.7e9,
)
def test_the_consumers_batches_are_the_general_build_of_each_item_in_order(
    items: list[tuple[Any, ...]], max_items: int, wall_offset: float
) -> None:
    # take() builds small running text inline, with what is fixed per stream made once per
    # batch; build() is the specification. Same blocks, same order, same drops.
    fast = text_block_fast_limit(_SMALL_BOUND)
    taken_drops: list[tuple[Any, ...]] = []
    built_drops: list[tuple[Any, ...]] = []
    queue: deque[Any] = deque(items)
    taken: list[Any] = []
    while queue:
        taken += take(
            queue,
            max_items,
            _SMALL_BOUND,
            fast,
            lambda *a, **k: taken_drops.append((a, k)),
            wall_offset,
        )
    expected = [
        build(raw, _SMALL_BOUND, fast, lambda *a, **k: built_drops.append((a, k)), wall_offset)  # type: ignore[arg-type]
        for raw in items
    ]
    assert taken == [out for out in expected if out is not None]
    assert taken_drops == built_drops
    # the same wire text too: equal dicts, keys in the same order
    assert [json.dumps(getattr(out, "block", None)) for out in taken] == [
        json.dumps(getattr(out, "block", None)) for out in expected if out is not None
    ]


# A block, a drain of the queue, or time passing (by exact binary fractions too: a block
# exactly one window after the oldest of the ring is let through).
_STEPS = st.lists(
    st.sampled_from(["block", "block", "block", "take", 0.125, 0.25, 0.5, 1.0])
    | st.floats(0.0, 0.5),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1.0, 4.0, 10.0, 25.5]), st.integers(1, 6), _STEPS)
@example(1.0, 6, ["block", 1.0, "block"])  # exactly one window after: let through
@example(4.0, 6, ["block", 1.0, "block", "take"])  # touched by the second: not idle at the end
def test_publish_admits_and_drops_exactly_as_the_hubs_one_admission_rule_does(
    rate: float, max_queue: int, steps: list[str | float]
) -> None:
    # publish() and tool_call_started admit by StreamHub._admit (T4's window, the queue
    # bound, the stream's idle time). The same schedule through both: the same blocks let
    # through, the same drops, the same streams ended idle.
    def run(through_publish: bool) -> tuple[dict[str, Any], list[float]]:
        clock = FakeClock()
        hub = StreamHub(
            max_running_per_second=rate,
            max_queue=max_queue,
            stream_idle_ttl=1.5,  # the schedule lets streams go idle, and end, too
            clock=clock,
            tap=Tap(),
        )
        consumer = hub.consumer(loop)
        parent = LiveCall(CALL, "ask_colleague", CONV)
        admitted_at = []
        taken = 0
        with in_call():
            for step in steps:
                if isinstance(step, float):
                    clock.advance(step)
                elif step == "take":
                    taken += len(consumer.take_nowait(max_queue))
                else:
                    before = hub.stats()["admitted"]
                    if through_publish:
                        hub.publish("step")
                    else:
                        hub.tool_call_started(parent, LiveCall(CALL2, "search", CONV))
                    if hub.stats()["admitted"] > before:
                        admitted_at.append(clock.now)
        counts = hub.stats().counts
        counts.update(hub.call_attributes(CALL))  # the call's own admitted and dropped
        counts.pop(ATTR_CALL_ID_PATH, None)
        clock.advance(1.0)
        counts["sent"] = taken + len(consumer.take_nowait(max_queue + 1))
        return counts, admitted_at

    loop = asyncio.new_event_loop()
    try:
        assert run(through_publish=True) == run(through_publish=False)
    finally:
        loop.close()


def test_a_running_block_with_a_non_string_task_id_is_dropped_not_raised(
    hub: StreamHub, loop: asyncio.AbstractEventLoop
) -> None:
    hub.consumer(loop)
    with in_call():
        hub.publish("odd", task_id=42)  # type: ignore[arg-type]
        hub.publish("fine", task_id="t1")
    taken = hub._take(10)
    assert [b.block["taskId"] for b in taken] == ["t1"]  # type: ignore[union-attr]
    assert hub.stats()["invalid"] == 1


def test_a_huge_running_text_leaves_the_inline_build_for_the_bounded_one(
    clock: FakeClock, tap: Tap, loop: asyncio.AbstractEventLoop
) -> None:
    hub = StreamHub(clock=clock, tap=tap, max_block_bytes=4096)
    hub.consumer(loop)
    with in_call():
        hub.publish("x" * 760, task_id="t")  # 760 + 2 + 256 = 1018 chars: inline
        hub.publish("x" * 800, task_id="u")  # 1058 chars * 4 > 4096: bounded
    first, second = hub._take(10)
    assert first.block["envelope"]["payload"]["text"] == "x" * 760  # type: ignore[union-attr]
    assert second.block["envelope"]["payload"]["text"] == "x" * 800  # type: ignore[union-attr]
    assert second.size > 0  # type: ignore[union-attr]


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
    hub.consumer(loop)
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


@pytest.mark.parametrize("kind", ["text", "tool_call", "terminal"])
def test_a_blocks_ts_is_when_it_was_published_not_when_the_sender_took_it(
    hub: StreamHub, clock: FakeClock, tap: Tap, loop: asyncio.AbstractEventLoop, kind: str
) -> None:
    hub.consumer(loop)
    before = time.time()
    with in_call():
        if kind == "text":
            hub.publish("hello")
        elif kind == "terminal":
            hub.publish("bye", state="done")
        else:
            parent = LiveCall(CALL, "ask_colleague", CONV)
            hub.tool_call_started(parent, LiveCall(CALL2, "search", CONV))
    after = time.time()
    # The sender takes it five seconds later by the hub's clock (a fake that moves at once,
    # while the wall clock does not): the block's ts is five seconds before the take.
    clock.advance(5.0)
    [taken] = hub._take(10)
    assert isinstance(taken, OutgoingBlock)
    assert int((before - 5.0) * 1000) <= taken.block["ts"] <= int((after - 5.0) * 1000) + 1


# -- the sender's port --------------------------------------------------------------------


async def test_a_sender_reports_outcomes_on_its_port_counted_on_the_hub_and_the_call(
    hub: StreamHub,
) -> None:
    consumer = hub.consumer()
    with in_call():
        hub.publish("a")
        hub.publish("b", task_id="t2")
    assert consumer.queue_size == hub.queue_size == 2
    taken = await consumer.get(10)
    assert [item.task_id for item in taken if isinstance(item, OutgoingBlock)] == [CALL, "t2"]
    consumer.delivered(1)
    consumer.dropped(REJECTED, 1, CALL)
    consumer.dropped(REJECTED, 2, "ffffffffffffffff")  # a call the hub does not hold
    stats = hub.stats()
    assert stats["delivered"] == 1
    assert stats["rejected"] == 3
    assert hub.call_attributes(CALL)[ATTR_BLOCKS_DROPPED] == 1


async def test_what_a_closed_port_reports_still_counts(hub: StreamHub) -> None:
    consumer = hub.consumer()
    with in_call():
        hub.publish("a")
    taken = consumer.take_nowait()
    assert len(taken) == 1
    consumer.close()
    assert consumer.closed
    consumer.dropped(UNFLUSHED)
    consumer.delivered(0)
    stats = hub.stats()
    assert stats["unflushed"] == 1
    assert stats.counts.get("delivered", 0) == 0
    assert consumer.take_nowait() == []


async def test_a_sender_has_its_port_from_attach_on(hub: StreamHub) -> None:
    sender = MemoryEmitter(hub=hub)
    with pytest.raises(RuntimeError, match="MemoryEmitter: not attached to a hub yet"):
        sender.consumer  # noqa: B018
    sender.attach()
    assert sender.consumer.hub is hub
    assert not sender.consumer.closed
    await sender.stop(timeout=1)
    assert sender.consumer.closed  # the last one, so what was taken can still be reported
