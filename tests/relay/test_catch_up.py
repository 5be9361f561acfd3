"""Catch-up over real sockets: a browser that joins a conversation mid-call — a second tab,
a reload, a reconnect with its cursor, onto the other web process behind Redis — receives
what it lacks of each held stream, in seq order, then the live blocks; nothing twice within
a join, nothing lost in between; nothing for a refused join or of another room.

Relays are uvicorn in this process (or ``python -m kernel_ext.relay`` processes on a real
redis-server), browsers real python-socketio clients, workers an internal connection
sending ``kx_blocks`` frames or a real LoopbackEmitter.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from support.network import RedisServer
from support.redis_helpers import wait_subscribed
from support.relay_helpers import (
    C1,
    C2,
    NS,
    Browser,
    RelayProcess,
    barrier,
    block,
    connected,
    emitter_for,
    frame,
    join,
    relay_server,
    seqs,
    worker,
)
from support.timing import wait_until

from kernel_ext import ToolCall, use_tool_call
from kernel_ext.attribution.tap import Tap
from kernel_ext.protocol import block_size
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

CALL = "00f067aa0ba902b7"
KEY = {"callId": CALL, "taskId": "task-1"}


async def test_a_second_tab_mid_call_receives_what_it_missed_then_the_live_blocks() -> None:
    async with relay_server() as (port, relay), worker(port) as w:
        first = await connected(port, "first")
        try:
            assert await join(first, C1) == {"ok": True}
            await w.call("kx_blocks", frame(C1, [block(s) for s in range(1, 7)]), namespace=NS)
            await first.wait_for(lambda b: len(b) >= 6)
            second = await connected(port, "second")
            ack = await join(second, C1, have=[])
            assert ack == {"ok": True, "replay": {"blocks": 6, "streams": 1, "missing": []}}
            assert seqs(second.blocks) == [1, 2, 3, 4, 5, 6]  # before the acknowledgement
            live = [block(7), block(8), block(9, state="done")]
            await w.call("kx_blocks", frame(C1, live), namespace=NS)
            for browser in (first, second):
                await browser.wait_for(lambda b: len(b) >= 9)
                await barrier(browser, port)
            assert second.blocks == first.blocks  # the whole pane, in order, once
            assert relay.stats()["replay_blocks"] == 6
            await second.close()
        finally:
            await first.close()


async def test_a_join_without_have_is_caught_up_and_acknowledged_as_before() -> None:
    """A front-end that never heard of catch-up still gets the whole pane (ordinary blocks)
    and the acknowledgement it always got."""
    async with relay_server() as (port, _), worker(port) as w:
        await w.call("kx_blocks", frame(C1, [block(1), block(2)]), namespace=NS)
        late = await connected(port)
        try:
            assert await join(late, C1) == {"ok": True}
            assert seqs(late.blocks) == [1, 2]
        finally:
            await late.close()


async def test_a_reconnect_that_says_what_it_has_gets_only_the_rest() -> None:
    async with relay_server() as (port, _), worker(port) as w:
        await w.call("kx_blocks", frame(C1, [block(s) for s in range(1, 7)]), namespace=NS)
        browser = await connected(port)
        try:
            ack = await join(browser, C1, have=[{**KEY, "seq": 4}])
            assert ack["replay"]["blocks"] == 2
            assert seqs(browser.blocks) == [5, 6]
            await w.call("kx_blocks", frame(C1, [block(7, state="done")]), namespace=NS)
            await browser.wait_for(lambda b: len(b) >= 3)
            # Joining again with everything it has: nothing is sent again.
            ack = await join(browser, C1, have=[{**KEY, "seq": 7, "ended": True}])
            assert ack["replay"] == {"blocks": 0, "streams": 0, "missing": []}
            await barrier(browser, port)
            assert seqs(browser.blocks) == [5, 6, 7]
        finally:
            await browser.close()


async def test_the_terminal_comes_once_per_join_until_the_hold_releases_the_stream() -> None:
    async with relay_server(replay_hold=0.5) as (port, relay), worker(port) as w:
        blocks = [block(1), block(2), block(3, state="done")]
        await w.call("kx_blocks", frame(C1, blocks), namespace=NS)
        browser = await connected(port)
        try:
            await join(browser, C1, have=[])
            await join(browser, C1, have=[])  # joined again: caught up anew, the same once
            await barrier(browser, port)
            assert seqs(browser.blocks) == [1, 2, 3, 1, 2, 3]
            await wait_until(lambda: relay.stats()["replay_streams"] == 0, 10)
            ack = await join(browser, C1, have=[])
            assert ack["replay"]["blocks"] == 0
            await barrier(browser, port)
            assert len(browser.blocks) == 6
        finally:
            await browser.close()


async def test_a_refused_join_receives_nothing_and_a_room_nothing_of_another() -> None:
    def only_c2(identity: Any, room: str) -> bool:
        return room == C2

    async with relay_server(authorize_join=only_c2) as (port, _), worker(port) as w:
        await w.call("kx_blocks", frame(C1, [block(1), block(2)]), namespace=NS)
        browser = await connected(port)
        try:
            assert await join(browser, C1, have=[]) == {"ok": False, "error": "forbidden"}
            ack = await join(browser, C2, have=[{**KEY, "seq": 0}])
            assert ack["replay"]["blocks"] == 0
            await barrier(browser, port)
            assert browser.blocks == []
        finally:
            await browser.close()


@pytest.mark.parametrize(
    "have",
    [
        "not a list",
        [{**KEY, "seq": -1}],
        [{**KEY, "seq": 2**60}],
        [{**KEY, "seq": 1.5}],
        [{**KEY, "seq": True}],
        [{**KEY, "seq": "3"}],
        [{"callId": 7, "taskId": "task-1", "seq": 3}],
        [None, 5, "x", [1, 2]],
        [{"callId": CALL, "taskId": f"t{i}", "seq": i} for i in range(10_000)],
    ],
    ids=["string", "negative", "huge", "float", "bool", "text", "bad-call", "junk", "10k"],
)
async def test_a_hostile_cursor_is_ignored_and_counted_and_the_join_still_catches_up(
    have: Any,
) -> None:
    async with relay_server() as (port, relay), worker(port) as w:
        await w.call("kx_blocks", frame(C1, [block(1), block(2)]), namespace=NS)
        browser = await connected(port)
        try:
            ack = await join(browser, C1, have=have)
            assert ack["ok"] is True
            assert seqs(browser.blocks) == [1, 2]  # no cursor for this stream: all of it
            stats = relay.stats()
            assert stats["rejected_bad_cursor"] == 1
            assert stats["ignored_cursors"] >= 1
        finally:
            await browser.close()


async def test_a_cursor_of_another_rooms_stream_changes_nothing() -> None:
    async with relay_server() as (port, _), worker(port) as w:
        await w.call("kx_blocks", frame(C2, [block(1), block(2)]), namespace=NS)
        await w.call("kx_blocks", frame(C1, [block(1, task_id="mine")]), namespace=NS)
        browser = await connected(port)
        try:
            ack = await join(browser, C1, have=[{**KEY, "seq": 1}])
            assert ack["replay"]["blocks"] == 1
            assert [b["taskId"] for b in browser.blocks] == ["mine"]
        finally:
            await browser.close()


async def test_a_stream_over_its_bound_tells_the_joiner_what_gave_way() -> None:
    # The smallest stream bound a relay with 2 KiB blocks takes: 4 KiB.
    bound = 4096
    size = block_size(block(10))
    async with (
        relay_server(max_block_bytes=2048, replay_stream_bytes=bound) as (port, relay),
        worker(port) as w,
    ):
        count = bound // size + 5
        await w.call(
            "kx_blocks", frame(C1, [block(s) for s in range(10, 10 + count)]), namespace=NS
        )
        browser = await connected(port)
        try:
            ack = await join(browser, C1, have=[])
            (missing,) = ack["replay"]["missing"]
            held = seqs(browser.blocks)
            assert held[0] == 10  # the first block never gives way
            assert missing == {**KEY, "blocks": count - len(held)}
            assert held[1:] == list(range(10 + count - len(held) + 1, 10 + count))
            assert relay.stats()["replay_gave_way"] == missing["blocks"]
            assert relay.stats()["replay_bytes"] <= bound
        finally:
            await browser.close()


async def test_blocks_flowing_while_browsers_join_reach_each_exactly_once() -> None:
    """A real sender floods one stream (no throttle) while browsers join one after the
    other, concurrently with it: each joiner holds every block from the first on, once
    each, in order, and the terminal once."""
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    total = 3_000
    async with relay_server() as (port, _):
        emitter = emitter_for(port, hub)
        await emitter.start()
        joiners = [await connected(port, f"joiner-{n}") for n in range(8)]
        published = 0

        async def flood() -> None:
            nonlocal published
            with use_tool_call(ToolCall(CALL, "ask_colleague", C1)):
                for n in range(1, total + 1):
                    hub.publish(f"block {n}", task_id="task-1")
                    published = n
                    if n % 10 == 0:
                        await asyncio.sleep(0)  # the sender and the relay work meanwhile
                hub.publish("the answer", task_id="task-1", state="done")

        try:
            flooding = asyncio.get_running_loop().create_task(flood())
            for n, browser in enumerate(joiners, start=1):
                await wait_until(lambda n=n: published >= n * total // 10, 30)
                await join(browser, C1, have=[])
            await flooding
            for browser in joiners:
                await browser.wait_for(lambda b: any(x["state"] == "done" for x in b), 30)
                await barrier(browser, port)
                got = seqs(browser.blocks)
                assert got == list(range(1, total + 2)), (browser.name, len(got), len(set(got)))
                assert Counter(x["state"] for x in browser.blocks)["done"] == 1
        finally:
            for browser in joiners:
                await browser.close()
            await emitter.stop()


@pytest.mark.redis
async def test_a_refresh_onto_the_other_web_process_behind_redis_is_caught_up(
    redis_server: RedisServer,
) -> None:
    web1, web2 = RelayProcess(redis_url=redis_server.url), RelayProcess(redis_url=redis_server.url)
    for web in (web1, web2):
        web.start()
    first = refreshed = None
    try:
        await web1.wait_ready()
        await web2.wait_ready()
        # python-socketio subscribes a web process at its first connection.
        first = await connected(web1.port, "on-web1")
        refreshed = await connected(web2.port, "refreshed-on-web2")
        await wait_subscribed(redis_server.url, 2)
        async with worker(web1.port) as w:
            await join(first, C1, have=[])
            await w.call("kx_blocks", frame(C1, [block(s) for s in range(1, 5)]), namespace=NS)
            await first.wait_for(lambda b: len(b) >= 4)
            ack = await join(refreshed, C1, have=[])  # the reload lands on web2
            assert ack["replay"]["blocks"] == 4
            await w.call("kx_blocks", frame(C1, [block(5, state="done")]), namespace=NS)
            await refreshed.wait_for(lambda b: len(b) >= 5)
            await barrier(refreshed, web2.port)
            assert refreshed.blocks == first.blocks
    finally:
        for browser in (first, refreshed):
            if browser is not None:
                await browser.close()
        web1.stop()
        web2.stop()


@pytest.mark.redis
@pytest.mark.parametrize(
    ("redis_server", "caught_up_on_web2"),
    [
        pytest.param({"persist": True}, [1, 2, 5, 6], id="redis-keeps-its-data"),
        pytest.param({"persist": False}, [5, 6], id="redis-loses-its-data"),
    ],
    indirect=["redis_server"],
)
async def test_a_redis_outage_leaves_a_hole_on_the_other_web_process_never_a_double(
    redis_server: RedisServer, caught_up_on_web2: list[int]
) -> None:
    """Blocks that cannot cross Redis are neither shown nor held on the other web process:
    a browser that joins there after the outage (web2 had no browser in the room, so it
    catches up from the room's log on Redis) gets what the log kept — a hole where the
    outage was, and everything before it too when Redis restarted without its data — each
    block once, the terminal once; on the worker's web process nothing is missing."""
    web1, web2 = RelayProcess(redis_url=redis_server.url), RelayProcess(redis_url=redis_server.url)
    for web in (web1, web2):
        web.start()
    browsers: list[Browser] = []
    try:
        await web1.wait_ready()
        await web2.wait_ready()
        first = await connected(web1.port, "on-web1")
        browsers.append(first)
        browsers.append(await connected(web2.port, "idle-on-web2"))
        await wait_subscribed(redis_server.url, 2)
        async with worker(web1.port) as w:
            await join(first, C1, have=[])
            await w.call("kx_blocks", frame(C1, [block(1), block(2)]), namespace=NS)
            await first.wait_for(lambda b: len(b) >= 2)
            redis_server.stop()
            await w.call("kx_blocks", frame(C1, [block(3), block(4)]), namespace=NS)
            await first.wait_for(lambda b: len(b) >= 4)
            redis_server.start()  # same port
            await wait_subscribed(redis_server.url, 2, timeout=60)
            done = block(6, state="done")
            await w.call("kx_blocks", frame(C1, [block(5), done]), namespace=NS)
            await first.wait_for(lambda b: len(b) >= 6)
        on_web2 = await connected(web2.port, "joins-web2")
        on_web1 = await connected(web1.port, "joins-web1")
        browsers += [on_web2, on_web1]
        await join(on_web2, C1, have=[])
        await join(on_web1, C1, have=[])
        assert seqs(on_web2.blocks) == caught_up_on_web2
        assert seqs(on_web1.blocks) == [1, 2, 3, 4, 5, 6]
    finally:
        for browser in browsers:
            await browser.close()
        web1.stop()
        web2.stop()


async def test_a_colleagues_stream_ends_for_a_reconnect_that_missed_its_terminal() -> None:
    """A colleague's blocks carry its own seqs and the caller's terminal the caller's (seq 1
    after blocks 1–8): a browser that holds 1–8 but not the terminal still gets it, one that
    says it holds it (``ended``) does not."""
    async with relay_server() as (port, _), worker(port) as w:
        await w.call("kx_blocks", frame(C1, [block(s) for s in range(1, 9)]), namespace=NS)
        await w.call("kx_blocks", frame(C1, [block(1, state="done")]), namespace=NS)
        missed = await connected(port, "missed-the-answer")
        held = await connected(port, "holds-the-answer")
        try:
            ack = await join(missed, C1, have=[{**KEY, "seq": 8}])
            assert ack["replay"]["blocks"] == 1
            assert [(b["state"], b["envelope"]["seq"]) for b in missed.blocks] == [("done", 1)]
            ack = await join(held, C1, have=[{**KEY, "seq": 8, "ended": True}])
            assert ack["replay"]["blocks"] == 0
            await barrier(held, port)
            assert held.blocks == []
        finally:
            await missed.close()
            await held.close()
