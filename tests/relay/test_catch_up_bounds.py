"""Catch-up under back-pressure and abuse (docs/operations.md, "Back-pressure" and
"Catch-up"; docs/reliability.md): a browser that never reads holds at most its bound and is
let go; a re-join loop is held to the connection's budget, and the acknowledgement says so;
many joiners at once share the process's bound on catch-ups in flight and each still gets
its whole pane; a renderer that re-joins with what it holds is never limited. A bystander of
another conversation gets every live block meanwhile.

A real relay (uvicorn on 127.0.0.1), real python-socketio browsers and workers, and a
WebSocket client that never reads (``NeverReads``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest
from support.relay_helpers import (
    C1,
    C2,
    NS,
    SECRET,
    Browser,
    NeverReads,
    barrier,
    block,
    connected,
    frame,
    join,
    relay_server,
    seqs,
    worker,
)
from support.timing import wait_until

from kernel_ext.errors import ConfigError
from kernel_ext.protocol import block_size
from kernel_ext.relay import ChatRelay

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]


def pane(tasks: int, blocks: int, text: str) -> list[list[dict[str, Any]]]:
    """Per task, ``blocks`` running blocks and a terminal: one frame's blocks each."""
    return [
        [block(s, task_id=f"task-{t}", text=text) for s in range(1, blocks + 1)]
        + [block(blocks + 1, task_id=f"task-{t}", state="done")]
        for t in range(tasks)
    ]


def whole(browser: Browser, tasks: int, blocks: int) -> bool:
    return all(
        seqs(browser.blocks, f"task-{t}") == list(range(1, blocks + 2)) for t in range(tasks)
    )


async def bystander_gets_live_blocks(port: int, w: Any, n: int) -> Browser:
    """A browser of C2 that gets ``n`` live blocks, sent one frame each."""
    bystander = await connected(port, "bystander")
    assert await join(bystander, C2) == {"ok": True}
    for s in range(1, n + 1):
        await w.call("kx_blocks", frame(C2, [block(s, task_id="live")]), namespace=NS)
    return bystander


async def test_a_reader_that_never_reads_and_keeps_joining_holds_at_most_its_bound() -> None:
    """Twenty re-joins of a 1.5 MiB pane by a connection that reads nothing: what is queued
    for it stays within its bound (packets and bytes) while its catch-ups wait; after a
    stall of ``browser_stall_timeout`` it is disconnected, counted, and what was queued for
    it is let go (no catch-up bytes in flight any more)."""
    packets_bound, bytes_bound = 40, 256 * 1024
    options = {
        "browser_queue_max": packets_bound,
        "browser_queue_bytes": bytes_bound,
        "browser_stall_timeout": 3.0,
        "catch_up_budget": None,
    }
    async with relay_server(**options) as (port, relay), worker(port) as w:
        for blocks in pane(4, 24, "x" * 16_000):
            await w.call("kx_blocks", frame(C1, blocks), namespace=NS)
        slow = NeverReads()
        await slow.open(port)
        bystander = None
        try:
            for _ in range(20):
                await slow.send("join_conversation", {"conversationId": C1, "have": []})
                await slow.send("leave_conversation", {"conversationId": C1})
            peaks: list[tuple[int, int]] = []

            def waiting() -> bool:
                stats = relay.stats()
                peaks.append((stats["browser_queue_peak"], stats["browser_queue_peak_bytes"]))
                return stats.get("catch_up_waits", 0) >= 1

            await wait_until(waiting, 30)
            bystander = await bystander_gets_live_blocks(port, w, 30)
            await wait_until(lambda: relay.stats().get("browsers_stalled") == 1, 60)
            assert max(p for p, _ in peaks) <= packets_bound, peaks[-1]
            assert 16_000 < max(b for _, b in peaks) <= bytes_bound, peaks[-1]
            await wait_until(lambda: relay.stats()["browsers"] == 1, 30)
            stats = relay.stats()
            assert stats["catch_up_inflight"] == 0  # its queue was let go
            assert stats["catch_up_inflight_peak"] <= bytes_bound
            await bystander.wait_for(lambda b: len(b) >= 30)
            assert seqs(bystander.blocks, "live") == list(range(1, 31))
        finally:
            slow.abort()
            if bystander is not None:
                await bystander.close()


