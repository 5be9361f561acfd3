"""Faults, each repeated ``KERNEL_EXT_RELIABILITY_RUNS`` times: every run keeps the invariants.

Real processes over 127.0.0.1: the relay is a subprocess (``tests/support/reliability_relay.py``,
short pings) that is SIGKILLed and restarted, or SIGSTOPped past its ping timeout; the A2A
colleague is the real a2a-sdk peer of :mod:`kernel_ext.testing.a2a_peer` (its fault scripts); the
browser is a real python-socketio client joined to the room; the worker is the whole
worker-side path (tracer provider, span processor, tap, hub, loopback emitter).

Each run checks at the browser: exactly one terminal per stream, last in its stream; on the
worker: every publish returned (the tool never blocks or raises) and nothing is left held.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.network import free_port, serve_asgi
from support.relay_helpers import CONV, NS, Browser, barrier, relay_server, terminals
from support.relay_helpers import block as relay_block
from support.relay_helpers import frame as relay_frame
from support.relay_helpers import worker as internal_sender
from support.reliability_helpers import (
    RUNS,
    Worker,
    browser_on,
    one_terminal_last,
    report,
    running_relay,
    settled,
)
from support.timing import wait_until

from kernel_ext.a2a import ask_colleague, stream_colleague
from kernel_ext.errors import ColleagueError
from kernel_ext.testing.a2a_peer import ScriptedPeer

pytestmark = [pytest.mark.network, pytest.mark.timeout(60 + 30 * RUNS)]


async def test_web_process_killed_mid_stream_every_terminal_arrives_once() -> None:
    published = 0
    async with running_relay() as relay, browser_on(relay.port) as browser:
        async with Worker(relay.port, ack_timeout=1.0) as worker:
            for run in range(RUNS):
                with worker.call(CONV) as call:
                    for i in range(5):
                        worker.hub.publish(f"run {run}: step {i}")
                    await browser.wait_for(lambda _: len(browser.stream(call.call_id)) >= 5)
                    relay.kill()  # SIGKILL mid-stream
                    if run % 2:  # half the runs publish after the worker noticed, half before
                        await wait_until(lambda: not worker.emitter.healthy)
                    for i in range(3):
                        worker.hub.publish(f"run {run}: while down {i}")
                    worker.hub.publish(f"run {run}: the answer", state="done")
                    published += 4  # every publish returned, none raised
                relay.start()  # same port
                await relay.wait_ready()
                await browser.wait_for(lambda _: bool(terminals(browser.stream(call.call_id))))
                await settled(worker)
                await barrier(browser, relay.port)
                stream = browser.stream(call.call_id)
                final = one_terminal_last(stream)
                assert final["envelope"]["payload"] == {"text": f"run {run}: the answer"}
                assert [b["envelope"]["seq"] for b in stream[:5]] == [1, 2, 3, 4, 5]
            emitter_counts = dict(worker.loopback.counts)
            losses = worker.losses()
        assert browser.connects == RUNS + 1  # reconnected after every restart
    assert published == 4 * RUNS
    terminals_seen = len(terminals(browser.blocks))
    assert terminals_seen == RUNS
    report(
        "web process SIGKILLed and restarted mid-stream",
        runs=RUNS,
        terminals_expected=RUNS,
        terminals_delivered=terminals_seen,
        duplicates=0,
        publishes_returned=published,
        worker_drops=losses,
        emitter=emitter_counts,
    )


async def test_web_process_frozen_past_the_ping_timeout_every_terminal_arrives_once() -> None:
    published = 0
    async with running_relay() as relay, browser_on(relay.port) as browser:
        async with Worker(relay.port, ack_timeout=0.5, connect_timeout=1.0) as worker:
            for run in range(RUNS):
                assert relay.proc is not None
                # A conversation per run: a browser that reconnects within the relay's hold
                # time is sent the held terminals of its rooms again (docs/reliability.md).
                room = f"{CONV}-frozen-{run}"
                await browser.switch(room)
                with worker.call(room) as call:
                    for i in range(3):
                        worker.hub.publish(f"run {run}: step {i}")
                    await browser.wait_for(lambda _: len(browser.stream(call.call_id)) >= 3)
                    browser.disconnected.clear()
                    relay.proc.send_signal(signal.SIGSTOP)
                    try:
                        # The tool goes on while the relay is frozen: every publish returns.
                        for i in range(50):
                            worker.hub.publish(f"run {run}: while frozen {i}")
                        worker.hub.publish(f"run {run}: the answer", state="done")
                        published += 51
                        # Frozen past the ping timeout: the browser and the worker notice.
                        await asyncio.wait_for(browser.disconnected.wait(), timeout=15)
                        await wait_until(lambda: not worker.emitter.healthy, timeout=15)
                    finally:
                        relay.proc.send_signal(signal.SIGCONT)
                await browser.wait_for(
                    lambda _: bool(terminals(browser.stream(call.call_id))), timeout=30
                )
                await settled(worker, timeout=30)
                await barrier(browser, relay.port)
                final = one_terminal_last(browser.stream(call.call_id))
                assert final["envelope"]["payload"] == {"text": f"run {run}: the answer"}
            emitter_counts = dict(worker.loopback.counts)
            losses = worker.losses()
            stats = await relay.stats()
        assert browser.disconnects >= RUNS
    assert published == 51 * RUNS
    terminals_seen = len(terminals(browser.blocks))
    assert terminals_seen == RUNS
    report(
        "web process SIGSTOPped past the ping timeout, then SIGCONT",
        runs=RUNS,
        terminals_expected=RUNS,
        terminals_delivered=terminals_seen,
        duplicates=0,
        publishes_returned=published,
        browser_disconnects=browser.disconnects,
        worker_drops=losses,
        emitter=emitter_counts,
        relay=stats["counts"],
    )


# -- A2A faults through the whole path ---------------------------------------------------


@contextlib.asynccontextmanager
async def colleague() -> AsyncIterator[str]:
    port = free_port()
    peer = ScriptedPeer(f"http://127.0.0.1:{port}/")
    async with serve_asgi(peer.app, port):
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await peer.aclose()


class FirstBlock:
    """A publisher that forwards to the hub and notes that a block went out."""

    def __init__(self, worker: Worker) -> None:
        self.hub = worker.hub
        self.seen = asyncio.Event()

    def __call__(self, item: Any, **kwargs: Any) -> None:
        self.hub.publish(item, **kwargs)
        self.seen.set()


async def scenario(worker: Worker, url: str, name: str) -> tuple[str, str]:
    """Run one fault as a tool call; return (callId, the terminal state its streams need)."""
    publish = worker.hub.publish
    if name == "hang":
        with worker.call(CONV) as call, pytest.raises(ColleagueError):
            await ask_colleague(url, "script:hang", publish=publish, timeout=0.5)
        return call.call_id, "aborted"
    if name == "repeat-completed":  # two completed, then a block after completion
        with worker.call(CONV) as call:
            assert await ask_colleague(url, "script:repeat-completed", publish=publish)
        return call.call_id, "done"
    if name in ("disconnect", "close-early", "fail", "crash"):
        with worker.call(CONV) as call, pytest.raises(ColleagueError):
            await ask_colleague(url, f"script:{name}", publish=publish)
        return call.call_id, "aborted"
    if name == "tool-raises":  # the tool fails while its colleague stream is still open
        first = FirstBlock(worker)
        ids: list[str] = []

        async def failing_tool() -> None:
            with worker.call(CONV) as call:
                ids.append(call.call_id)
                child = asyncio.create_task(stream_colleague(url, "script:hang", publish=first))
                try:
                    await asyncio.wait_for(first.seen.wait(), 10)
                    publish("the tool's own step")
                    raise RuntimeError("the tool failed")
                finally:
                    child.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await child

        with pytest.raises(RuntimeError, match="the tool failed"):
            await failing_tool()
        return ids[0], "aborted"
    if name == "tool-cancelled":  # asyncio cancellation of the tool mid-stream
        first = FirstBlock(worker)
        ids = []

        async def tool() -> None:
            with worker.call(CONV) as call:
                ids.append(call.call_id)
                await ask_colleague(url, "script:hang", publish=first)

        task = asyncio.create_task(tool())
        await asyncio.wait_for(first.seen.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return ids[0], "aborted"
    raise AssertionError(name)


# Scenario -> the streams it opens (the colleague's task; the tool's own local one too).
SCENARIOS = {
    "disconnect": 1,
    "hang": 1,
    "repeat-completed": 1,
    "close-early": 1,
    "fail": 1,
    "crash": 1,
    "tool-raises": 2,
    "tool-cancelled": 1,
}


async def test_a2a_faults_each_end_every_stream_with_one_terminal_at_the_browser() -> None:
    async with (
        running_relay() as relay,
        browser_on(relay.port) as browser,
        colleague() as url,
        Worker(relay.port, ack_timeout=5.0) as worker,
    ):
        for _ in range(RUNS):
            results = await asyncio.gather(*(scenario(worker, url, name) for name in SCENARIOS))
            await settled(worker)
            await barrier(browser, relay.port)
            for name, (call_id, state) in zip(SCENARIOS, results, strict=True):
                tasks = {b["taskId"] for b in browser.stream(call_id)}
                assert len(tasks) == SCENARIOS[name], (name, tasks)
                for task_id in tasks:
                    final = one_terminal_last(browser.stream(call_id, task_id))
                    assert final["state"] == state, (name, final)
        losses = worker.losses()
    expected = RUNS * sum(SCENARIOS.values())
    delivered = len(terminals(browser.blocks))
    assert delivered == expected
    assert "error" not in losses
    report(
        "A2A peer faults, tool raises, tool cancelled (all at once)",
        runs=RUNS,
        scenarios=list(SCENARIOS),
        terminals_expected=expected,
        terminals_delivered=delivered,
        duplicates=0,
        worker_drops=losses,
    )


async def a_browser_got_it_and_left(port: int, relay: Any, final: dict[str, Any]) -> None:
    """A terminal goes to a room's one browser, which then leaves (the relay has no browser
    any more): what the re-sent-terminal tests start from."""
    first = Browser("first")
    try:
        await first.connect(port)
        assert await first.join(CONV) == {"ok": True}
        async with internal_sender(port) as sender:
            await sender.call("kx_blocks", relay_frame(CONV, [final]), namespace=NS)
        await first.wait_for(lambda blocks: len(blocks) == 1)
    finally:
        await first.close()
    await wait_until(lambda: relay.stats()["browsers"] == 0)


async def test_a_re_sent_terminal_goes_again_to_a_room_whose_browsers_all_left() -> None:
    """Regression (found by the freeze test): a frozen web process, once resumed, emits the
    frame it got before freezing into connections that died meanwhile; the sender's re-send
    (its acknowledgement never came) was dropped as a duplicate, so the browser that had
    reconnected never got the terminal. Here the first browser leaving stands for that."""
    final = relay_block(7, state="done", text="the answer")
    # Without catch-up: with it, the second browser is caught up with the held terminal at
    # its join (test_a_re_sent_terminal_after_a_catch_up_is_a_duplicate).
    async with relay_server(catch_up=False) as (port, relay):
        await a_browser_got_it_and_left(port, relay, final)
        second = Browser("second")
        try:
            await second.connect(port)
            assert await second.join(CONV) == {"ok": True}
            async with internal_sender(port) as sender:  # the re-send
                ack = await sender.call("kx_blocks", relay_frame(CONV, [final]), namespace=NS)
                assert ack == {"ok": True, "accepted": 1, "rejected": 0}
                await second.wait_for(lambda blocks: len(blocks) == 1)
                # Re-sent again while the second browser is still there: not emitted.
                await sender.call("kx_blocks", relay_frame(CONV, [final]), namespace=NS)
            await barrier(second, port)
            assert second.blocks == [final]
        finally:
            await second.close()
    stats = relay.stats()
    assert (stats["terminal_reemitted"], stats["duplicate_terminal"]) == (1, 1)


async def test_a_re_sent_terminal_after_a_catch_up_is_a_duplicate() -> None:
    """With catch-up, a browser that joins after the terminal went to a room whose browsers
    all left gets it from the relay's memory; the sender's re-send is then a duplicate for
    that browser, not a second terminal."""
    final = relay_block(7, state="done", text="the answer")
    async with relay_server() as (port, relay):
        await a_browser_got_it_and_left(port, relay, final)
        second = Browser("second")
        try:
            await second.connect(port)
            assert await second.join(CONV) == {"ok": True}
            assert second.blocks == [final]  # caught up
            async with internal_sender(port) as sender:  # the re-send
                ack = await sender.call("kx_blocks", relay_frame(CONV, [final]), namespace=NS)
                assert ack == {"ok": True, "accepted": 1, "rejected": 0}
            await barrier(second, port)
            assert second.blocks == [final]
        finally:
            await second.close()
    stats = relay.stats()
    assert stats.get("terminal_reemitted", 0) == 0
    assert stats["duplicate_terminal"] == 1
