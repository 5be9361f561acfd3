"""Exactly one terminal, whatever else closed meanwhile (issue: terminal edges, item 5).

What is remembered about a closed stream lives with its call: while the call is live, a
later running block or a second terminal of a closed stream is dropped however many other
streams closed and however long ago; when the call ends it is all released, and what a
task the tool started still publishes for the ended call is dropped too. Checked at a real
browser on both delivery paths: the loopback relay (uvicorn on 127.0.0.1) and the
write-only Redis path (a real redis-server and a relay subprocess).
"""

from __future__ import annotations

import contextvars
from typing import Any

import pytest
from support.network import RedisServer, serve_asgi
from support.redis_helpers import wait_subscribed
from support.relay_helpers import SECRET, barrier, terminals
from support.reliability_helpers import (
    DEFAULT_PINGS,
    WatchedBrowser,
    Worker,
    browser_on,
    report,
    running_relay,
)
from support.timing import FakeClock, wait_until

from kernel_ext.emit import RedisEmitter
from kernel_ext.relay import allow_all, create_app
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]


async def late_blocks_of_a_long_call(
    worker: Worker, clock: FakeClock, browser: WatchedBrowser
) -> str:
    """One live call closes a stream; then 1,100 other streams close (500 of this call, 600
    of six other live calls) and 11 s pass; then the stream gets a running block and a
    second terminal; the call ends; a task it started publishes after the end. Returns the
    call id."""
    room = browser.rooms[0]
    with worker.call(room) as call:
        worker.hub.publish("step 1", task_id="first")
        worker.hub.publish("the answer", task_id="first", state="done")
        for i in range(500):
            worker.hub.publish(f"other {i}", task_id=f"other-{i}")
            worker.hub.publish(f"answer {i}", task_id=f"other-{i}", state="done")
        for _ in range(6):  # more closed streams in all than the old memory held (1,024)
            with worker.call(room):
                for i in range(100):
                    worker.hub.publish(f"elsewhere {i}", task_id=f"else-{i}")
                    worker.hub.publish(f"answer {i}", task_id=f"else-{i}", state="done")
            await worker.emitter.flush(10)
        clock.now += 11.0  # longer than the old memory's 10 s
        worker.hub.publish("a late running block", task_id="first")
        worker.hub.publish("a second answer", task_id="first", state="done")
        worker.hub.publish("a late abort", task_id="first", state="aborted")
        worker.hub.publish("still running", task_id="open")
        lingering = contextvars.copy_context()  # what a task the tool started would hold
    # The call ended: its open stream got its one terminal; a lingering task publishes.
    lingering.run(worker.hub.publish, "after the end", task_id="open")
    lingering.run(worker.hub.publish, "after the end", task_id="first", state="done")
    lingering.run(worker.hub.publish, "a new stream after the end", task_id="new")
    await worker.emitter.flush(10)
    return call.call_id


def check(browser: WatchedBrowser, call_id: str) -> None:
    first = browser.stream(call_id, "first")
    assert [b["state"] for b in first] == ["running", "done"]
    assert first[-1]["envelope"]["payload"] == {"text": "the answer"}
    opened = browser.stream(call_id, "open")
    assert [b["state"] for b in opened] == ["running", "aborted"]
    assert browser.stream(call_id, "new") == []
    for i in range(500):
        assert len(terminals(browser.stream(call_id, f"other-{i}"))) == 1
    # One terminal per stream: first, 500 others, the six calls' 600, "open", and the
    # call's local stream that showed the six nested calls as tool_call blocks — the hub's
    # stream, ended done as the call returned.
    finals = [b for b in browser.blocks if b["state"] != "running"]
    assert len(finals) == len({(b["callId"], b["taskId"]) for b in finals}) == 1103
    local = browser.stream(call_id, call_id)
    assert [b["state"] for b in local] == ["running"] * 6 + ["done"]
    assert local[-1]["envelope"]["payload"] == {"text": "the tool call finished"}


def report_path(path: str, browser: WatchedBrowser, call_id: str, worker: Worker) -> None:
    stats = worker.hub.stats()
    report(
        f"late blocks of a closed stream ({path})",
        other_streams_closed=1_100,
        hub_clock_advanced_s=11,
        late_blocks_published=6,
        late_blocks_at_browser=len(browser.stream(call_id, "first"))
        - 2
        + len(browser.stream(call_id, "new")),
        terminals_at_browser=len(terminals(browser.blocks)),
        dropped_closed=stats["closed"],
        dropped_duplicate_terminal=stats["duplicate_terminal"],
        left_in_hub=stats.streams + stats.calls + stats.closed,
    )


def check_worker(worker: Worker) -> None:
    stats = worker.hub.stats()
    assert stats["closed"] == 4  # the late running block and the lingering task's three
    assert stats["duplicate_terminal"] == 2
    assert (stats.streams, stats.calls, stats.closed) == (0, 0, 0)


async def test_late_blocks_of_a_closed_stream_never_reach_the_browser_over_the_relay() -> None:
    clock = FakeClock(10_000.0)
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, "conv-late") as browser:
        async with Worker(port, max_running_per_second=None, hub_options={"clock": clock}) as w:
            call_id = await late_blocks_of_a_long_call(w, clock, browser)
            await wait_until(lambda: w.sizes()["pending_terminals"] == 0)
            await browser.wait_for(lambda _: len(terminals(browser.blocks)) >= 1103)
            await barrier(browser, port)
            check(browser, call_id)
            check_worker(w)
            report_path("loopback relay", browser, call_id, w)
        assert ready.relay.stats().get("duplicate_terminal", 0) == 0  # the hub dropped them


@pytest.mark.redis
async def test_late_blocks_of_a_closed_stream_never_reach_the_browser_over_redis(
    redis_server: RedisServer,
) -> None:
    clock = FakeClock(10_000.0)

    def redis_emitter(hub: StreamHub) -> RedisEmitter:
        return RedisEmitter(redis_server.url, hub=hub)

    web = running_relay(redis_server.url, pings=DEFAULT_PINGS)  # a busy loop is no dead browser
    async with web as relay, browser_on(relay.port, "c") as browser:
        await wait_subscribed(redis_server.url, 1)
        options: dict[str, Any] = {"hub_options": {"clock": clock}}
        async with Worker(emitter=redis_emitter, max_running_per_second=None, **options) as w:
            call_id = await late_blocks_of_a_long_call(w, clock, browser)
            await browser.wait_for(lambda _: len(terminals(browser.blocks)) >= 1103)
            await barrier(browser, relay.port)
            check(browser, call_id)
            check_worker(w)
            report_path("Redis emitter", browser, call_id, w)
