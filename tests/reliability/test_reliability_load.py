"""Floods and a soak through the whole path: worker (span processor, tap, hub, loopback
emitter) → relay subprocess → a real python-socketio browser, over 127.0.0.1.

* One stream flooded at 10,000 running blocks/s for ``KERNEL_EXT_FLOOD_SECONDS``: at most
  10 running blocks per second of the worker's clock reach the browser, the terminal
  arrives once, and every structure is empty again afterwards.
* ``KERNEL_EXT_FLOOD_STREAMS`` concurrent tool calls, each flooded at 100 blocks/s: the same,
  per stream.
* ``KERNEL_EXT_SOAK_CALLS`` tool calls end to end: every terminal arrives exactly once,
  no running block is lost, and the worker's and the relay's structures are back to their
  start sizes; traced memory of the worker process grows by less than a bound.

Counts are checked against elapsed seconds on the worker's clock; nothing asserts timings.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import math
import os
import tracemalloc
from typing import Any

import pytest
from support.relay_helpers import CONV, barrier
from support.reliability_helpers import (
    DEFAULT_PINGS,
    FLOOD_SECONDS,
    FLOOD_STREAMS,
    SOAK_CALLS,
    Clock,
    Tally,
    Worker,
    report,
    running_relay,
    settled,
)

pytestmark = [pytest.mark.network, pytest.mark.timeout(120 + SOAK_CALLS // 200)]

TICK = 0.010  # the flood's pacing step, seconds
LIMIT = 10  # running blocks per stream per second (T4)


def ceiling(elapsed: float) -> int:
    """Most running blocks one stream may pass in ``elapsed`` seconds under a strict
    sliding window of 10 per second: 10 in [0, 1), 10 more in [1, 2), …

    Not checked on the blocks' ``ts``: that is the wall clock read when the block is
    queued, a moment after the throttle read its clock, and a pause in between (a garbage
    collection) can put 11 ``ts`` within one second. tests/stream/test_stream_publish.py
    checks the window itself with a fake clock."""
    return LIMIT * (math.floor(elapsed) + 1)


def envelope(task_id: str, seq: int) -> dict[str, Any]:
    return {
        "v": 1,
        "kind": "text",
        "streamKey": task_id,
        "seq": seq,
        "status": "running",
        "payload": {"text": f"update {seq}"},
    }


async def flood(streams: list[tuple[contextvars.Context, str]], per_tick: int, seconds: float):
    """Publish ``per_tick`` envelopes into every stream each tick for ``seconds``, paced
    against the schedule; returns (blocks published per stream, elapsed seconds)."""
    loop = asyncio.get_running_loop()
    clock = Clock()
    ticks = round(seconds / TICK)
    deadline = loop.time()
    seq = 0
    for _ in range(ticks):
        for _ in range(per_tick):
            seq += 1
            for context, task_id in streams:
                context.run(publish_running, task_id, seq)
        deadline += TICK
        await asyncio.sleep(max(0.0, deadline - loop.time()))
    return seq, clock.elapsed()


_hub: Any = None


def publish_running(task_id: str, seq: int) -> None:
    _hub.publish(envelope(task_id, seq), task_id=task_id)


async def test_one_stream_flooded_at_10000_blocks_per_second() -> None:
    global _hub
    async with running_relay(pings=DEFAULT_PINGS) as relay:
        tally = Tally(keep_running=True)
        try:
            await tally.connect(relay.port)
            assert await tally.join(CONV) == {"ok": True}
            async with Worker(relay.port, ack_timeout=30.0) as worker:
                _hub = worker.hub
                with worker.call(CONV) as call:
                    key = (call.call_id, "task-flood")
                    tally.expect([key])
                    published, elapsed = await flood(
                        [(contextvars.copy_context(), "task-flood")], 100, FLOOD_SECONDS
                    )
                    worker.hub.publish("the answer", task_id="task-flood", state="done")
                await tally.wait_batch()
                await settled(worker)
                await barrier(tally, relay.port)
                stats = worker.hub.stats()
                relay_sizes = await relay.stats()
        finally:
            await tally.close()
    delivered = len(tally.by_stream[key])
    assert 1 <= delivered <= ceiling(elapsed)
    assert (tally.terminal_count, tally.duplicates, tally.stray, tally.late) == (1, 0, 0, 0)
    assert stats["throttled"] == published - delivered
    assert relay_sizes["queued_frames"] == 0
    report(
        "flood: one stream at 10,000 running blocks/s",
        published=published,
        elapsed_s=round(elapsed, 2),
        delivered_running=delivered,
        ceiling=ceiling(elapsed),
        terminals=tally.terminal_count,
        duplicates=tally.duplicates,
        throttled=stats["throttled"],
    )


async def test_many_concurrent_streams_flooded_each_keep_the_rate_and_their_terminal() -> None:
    global _hub
    rooms = [f"{CONV}-flood-{i}" for i in range(10)]
    async with running_relay(pings=DEFAULT_PINGS) as relay:
        tally = Tally(keep_running=True)
        try:
            await tally.connect(relay.port)
            for room in rooms:
                assert await tally.join(room) == {"ok": True}
            async with Worker(relay.port, ack_timeout=60.0) as worker:
                _hub = worker.hub
                streams: list[tuple[contextvars.Context, str]] = []
                keys: list[tuple[str, str]] = []
                opened = asyncio.Event()
                end = asyncio.Event()

                async def tool_call(i: int) -> None:
                    # Each call in its own task: its own context, its own span.
                    with worker.call(rooms[i % len(rooms)]) as call:
                        task_id = f"task-{i}"
                        streams.append((contextvars.copy_context(), task_id))
                        keys.append((call.call_id, task_id))
                        if len(streams) == FLOOD_STREAMS:
                            opened.set()
                        await end.wait()
                        worker.hub.publish("done", task_id=task_id, state="done")

                tasks = [asyncio.create_task(tool_call(i)) for i in range(FLOOD_STREAMS)]
                try:
                    await asyncio.wait_for(opened.wait(), 30)
                    tally.expect(keys)
                    published, elapsed = await flood(streams, 1, FLOOD_SECONDS)
                finally:
                    end.set()
                    await asyncio.gather(*tasks)
                await tally.wait_batch(timeout=60 + FLOOD_STREAMS / 10)
                await settled(worker, timeout=60)
                await barrier(tally, relay.port)
                stats = worker.hub.stats()
                relay_sizes = await relay.stats()
                emitter_counts = dict(worker.loopback.counts)
        finally:
            await tally.close()
    counts = [len(tally.by_stream.get(key, [])) for key in keys]
    assert min(counts) >= 1
    assert max(counts) <= ceiling(elapsed)
    assert tally.terminal_count == FLOOD_STREAMS
    assert (tally.duplicates, tally.stray, tally.late) == (0, 0, 0)
    assert stats["throttled"] == published * FLOOD_STREAMS - sum(counts)
    assert relay_sizes["queued_frames"] == 0
    report(
        f"flood: {FLOOD_STREAMS} concurrent streams at 100 running blocks/s each",
        streams=FLOOD_STREAMS,
        published=published * FLOOD_STREAMS,
        elapsed_s=round(elapsed, 2),
        delivered_running=sum(counts),
        max_per_stream=max(counts),
        ceiling_per_stream=ceiling(elapsed),
        terminals=tally.terminal_count,
        duplicates=tally.duplicates,
        throttled=stats["throttled"],
        emitter=emitter_counts,
    )


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_soak_every_tool_call_ends_once_and_nothing_grows() -> None:
    rooms = [f"{CONV}-soak-{i}" for i in range(10)]
    batch = 500
    warmup = min(2_000, SOAK_CALLS)
    async with running_relay(pings=DEFAULT_PINGS) as relay:
        tally = Tally()
        try:
            await tally.connect(relay.port)
            for room in rooms:
                assert await tally.join(room) == {"ok": True}
            async with Worker(relay.port, ack_timeout=30.0) as worker:
                made = 0

                async def calls(n: int) -> None:
                    nonlocal made
                    while n > 0:
                        size = min(batch, n)
                        keys = []
                        for _ in range(size):
                            with worker.call(rooms[made % len(rooms)]) as call:
                                worker.hub.publish(f"call {made}: working")
                                worker.hub.publish(f"call {made}: answer", state="done")
                            keys.append((call.call_id, call.call_id))
                            made += 1
                        tally.expect(keys)
                        await tally.wait_batch()
                        tally.settle()
                        n -= size

                tracemalloc.start(1)
                await calls(warmup)
                await settled(worker)
                gc.collect()
                traced_before = tracemalloc.get_traced_memory()[0]
                sizes_before = worker.sizes()
                relay_before = await relay.stats()
                rss_before = rss_of(relay_before["pid"])
                clock = Clock()
                await calls(SOAK_CALLS)
                elapsed = clock.elapsed()
                await settled(worker)
                await barrier(tally, relay.port)
                gc.collect()
                traced_after = tracemalloc.get_traced_memory()[0]
                tracemalloc.stop()
                sizes_after = worker.sizes()
                relay_after = await relay.stats()
                rss_after = rss_of(relay_after["pid"])
                losses = worker.losses()
                closed = worker.hub.stats().closed
        finally:
            await tally.close()
    total = warmup + SOAK_CALLS
    assert tally.terminal_count == total
    assert tally.running == total  # no running block lost either
    assert (tally.duplicates, tally.stray, tally.late) == (0, 0, 0)
    assert losses == {}
    assert sizes_after == sizes_before
    assert closed == 0  # what closed streams left is released with their (ended) calls
    for what in ("held_terminals", "queued_frames", "rooms"):
        assert relay_after[what] == relay_before[what], what
    assert relay_after["remembered_terminals"] <= 4_096  # the relay's bound
    grown = traced_after - traced_before
    assert grown < 1_000_000, f"worker process traced memory grew by {grown:,} B"
    report(
        "soak: tool calls through the whole path",
        calls=total,
        measured_calls=SOAK_CALLS,
        elapsed_s=round(elapsed, 1),
        terminals=tally.terminal_count,
        running=tally.running,
        duplicates=tally.duplicates,
        worker_drops=losses,
        worker_sizes_after=sizes_after,
        worker_traced_growth_bytes=grown,
        relay_rss_growth_bytes=rss_after - rss_before,
        relay_sizes_after={k: relay_after[k] for k in ("held_terminals", "queued_frames")},
        relay_remembered_terminals=relay_after["remembered_terminals"],
    )