async def test_a_browser_that_running_blocks_skip_and_that_never_reads_is_let_go() -> None:
    """The live path's side of the same rule: running blocks skip a browser at its bound
    (``browser_queue_full``); one that does not read down to a quarter of it within
    ``browser_stall_timeout`` is disconnected, counted, and its queue released, while a
    bystander gets every block."""
    options = {"browser_queue_max": 40, "browser_stall_timeout": 2.0, "ack_pace_timeout": 0.2}
    async with relay_server(**options) as (port, relay), worker(port) as w:
        slow = NeverReads()
        await slow.open(port)
        bystander = await connected(port, "bystander")
        try:
            await slow.send("join_conversation", {"conversationId": C1})
            assert await join(bystander, C1) == {"ok": True}
            await wait_until(lambda: relay.stats()["browsers"] == 2, 10)
            seq = 0
            while not relay.stats().get("browser_queue_full"):
                assert seq < 400, "no running block ever skipped the browser that never reads"
                seq += 1
                await w.call("kx_blocks", frame(C1, [block(seq, text="q" * 16_000)]), namespace=NS)
            await wait_until(lambda: relay.stats().get("browsers_stalled") == 1, 30)
            await wait_until(lambda: relay.stats()["browsers"] == 1, 30)
            await bystander.wait_for(lambda b: len(b) >= seq, 30)
            assert seqs(bystander.blocks) == list(range(1, seq + 1))
        finally:
            slow.abort()
            await bystander.close()


async def test_a_leave_and_join_loop_without_have_is_held_to_the_budget() -> None:
    """The budget is two panes: two joins get the whole pane, the third is limited — it
    gets less than a pane, the acknowledgement says ``limited`` and what is missing, counted
    — and over a loop of joins the bytes sent stay within the budget and its refill."""
    blocks = [block(s, text="y" * 1_000) for s in range(1, 101)]
    size = sum(block_size(b) for b in blocks)
    options = {
        "max_block_bytes": 4096,
        "replay_stream_bytes": 128 * 1024,
        "replay_conversation_bytes": 128 * 1024,
        "catch_up_budget": 2 * size,
    }
    async with relay_server(**options) as (port, relay), worker(port) as w:
        await w.call("kx_blocks", frame(C1, blocks), namespace=NS)
        bystander = await connected(port, "bystander")
        assert await join(bystander, C2) == {"ok": True}
        looper = await connected(port, "looper")
        try:
            start = time.monotonic()
            got: list[int] = []
            acks = []
            for n in range(12):
                before = len(looper.blocks)
                acks.append(await join(looper, C1))
                await barrier(looper, port)
                got.append(sum(block_size(b) for b in looper.blocks[before:]))
                await looper.client.call(
                    "leave_conversation", {"conversationId": C1}, namespace=NS, timeout=5
                )
                await w.call("kx_blocks", frame(C2, [block(n + 1, task_id="live")]), namespace=NS)
            elapsed = time.monotonic() - start
            assert acks[:2] == [{"ok": True}, {"ok": True}]  # exactly the budget
            assert got[:2] == [size, size]
            limited = acks[2]["replay"]  # one past it
            assert limited["limited"] is True
            assert got[2] < size
            assert limited["blocks"] < len(blocks)
            assert limited["missing"] == [
                {
                    "callId": blocks[0]["callId"],
                    "taskId": "task-1",
                    "blocks": 100 - limited["blocks"],
                }
            ]
            assert all(ack["replay"]["limited"] is True for ack in acks[2:])
            assert sum(got) <= 2 * size + elapsed * 2 * size / 60 + 4096
            assert relay.stats()["catch_up_limited"] == 10
            await bystander.wait_for(lambda b: len(b) >= 12)
            assert seqs(bystander.blocks, "live") == list(range(1, 13))
        finally:
            await looper.close()
            await bystander.close()


async def test_joins_sent_at_once_on_one_connection_share_its_budget() -> None:
    """Six joins of a room at once, each waiting for the browser to read as it goes (a
    small ``browser_queue_max``), so that none has entered the room when the others start:
    together they get at most the budget — two panes — and the rest are limited."""
    blocks = [block(s, text="y" * 1_000) for s in range(1, 101)]
    size = sum(block_size(b) for b in blocks)
    options = {
        "browser_queue_max": 40,
        "max_block_bytes": 4096,
        "replay_stream_bytes": 128 * 1024,
        "replay_conversation_bytes": 128 * 1024,
        "catch_up_budget": 2 * size,
    }
    async with relay_server(**options) as (port, relay), worker(port) as w:
        await w.call("kx_blocks", frame(C1, blocks), namespace=NS)
        browser = await connected(port)
        try:
            acks = await asyncio.gather(*(join(browser, C1, have=[]) for _ in range(6)))
            await barrier(browser, port)
            assert sum(ack["replay"]["blocks"] for ack in acks) <= 2 * len(blocks) + 4
            assert sum(block_size(b) for b in browser.blocks) <= 2 * size + 4096
            assert sum(1 for ack in acks if ack["replay"].get("limited")) >= 4
            assert relay.stats()["catch_up_limited"] >= 4
        finally:
            await browser.close()


