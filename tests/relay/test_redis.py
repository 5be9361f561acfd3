"""Scale-out through a real redis-server: two web processes, the write-only Redis emitter."""

from __future__ import annotations

import asyncio
import logging

import pytest
from support.network import RedisServer
from support.redis_helpers import wait_subscribed
from support.relay_helpers import (
    CONV,
    LONE_BLOCKS,
    LONE_STREAMS,
    LONE_TOOL,
    Browser,
    RelayProcess,
    barrier,
    count,
    emitter_for,
    in_call,
    publish_lone_surrogates,
    record_sender_events,
    streams_of,
    terminals,
)
from support.timing import wait_until

from kernel_ext._shared import compat
from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import RedisEmitter
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.redis]


async def test_two_web_processes_behind_redis_serve_one_room(redis_server: RedisServer) -> None:
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    web1, web2 = RelayProcess(redis_url=redis_server.url), RelayProcess(redis_url=redis_server.url)
    b1, b2 = Browser("on-web1"), Browser("on-web2")
    try:
        web1.start()
        web2.start()
        await web1.wait_ready()
        await web2.wait_ready()
        await b1.connect(web1.port)
        await b2.connect(web2.port)
        assert await b1.join(CONV) == {"ok": True}
        assert await b2.join(CONV) == {"ok": True}
        await wait_subscribed(redis_server.url, 2)
        emitter = emitter_for(web1.port, hub)  # the worker talks to web1 only
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            with in_call():
                for i in range(50):
                    hub.publish(f"step {i}")
                hub.publish("the answer", state="done")
            await b1.wait_for(count(51))
            await b2.wait_for(count(51))
            assert await emitter.flush(10)
        await barrier(b1, web1.port)
        await barrier(b2, web2.port)
        for b in (b1, b2):
            assert [x["envelope"]["seq"] for x in b.blocks] == list(range(1, 52))
            assert len(terminals(b.blocks)) == 1
    finally:
        await b1.close()
        await b2.close()
        web1.stop()
        web2.stop()


async def test_the_redis_emitter_keeps_every_rooms_order_and_chat_events_place_in_batches(
    redis_server: RedisServer,
) -> None:
    """The sender publishes each batch as one Redis pipeline: many rooms' blocks and a chat
    event interleaved still reach browsers on both web processes in publish order, and
    every block is counted delivered once."""
    from kernel_ext.context import ToolCall, use_tool_call

    rooms = [f"conv-{i}" for i in range(4)]
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    webs = [RelayProcess(redis_url=redis_server.url) for _ in range(2)]
    browsers = [Browser(f"b{i}") for i in range(len(rooms))]
    try:
        for web in webs:
            web.start()
        for web in webs:
            await web.wait_ready()
        for i, (b, room) in enumerate(zip(browsers, rooms, strict=True)):
            await b.connect(webs[i % 2].port)
            assert await b.join(room) == {"ok": True}
        await wait_subscribed(redis_server.url, 2)
        emitter = RedisEmitter(redis_server.url, hub=hub, batch_max=64)
        async with emitter:
            for step in range(100):
                for i, room in enumerate(rooms):
                    with use_tool_call(ToolCall(f"{i + 1:016x}", "ask_colleague", room)):
                        if step == 50:
                            hub.publish_chat_event({"eventId": f"{i + 1:016x}", "step": 50})
                        state = "done" if step == 99 else "running"
                        hub.publish(f"step {step}", task_id="t", state=state)
            for b in browsers:
                await b.wait_for(count(100))
            assert await emitter.flush(10)
        for i, b in enumerate(browsers):
            await barrier(b, webs[i % 2].port)
            assert [x["envelope"]["seq"] for x in b.blocks] == list(range(1, 101))
            assert b.order.index("chat_event") == 50  # after the first 50 blocks
            assert len(terminals(b.blocks)) == 1
        assert hub.stats()["delivered"] == 100 * len(rooms)
        assert emitter.counts["no_listener"] == 0
    finally:
        for b in browsers:
            await b.close()
        for web in webs:
            web.stop()


async def test_lone_surrogates_cross_redis_as_published_live_and_from_the_rooms_log(
    redis_server: RedisServer,
) -> None:
    """The Redis sender's JSON (ensure_ascii) and the room's log (compact UTF-8 with
    surrogatepass, read back by ``json.loads``) carry a lone surrogate unchanged: a browser
    on the web process that hears the call live, and one that joins afterwards on the
    other (caught up from the room's log on Redis), get the same blocks."""
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    webs = [RelayProcess(redis_url=redis_server.url) for _ in range(2)]
    live, idle, late = Browser("live-on-web1"), Browser("idle-on-web2"), Browser("late-on-web2")
    try:
        for web in webs:
            web.start()
        for web in webs:
            await web.wait_ready()
        await live.connect(webs[0].port)
        await idle.connect(webs[1].port)
        assert await live.join(CONV) == {"ok": True}
        await wait_subscribed(redis_server.url, 2)
        async with RedisEmitter(redis_server.url, hub=hub) as emitter:
            publish_lone_surrogates(hub)
            await live.wait_for(count(LONE_BLOCKS))
            assert await emitter.flush(10)
        await late.connect(webs[1].port)
        assert await late.join(CONV) == {"ok": True}
        await barrier(late, webs[1].port)
        await barrier(live, webs[0].port)
        assert live.chat_events == [LONE_TOOL]
        assert streams_of(live.blocks) == streams_of(late.blocks) == LONE_STREAMS
        assert (hub.stats()["invalid"], hub.stats()["error"]) == (1, 0)
    finally:
        for browser in (live, idle, late):
            await browser.close()
        for web in webs:
            web.stop()


