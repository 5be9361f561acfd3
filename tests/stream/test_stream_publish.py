"""The stream rules (T4) as blocks are published: attribution (the call in context, a near
match, or none), the pseudo envelope and its seq, the throttle (ten a second, one admission
rule for a publish and a nested call's line), envelopes passed through or dropped, text cut
with a marker, the queue and stream bounds, many threads, the default hub."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.stream_helpers import CALL, CALL2, CONV, in_call, n_blocks
from support.timing import FakeClock

from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.protocol import FALLBACK_INVALID, Envelope, decode
from kernel_ext.stream import (
    ATTR_BLOCKS_ADMITTED,
    ATTR_BLOCKS_DROPPED,
    ATTR_CALL_ID_PATH,
    StreamHub,
    get_default_hub,
    publish,
    set_default_hub,
)
from kernel_ext.stream import hub as hub_module
from kernel_ext.testing import MemoryEmitter

pytestmark = pytest.mark.usefixtures("_no_default_hub_leak")


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


async def test_a_lone_surrogate_in_payload_text_passes_and_in_a_task_id_never_loses_the_terminal(
    hub: StreamHub, mem: MemoryEmitter
) -> None:
    # A payload string may hold one (docs/protocol.md); a task id or a stream key may not:
    # a running block is dropped, a terminal goes out as the fallback, the surrogate replaced.
    def envelope(key: str, state: str) -> dict[str, Any]:
        head = {"v": 1, "kind": "text", "streamKey": key, "seq": 1, "status": state}
        return {**head, "payload": {"text": "x"}}

    with in_call():
        hub.publish("before \ud800 after", task_id="task-1")
        hub.publish("the answer \udfff", task_id="task-1", state="done")
        hub.publish("lost", task_id="t\ud800")
        hub.publish("the answer", task_id="t\ud800", state="done")
        hub.publish(envelope("s\ud800", "running"), task_id="task-2")
        hub.publish(envelope("s\ud800", "done"), task_id="task-2", state="done")
    records = await mem.wait_for(n_blocks(4))
    blocks = [b for _, b in records]
    assert [(b["taskId"], b["state"], b["envelope"]["payload"]) for b in blocks] == [
        ("task-1", "running", {"text": "before \ud800 after"}),
        ("task-1", "done", {"text": "the answer \udfff"}),
        ("t\ufffd", "done", {"text": FALLBACK_INVALID}),
        ("task-2", "done", {"text": FALLBACK_INVALID}),
    ]
    for block in blocks:
        decode(block)
    stats = hub.stats()
    assert (stats["invalid"], stats["degraded"], stats["error"]) == (2, 2, 0)


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
    consumer = hub.attach_sender()  # attached, not taking: the queue fills up
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
    hub.attach_sender()
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
        consumer = hub.attach_sender(loop)
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