async def test_a_join_of_a_room_it_is_in_already_sends_nothing_again() -> None:
    async with relay_server() as (port, relay), worker(port) as w:
        await w.call("kx_blocks", frame(C1, [block(s) for s in range(1, 7)]), namespace=NS)
        browser = await connected(port)
        try:
            assert await join(browser, C1) == {"ok": True}
            assert seqs(browser.blocks) == [1, 2, 3, 4, 5, 6]
            assert await join(browser, C1) == {"ok": True}  # in the room already, no have
            await w.call("kx_blocks", frame(C1, [block(7, state="done")]), namespace=NS)
            await browser.wait_for(lambda b: len(b) >= 7)
            await barrier(browser, port)
            assert seqs(browser.blocks) == [1, 2, 3, 4, 5, 6, 7]
            stats = relay.stats()
            assert stats["rejoins"] == 1
            assert stats["replay_blocks"] == 6
        finally:
            await browser.close()


async def test_many_joiners_at_once_share_the_bound_in_flight_and_each_gets_its_whole_pane() -> (
    None
):
    inflight = 64 * 1024
    async with (
        relay_server(catch_up_inflight_bytes=inflight) as (port, relay),
        worker(port) as w,
    ):
        for blocks in pane(2, 40, "z" * 4_000):
            await w.call("kx_blocks", frame(C1, blocks), namespace=NS)
        joiners = [await connected(port, f"tab-{n}") for n in range(24)]
        bystander = None
        try:
            joining = asyncio.gather(*(join(tab, C1, have=[]) for tab in joiners))
            bystander = await bystander_gets_live_blocks(port, w, 20)
            acks = await asyncio.wait_for(joining, 60)
            assert all(ack["ok"] and ack["replay"]["blocks"] == 82 for ack in acks), acks
            for tab in joiners:
                await tab.wait_for(lambda b, tab=tab: whole(tab, 2, 40), 30)
                assert Counter(b["state"] for b in tab.blocks)["done"] == 2
            stats = relay.stats()
            assert 0 < stats["catch_up_inflight_peak"] <= inflight
            assert stats["catch_up_pool_waits"] >= 1
            assert stats["catch_up_inflight"] == 0
            await bystander.wait_for(lambda b: len(b) >= 20)
            assert seqs(bystander.blocks, "live") == list(range(1, 21))
        finally:
            for tab in joiners:
                await tab.close()
            if bystander is not None:
                await bystander.close()


async def test_a_renderer_that_rejoins_with_what_it_holds_is_never_limited() -> None:
    """The smallest budget (one conversation) and a browser that re-joins forty times on one
    connection, each time saying what it holds (as the reference renderer does on every
    connect), while the stream goes on: never limited, the pane whole and in order."""
    options = {
        "max_block_bytes": 4096,
        "replay_stream_bytes": 64 * 1024,
        "replay_conversation_bytes": 64 * 1024,
        "catch_up_budget": 64 * 1024,
    }
    async with relay_server(**options) as (port, relay), worker(port) as w:
        honest = await connected(port, "honest")
        try:
            await w.call(
                "kx_blocks",
                frame(C1, [block(s, text="h" * 1_000) for s in range(1, 41)]),
                namespace=NS,
            )
            assert (await join(honest, C1, have=honest.have()))["replay"]["blocks"] == 40
            for n in range(41, 81):
                live = block(n, text="h" * 1_000)
                await w.call("kx_blocks", frame(C1, [live]), namespace=NS)
                await honest.wait_for(lambda b, n=n: len(b) >= n)
                ack = await join(honest, C1, have=honest.have())
                assert ack["ok"] is True
                assert "limited" not in ack["replay"], ack
            await barrier(honest, port)
            assert seqs(honest.blocks) == list(range(1, 81))
            assert "catch_up_limited" not in relay.stats()
        finally:
            await honest.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"browser_queue_bytes": 1024}, "browser_queue_bytes must hold one block"),
        ({"browser_queue_bytes": 0}, "browser_queue_bytes"),
        ({"catch_up_inflight_bytes": 1024}, "catch_up_inflight_bytes must hold one block"),
        ({"browser_stall_timeout": 0}, "browser_stall_timeout"),
        ({"catch_up_budget": 1 << 20}, "catch_up_budget must hold one conversation"),
    ],
)
def test_a_bound_that_cannot_hold_what_it_bounds_is_refused(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        ChatRelay(SECRET, **options)