async def test_redis_emitter_reports_an_outage_and_delivers_terminals_once_back(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kernel_ext.emit")
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    web = RelayProcess(redis_url=redis_server.url)
    browser = Browser()
    health: list[bool] = []
    down = asyncio.Event()
    up_again = asyncio.Event()

    def on_health(healthy: bool) -> None:
        health.append(healthy)
        (up_again if healthy else down).set()

    emitter = RedisEmitter(redis_server.url, hub=hub, on_health=on_health, retry_interval=0.1)
    try:
        web.start()
        await web.wait_ready()
        await browser.connect(web.port)
        assert await browser.join(CONV) == {"ok": True}
        await wait_subscribed(redis_server.url, 1)
        async with emitter:
            with in_call("00f067aa0ba902b1"):
                hub.publish_chat_event({"eventId": "00f067aa0ba902b1"})
                hub.publish("step 1")
                hub.publish("first answer", state="done")
            await browser.wait_for(count(2))
            assert browser.order == ["chat_event", "tool_event_stream", "tool_event_stream"]
            assert emitter.healthy

            redis_server.stop()  # Redis goes down
            with in_call("00f067aa0ba902b2"):
                hub.publish("lost while down")
                hub.publish("second answer", state="done")
            await asyncio.wait_for(down.wait(), timeout=10)
            assert not emitter.healthy  # reported, not silent
            await wait_until(lambda: hub.stats()["redis_down"] >= 1)
            assert emitter.outages == 1
            assert emitter._pending() == 1  # the terminal is kept

            redis_server.start()  # same port
            await asyncio.wait_for(up_again.wait(), timeout=15)
            await browser.wait_for(lambda b: len(terminals(b)) >= 2, timeout=30)
            assert await emitter.flush(10)
        await barrier(browser, web.port)
        finals = [x["envelope"]["payload"]["text"] for x in terminals(browser.blocks)]
        assert finals == ["first answer", "second answer"]
        assert "lost while down" not in str(browser.blocks)
        assert health == [False, True]
        # The outage is an error; Redis being back is not a problem: INFO.
        changes = [
            (r.levelno, r.getMessage().split(" (")[0])
            for r in caplog.records
            if r.getMessage().startswith("redis emitter: Redis at ")
            and "reachable" in r.getMessage()
        ]
        url = redis_server.url
        assert changes == [
            (logging.ERROR, f"redis emitter: Redis at {url} is unreachable"),
            (logging.INFO, f"redis emitter: Redis at {url} is reachable again"),
        ]
    finally:
        await browser.close()
        web.stop()


async def test_the_redis_senders_counts_reach_opentelemetry_as_they_happen(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = record_sender_events(monkeypatch)
    hub = StreamHub(tap=Tap())
    emitter = RedisEmitter(redis_server.url, hub=hub, heartbeat_interval=0.05, retry_interval=0.05)
    async with emitter:
        await wait_until(lambda: emitter.counts["heartbeats"] >= 2)
        with in_call():
            hub.publish("nobody listens")
        await wait_until(lambda: emitter.counts["no_listener"] >= 1)
        redis_server.stop()
        await wait_until(lambda: not emitter.healthy)
        redis_server.start()  # same port
        await wait_until(lambda: emitter.healthy, timeout=15)
    assert emitter.outages == emitter.counts["outages"] == 1
    assert events() == {("redis", event): n for event, n in emitter.counts.items()}


async def test_without_a_reported_receiver_count_a_publish_that_did_not_fail_is_delivered(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A python-socketio whose publish result kernel_ext cannot read (kernel_ext._shared.compat):
    Redis is not taken for down on every publish; publishes count as delivered."""
    monkeypatch.setattr(compat, "publish_result_supported", lambda: False)
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    emitter = RedisEmitter(redis_server.url, hub=hub)
    async with emitter:
        with in_call():
            hub.publish("step 1")
            hub.publish("the answer", state="done")
        await wait_until(lambda: hub.stats()["delivered"] == 2)
        assert emitter.healthy
        assert emitter._pending() == 0
    assert emitter.outages == 0
