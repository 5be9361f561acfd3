"""The hub's sender side: the batches a sender takes are the general build of each queued
block, in order (small running text built inline), each block's ``ts`` the instant it was
published; and the sender's port, on which it reports what was delivered or dropped."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.stream_helpers import CALL, CALL2, CONV, in_call
from support.timing import FakeClock

from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.observability.count_names import REJECTED, UNFLUSHED
from kernel_ext.protocol import decode, text_block_fast_limit
from kernel_ext.stream import ATTR_BLOCKS_DROPPED, OutgoingBlock, StreamHub
from kernel_ext.stream.outgoing import ToolCallItem, build, take
from kernel_ext.testing import MemoryEmitter

pytestmark = pytest.mark.usefixtures("_no_default_hub_leak")


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
    hub.attach_sender(loop)
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


def test_a_running_block_with_a_non_string_task_id_is_dropped_not_raised(
    hub: StreamHub, loop: asyncio.AbstractEventLoop
) -> None:
    hub.attach_sender(loop)
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
    hub.attach_sender(loop)
    with in_call():
        hub.publish("x" * 760, task_id="t")  # 760 + 2 + 256 = 1018 chars: inline
        hub.publish("x" * 800, task_id="u")  # 1058 chars * 4 > 4096: bounded
    first, second = hub._take(10)
    assert first.block["envelope"]["payload"]["text"] == "x" * 760  # type: ignore[union-attr]
    assert second.block["envelope"]["payload"]["text"] == "x" * 800  # type: ignore[union-attr]
    assert second.size > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["text", "tool_call", "terminal"])
def test_a_blocks_ts_is_when_it_was_published_not_when_the_sender_took_it(
    hub: StreamHub, clock: FakeClock, tap: Tap, loop: asyncio.AbstractEventLoop, kind: str
) -> None:
    hub.attach_sender(loop)
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
    consumer = hub.attach_sender()
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
    consumer = hub.attach_sender()
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
        sender.port  # noqa: B018
    sender.attach()
    assert sender.port.hub is hub
    assert not sender.port.closed
    await sender.stop(timeout=1)
    assert sender.port.closed  # the last one, so what was taken can still be reported
