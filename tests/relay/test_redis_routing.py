"""Room-routed fan-out on a real redis-server: each web process hears only the rooms of its
browsers, a browser that joins on a web process that never heard the room is caught up from
the room's log, nothing is lost or doubled in the window of a join, an older web process on
the channel keeps getting every emit, and a web process that could not hear Redis catches its
browsers up once it can.

Web processes are ``python -m kernel_ext.relay`` processes or relay apps in this process
(where a test reads their manager), browsers real python-socketio clients, workers an
internal connection sending ``kx_blocks`` frames or a real :class:`RedisEmitter`; a pattern
subscriber (which Redis does not count among a channel's subscribers) watches where each
message goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import socketio
from support.network import RedisServer, flaky_network, serve_asgi
from support.redis_helpers import wait_subscribed
from support.relay_helpers import (
    C1,
    C2,
    NS,
    SECRET,
    Browser,
    RelayProcess,
    barrier,
    block,
    connected,
    frame,
    in_call,
    join,
    seqs,
    worker,
)
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import RedisEmitter
from kernel_ext.protocol import REPLAY_IDLE
from kernel_ext.redis.routing import LOG_MAX_BLOCKS, marker_channel, room_channel, room_log
from kernel_ext.relay import RelayRedisManager, allow_all, create_app, mount_relay
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.redis, pytest.mark.timeout(120)]

CHANNEL = "socketio"


class Spy:
    """Every message published on the channel and the room channels, by channel: a pattern
    subscription (``PSUBSCRIBE``), which ``PUBSUB NUMSUB`` does not count."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.changed = asyncio.Event()

    def emits(self, event: str = "tool_event_stream") -> list[tuple[str, Any]]:
        """(channel, room) of each emit of ``event`` seen."""
        return [(c, m.get("room")) for c, m in self.seen if m.get("event") == event]


@contextlib.asynccontextmanager
async def spying(url: str) -> AsyncIterator[Spy]:
    from redis import asyncio as aioredis

    spy = Spy()
    client = aioredis.Redis.from_url(url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.psubscribe(f"{CHANNEL}*")

    async def listen() -> None:
        async for message in pubsub.listen():
            if message.get("type") != "pmessage":
                continue
            try:
                data = json.loads(message["data"])
            except ValueError:
                continue
            if isinstance(data, dict):
                spy.seen.append((message["channel"].decode(), data))
                spy.changed.set()

    task = asyncio.get_running_loop().create_task(listen())
    try:
        yield spy
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await pubsub.aclose()
        await client.aclose()


async def numsub(url: str, *channels: str) -> list[int]:
    from redis import asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        return [int(n) for _, n in await client.pubsub_numsub(*channels)]
    finally:
        await client.aclose()


async def wait_numsub(url: str, channel: str, n: int) -> None:
    async def reached() -> bool:
        return (await numsub(url, channel))[0] == n

    await wait_until(reached, 20, f"{channel} never had {n} subscribers", interval=0.05)


def rooms_channel(room: str) -> str:
    return room_channel(CHANNEL, NS, room)


@contextlib.asynccontextmanager
async def web_processes(
    url: str, n: int, *, through: list[str] | None = None
) -> AsyncIterator[list[RelayProcess]]:
    """``n`` relay processes on Redis at ``url`` (or at the URLs ``through``, by process:
    a proxy in front of it), each subscribed."""
    webs = [RelayProcess(redis_url=(through or [url] * n)[i]) for i in range(n)]
    try:
        for web in webs:
            web.start()
        for web in webs:
            await web.wait_ready()
        await wait_subscribed(url, n)
        yield webs
    finally:
        for web in webs:
            web.stop()


@contextlib.asynccontextmanager
async def relay_app(url: str) -> AsyncIterator[tuple[int, Any]]:
    """A relay app in this process behind Redis: (port, its Redis manager)."""
    ready = create_app(SECRET, redis_url=url, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port:
        yield port, ready.relay.server.manager


def test_room_channels_and_logs_are_one_per_namespace_and_room() -> None:
    pairs = [("/a", "#b"), ("/a#", "b"), ("/chat", "conv-1"), ("/", "/chatconv-1"), ("/chat", "")]
    channels = {room_channel(CHANNEL, ns, room) for ns, room in pairs}
    logs = {room_log(CHANNEL, ns, room) for ns, room in pairs}
    assert len(channels) == len(logs) == len(pairs)
    assert not channels & logs
    assert CHANNEL not in channels
    assert marker_channel(CHANNEL) not in channels


async def test_each_web_process_hears_only_the_rooms_of_its_browsers(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    async with web_processes(url, 2) as (web1, web2), spying(url) as spy:
        on_web1 = await connected(web1.port, "c1-on-web1")
        on_web2 = await connected(web2.port, "c2-on-web2")
        try:
            assert await join(on_web1, C1, have=[]) == {
                "ok": True,
                "replay": {"blocks": 0, "streams": 0, "missing": []},
            }
            assert (await join(on_web2, C2, have=[]))["ok"] is True
            assert await numsub(url, rooms_channel(C1), rooms_channel(C2)) == [1, 1]
            other = "00f067aa0ba902b8"  # C2's call
            async with worker(web1.port) as w:
                for seq in range(1, 21):
                    await w.call("kx_blocks", frame(C1, [block(seq)]), namespace=NS)
                    await w.call("kx_blocks", frame(C2, [block(seq, call_id=other)]), namespace=NS)
                await w.call("kx_blocks", frame(C1, [block(21, state="done")]), namespace=NS)
                done = [block(21, state="done", call_id=other)]
                await w.call("kx_blocks", frame(C2, done), namespace=NS)
                await on_web1.wait_for(lambda b: len(b) >= 21)
                await on_web2.wait_for(lambda b: len(b) >= 21)
            await barrier(on_web1, web1.port)
            await barrier(on_web2, web2.port)
            assert seqs(on_web1.blocks) == seqs(on_web2.blocks) == list(range(1, 22))
            assert {b["callId"] for b in on_web2.blocks} == {other}
            await wait_until(lambda: len(spy.emits()) >= 42, 10)
            # Each room's blocks went on its own channel, none on the channel every web
            # process hears; the room channel C2 has only web2 as subscriber, so web2 never
            # received a block of C1 (and web1 only its own, which it skips).
            assert sorted(set(spy.emits())) == [(rooms_channel(C1), C1), (rooms_channel(C2), C2)]
            assert len(spy.emits()) == 42
            # Leaving unsubscribes: nobody hears C2 any more.
            await on_web2.client.call(
                "leave_conversation", {"conversationId": C2}, namespace=NS, timeout=CALL_TIMEOUT
            )
            await wait_numsub(url, rooms_channel(C2), 0)
            assert (await numsub(url, rooms_channel(C1)))[0] == 1
        finally:
            await on_web1.close()
            await on_web2.close()
        await wait_numsub(url, rooms_channel(C1), 0)  # the last browser went: unsubscribed


async def test_a_browser_on_a_web_process_that_never_heard_the_room_gets_the_whole_pane(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    async with web_processes(url, 2) as (web1, web2):
        first = await connected(web1.port, "first-on-web1")
        browsers = [first]
        try:
            await join(first, C1, have=[])
            async with worker(web1.port) as w:
                await w.call("kx_blocks", frame(C1, [block(s) for s in range(1, 7)]), namespace=NS)
                await first.wait_for(lambda b: len(b) >= 6)
                second = await connected(web2.port, "second-on-web2")
                browsers.append(second)
                ack = await join(second, C1, have=[])
                assert ack == {"ok": True, "replay": {"blocks": 6, "streams": 1, "missing": []}}
                assert seqs(second.blocks) == [1, 2, 3, 4, 5, 6]  # before the acknowledgement
                live = [block(7), block(8), block(9, state="done")]
                await w.call("kx_blocks", frame(C1, live), namespace=NS)
                for browser, port in ((first, web1.port), (second, web2.port)):
                    await browser.wait_for(lambda b: len(b) >= 9)
                    await barrier(browser, port)
            assert second.blocks == first.blocks  # the whole pane, in order, once
            # A reload on web2 with its cursor: only what it lacks (nothing), from memory.
            ack = await join(second, C1, have=second.have())
            assert ack["replay"] == {"blocks": 0, "streams": 0, "missing": []}
        finally:
            for browser in browsers:
                await browser.close()


async def test_a_redis_worker_publishing_to_a_room_nobody_watches_yet_is_caught_up_later(
    redis_server: RedisServer,
) -> None:
    """The write-only path: blocks of a room no browser watches reach the room's log (and
    count as delivered while web processes listen); a browser that joins later on any web
    process gets them, then the live ones."""
    url = redis_server.url
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    async with web_processes(url, 2) as (_, web2):
        emitter = RedisEmitter(url, hub=hub, heartbeat_interval=None)
        late = await connected(web2.port, "late-on-web2")
        try:
            async with emitter:
                with in_call():
                    hub.publish_chat_event({"eventId": "00f067aa0ba902b7"})
                    for i in range(5):
                        hub.publish(f"step {i}")
                assert await emitter.flush(10)
                assert hub.stats()["delivered"] == 5  # the blocks (chat events are not counted)
                assert emitter.counts["no_listener"] == 0
                ack = await join(late, "conv-1", have=[])
                assert ack["replay"]["blocks"] == 5
                with in_call():
                    hub.publish("the answer", state="done")
                await late.wait_for(lambda b: len(b) >= 6)
            await barrier(late, web2.port)
            texts = [b["envelope"]["payload"]["text"] for b in late.blocks]
            assert texts == [*(f"step {i}" for i in range(5)), "the answer"]
        finally:
            await late.close()


async def test_a_new_worker_routes_from_its_very_first_block(redis_server: RedisServer) -> None:
    """docs/operations.md: a new worker looks who listens before its first publish, so with
    no web process yet, or only web processes that route, its first block already goes on
    the room's channel and into the room's log."""
    from redis import asyncio as aioredis

    url = redis_server.url
    async with spying(url) as spy:
        for webs in (0, 1):
            async with web_processes(url, webs):
                hub = StreamHub(max_running_per_second=None, tap=Tap())
                async with RedisEmitter(url, hub=hub, heartbeat_interval=None) as emitter:
                    with in_call():
                        hub.publish(f"the first block, {webs} web processes listening")
                    await emitter.flush(10)
                await wait_until(lambda n=webs: len(spy.emits()) > n, 20, "nothing published")
        assert spy.emits() == [(rooms_channel(C1), C1)] * 2
    client = aioredis.Redis.from_url(url)
    try:
        assert await client.xlen(room_log(CHANNEL, NS, C1)) == 2
    finally:
        await client.aclose()


async def test_blocks_published_while_browsers_join_reach_each_exactly_once(
    redis_server: RedisServer,
) -> None:
    """A worker floods the room through web1 while browsers join on web2 (which first has to
    subscribe and read the room's log): every browser ends with every seq once, in order."""
    url = redis_server.url
    total = 400
    async with web_processes(url, 2) as (web1, web2):
        joined: list[Browser] = []
        try:
            async with worker(web1.port) as w:

                async def flood() -> None:
                    for start in range(1, total + 1, 4):
                        blocks = [block(s) for s in range(start, min(start + 4, total + 1))]
                        await w.call("kx_blocks", frame(C1, blocks), namespace=NS)

                flooding = asyncio.get_running_loop().create_task(flood())
                for i in range(4):
                    browser = await connected(web2.port, f"joins-{i}")
                    joined.append(browser)
                    assert (await join(browser, C1, have=[]))["ok"] is True
                    # Let the whole join take place with the room unsubscribed anew each
                    # time: the first browsers leave the room again.
                    if i < 2:
                        await browser.client.call(
                            "leave_conversation",
                            {"conversationId": C1},
                            namespace=NS,
                            timeout=CALL_TIMEOUT,
                        )
                        joined.pop()
                        await browser.close()
                await flooding
                await w.call("kx_blocks", frame(C1, [block(total + 1, state="done")]), namespace=NS)
            for browser in joined:
                await browser.wait_for(lambda b: any(x["state"] == "done" for x in b), 30)
                await barrier(browser, web2.port)
                assert seqs(browser.blocks) == list(range(1, total + 2)), browser.name
        finally:
            for browser in joined:
                await browser.close()


async def test_an_older_web_process_on_the_channel_gets_every_emit_until_it_is_gone(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A rolling upgrade: a web process of an older version (python-socketio's own Redis
    manager: it hears the channel only) keeps its browsers served — publishers see it and
    route nothing, saying so at WARNING — and once it is gone, emits go on room channels."""
    caplog.set_level(logging.WARNING, logger="kernel_ext.redis")
    url = redis_server.url
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    old_server = socketio.AsyncServer(
        async_mode="asgi", client_manager=socketio.AsyncRedisManager(url)
    )
    mount_relay(old_server, SECRET, authorize_join=allow_all)
    async with (
        web_processes(url, 1) as (new,),
        serve_asgi(socketio.ASGIApp(old_server)) as old_port,
        spying(url) as spy,
    ):
        on_new = await connected(new.port, "on-new")
        on_old = await connected(old_port, "on-old")
        try:
            await join(on_new, C1, have=[])
            await join(on_old, C1)
            await wait_subscribed(url, 2)
            async with RedisEmitter(url, hub=hub, heartbeat_interval=None) as emitter:
                with in_call():
                    for i in range(5):
                        hub.publish(f"step {i}")
                await on_new.wait_for(lambda b: len(b) >= 5)
                await on_old.wait_for(lambda b: len(b) >= 5)
                assert {room for _, room in spy.emits()} == {C1}
                assert {channel for channel, _ in spy.emits()} == {CHANNEL}
                assert any("do not route" in r.getMessage() for r in caplog.records)
                # The old web process goes (its browser first, then its subscription).
                await on_old.close()
                await old_server.manager.redis.aclose()
                old_server.manager.thread.cancel()
                await wait_subscribed_exactly(url, 1)
                n = 5

                async def routed_again() -> bool:
                    nonlocal n
                    with in_call():
                        hub.publish(f"step {n}")
                    n += 1
                    await emitter.flush(5)
                    return (rooms_channel(C1), C1) in spy.emits()

                await wait_until(routed_again, 20, "emits never went on the room channel")
                with in_call():
                    hub.publish("the answer", state="done")
                await on_new.wait_for(lambda b: any(x["state"] == "done" for x in b))
            await barrier(on_new, new.port)
            assert seqs(on_new.blocks, on_new.blocks[0]["taskId"]) == list(range(1, n + 2))
            assert any("every web process" in r.getMessage() for r in caplog.records)
        finally:
            await on_new.close()
            await on_old.close()


async def wait_subscribed_exactly(url: str, n: int) -> None:
    async def reached() -> bool:
        return (await numsub(url, CHANNEL))[0] == n

    await wait_until(reached, 20, f"not exactly {n} web processes on the channel", interval=0.05)


async def test_a_web_process_that_could_not_hear_redis_catches_its_browsers_up_after(
    redis_server: RedisServer,
) -> None:
    """web2 reaches Redis through a network that drops: what was published meanwhile (into
    the room's log, Redis kept running) reaches web2's browser once web2 hears Redis again,
    each block once, then the live ones."""
    url = redis_server.url
    async with flaky_network(redis_server.port) as net:
        flaky = f"redis://127.0.0.1:{net.port}/0"
        async with web_processes(url, 2, through=[url, flaky]) as (web1, web2):
            await run_the_outage(url, net, web1, web2)


async def run_the_outage(url: str, net: Any, web1: RelayProcess, web2: RelayProcess) -> None:
    browsers: list[Browser] = []
    try:
        on_web1 = await connected(web1.port, "on-web1")
        on_web2 = await connected(web2.port, "on-web2")
        browsers += [on_web1, on_web2]
        await join(on_web1, C1, have=[])
        await join(on_web2, C1, have=[])
        await wait_numsub(url, rooms_channel(C1), 2)
        async with worker(web1.port) as w:
            await w.call("kx_blocks", frame(C1, [block(1), block(2)]), namespace=NS)
            await on_web2.wait_for(lambda b: len(b) >= 2)
            net.offline()
            await wait_numsub(url, rooms_channel(C1), 1)  # Redis saw web2 go
            await w.call("kx_blocks", frame(C1, [block(3), block(4)]), namespace=NS)
            await on_web1.wait_for(lambda b: len(b) >= 4)
            net.online()
            await on_web2.wait_for(lambda b: len(b) >= 4, 30)  # from the room's log
            await wait_numsub(url, rooms_channel(C1), 2)
            await w.call("kx_blocks", frame(C1, [block(5, state="done")]), namespace=NS)
            await on_web2.wait_for(lambda b: len(b) >= 5)
        await barrier(on_web2, web2.port)
        assert seqs(on_web2.blocks) == [1, 2, 3, 4, 5]
    finally:
        for browser in browsers:
            await browser.close()


async def test_other_emits_of_the_application_reach_the_browsers_of_every_web_process(
    redis_server: RedisServer,
) -> None:
    """An emit to the whole namespace, and an emit to a room from python-socketio's own
    write-only manager (the channel, unrouted), reach the browsers on both web processes."""
    url = redis_server.url
    async with web_processes(url, 2) as (web1, web2):
        a = await connected(web1.port, "a")
        b = await connected(web2.port, "b")
        try:
            await join(a, C1, have=[])
            await join(b, C1, have=[])
            external = socketio.AsyncRedisManager(url, write_only=True)
            await external.emit("chat_event", {"to": "everyone"}, namespace=NS)
            await external.emit("chat_event", {"to": "room"}, namespace=NS, room=C1)
            for browser in (a, b):
                await wait_until(lambda br=browser: len(br.chat_events) >= 2, 10)
                assert browser.chat_events == [{"to": "everyone"}, {"to": "room"}]
            await external.redis.aclose()
        finally:
            await a.close()
            await b.close()


async def test_a_rooms_log_keeps_its_last_blocks_for_the_idle_time(
    redis_server: RedisServer,
) -> None:
    """The log keeps about its bound (Redis trims whole nodes of a stream: at least the
    bound, at most one node more) and expires the idle time after the last block."""
    from redis import asyncio as aioredis

    url = redis_server.url
    hub = StreamHub(max_running_per_second=None, max_queue=4 * LOG_MAX_BLOCKS, tap=Tap())
    async with web_processes(url, 1):
        async with RedisEmitter(url, hub=hub, heartbeat_interval=None) as emitter:
            with in_call():
                for i in range(LOG_MAX_BLOCKS + 300):
                    hub.publish(f"step {i}")
            assert await emitter.flush(30)
        client = aioredis.Redis.from_url(url)
        try:
            key = room_log(CHANNEL, NS, "conv-1")
            assert LOG_MAX_BLOCKS <= await client.xlen(key) <= LOG_MAX_BLOCKS + 100
            ttl = await client.pttl(key)
            assert 0 < ttl <= REPLAY_IDLE * 1000
            last = await client.xrevrange(key, count=1)
            assert json.loads(last[0][1][b"b"])["envelope"]["payload"]["text"] == (
                f"step {LOG_MAX_BLOCKS + 299}"
            )
        finally:
            await client.aclose()


async def test_a_relay_in_this_process_subscribes_for_a_joining_browser_before_it_enters(
    redis_server: RedisServer,
) -> None:
    """The join's acknowledgement comes after the room's subscription is confirmed: the
    room channel has the web process as subscriber as soon as the browser joined."""
    url = redis_server.url
    async with relay_app(url) as (port, manager):
        browser = await connected(port)  # the manager starts listening now (no lifespan)
        try:
            assert (await join(browser, C2, have=[]))["ok"] is True
            assert (await numsub(url, rooms_channel(C2)))[0] == 1
            assert manager.counts.get("redis_join_unsubscribed", 0) == 0
        finally:
            await browser.close()


async def test_an_emit_to_a_list_of_rooms_stays_on_the_channel_and_reaches_each_browser_once(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    ready = create_app(SECRET, redis_url=url, authorize_join=allow_all)
    async with (
        web_processes(url, 1) as (other,),
        serve_asgi(ready.app) as port,
        spying(url) as spy,
    ):
        here = await connected(port, "c1-here")
        there = [await connected(other.port, "c1-there"), await connected(other.port, "c2-there")]
        try:
            await join(here, C1, have=[])
            await join(there[0], C1, have=[])
            await join(there[1], C2, have=[])
            await ready.sio.emit("chat_event", {"to": "both"}, room=[C1, C2], namespace=NS)
            for browser in (here, *there):
                await wait_until(lambda br=browser: len(br.chat_events) >= 1, 10)
            await barrier(here, port)
            for browser, port_ in ((there[0], other.port), (there[1], other.port)):
                await barrier(browser, port_)
            assert [b.chat_events for b in (here, *there)] == [[{"to": "both"}]] * 3
            assert spy.emits("chat_event") == [(CHANNEL, [C1, C2])]
        finally:
            for browser in (here, *there):
                await browser.close()


async def test_routing_off_on_either_side_keeps_every_emit_on_the_channel(
    redis_server: RedisServer,
) -> None:
    """``RedisEmitter(routing=False)`` publishes on the channel; a web process whose manager
    has ``routing=False`` counts as one that does not route, so publishers route nothing."""
    url = redis_server.url
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    unrouted = socketio.AsyncServer(
        async_mode="asgi", client_manager=RelayRedisManager(url, routing=False)
    )
    mount_relay(unrouted, SECRET, authorize_join=allow_all)
    async with web_processes(url, 1) as (routed,), spying(url) as spy:
        on_routed = await connected(routed.port, "on-routed")
        try:
            await join(on_routed, "conv-1", have=[])
            async with RedisEmitter(url, hub=hub, heartbeat_interval=None, routing=False):
                with in_call():
                    hub.publish("step 0")
                await on_routed.wait_for(lambda b: len(b) >= 1)
            assert spy.emits() == [(CHANNEL, "conv-1")]
            async with serve_asgi(socketio.ASGIApp(unrouted)) as port:
                on_unrouted = await connected(port, "on-unrouted")
                try:
                    await join(on_unrouted, "conv-1", have=[])
                    await wait_subscribed_exactly(url, 2)
                    async with RedisEmitter(url, hub=hub, heartbeat_interval=None):
                        with in_call():
                            hub.publish("step 1")
                        await on_unrouted.wait_for(lambda b: len(b) >= 1)
                        await on_routed.wait_for(lambda b: len(b) >= 2)
                    assert spy.emits() == [(CHANNEL, "conv-1")] * 2
                finally:
                    await on_unrouted.close()
        finally:
            await on_routed.close()


async def test_a_rooms_log_is_read_as_the_memory_would_hold_it(
    redis_server: RedisServer,
) -> None:
    """A web process reading a room's log takes what its memory would still hold had it
    heard the blocks: not a stream whose terminal is older than ``replay_hold``, a live
    stream whatever its age below ``replay_idle``."""
    from redis import asyncio as aioredis

    url = redis_server.url
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    ready = create_app(SECRET, redis_url=url, authorize_join=allow_all, replay_hold=0.3)
    client = aioredis.Redis.from_url(url)
    async with serve_asgi(ready.app) as port:
        browser = await connected(port)  # the web process listens from now on
        try:
            await wait_subscribed(url, 1)
            async with RedisEmitter(url, hub=hub, heartbeat_interval=None) as emitter:
                with in_call("00f067aa0ba902b1"):
                    hub.publish("an old answer", state="done")
                with in_call("00f067aa0ba902b2"):
                    hub.publish("still working")
                assert await emitter.flush(10)
            key = room_log(CHANNEL, NS, "conv-1")
            first_id = (await client.xrange(key, count=1))[0][0]
            added = int(first_id.split(b"-")[0])

            async def older_than_the_hold() -> bool:
                seconds, micros = await client.time()
                return seconds * 1000 + micros // 1000 - added > 300

            await wait_until(older_than_the_hold, 10, "Redis' clock did not move", interval=0.05)
            ack = await join(browser, "conv-1", have=[])
            assert ack["replay"]["blocks"] == 1
            assert [b["envelope"]["payload"]["text"] for b in browser.blocks] == ["still working"]
        finally:
            await browser.close()
            await client.aclose()


async def test_a_join_while_redis_is_down_goes_on_unsubscribed_and_is_counted(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    async with relay_app(url) as (port, manager):
        browser = await connected(port)
        try:
            await wait_subscribed(url, 1)
            redis_server.stop()
            await wait_until(lambda: manager.redis_state == "unreachable", 20)
            assert (await join(browser, C1, have=[]))["ok"] is True
            assert manager.counts["redis_join_unsubscribed"] == 1
        finally:
            await browser.close()


async def test_a_rooms_log_that_is_not_a_log_is_counted_and_spoils_nothing_else(
    redis_server: RedisServer,
) -> None:
    """Hostile bytes on Redis: the room's log key holds a string. A joining browser is
    served without it (counted ``redis_log_unread``), and blocks still reach it live (the
    log's append fails alone, not the publish beside it)."""
    from redis import asyncio as aioredis

    url = redis_server.url
    client = aioredis.Redis.from_url(url)
    await client.set(room_log(CHANNEL, NS, C1), b"\\xff not a stream")
    await client.aclose()
    async with relay_app(url) as (port, manager), worker(port) as w:
        browser = await connected(port)
        other = await connected(port, "other")
        try:
            await join(other, C1, have=[])  # web process subscribed to the room
            assert manager.counts["redis_log_unread"] == 1
            await w.call("kx_blocks", frame(C1, [block(1), block(2, state="done")]), namespace=NS)
            await other.wait_for(lambda b: len(b) >= 2)
            assert (await join(browser, C1, have=[]))["replay"]["blocks"] == 2  # from memory
            async with RedisEmitter(url, hub=StreamHub(tap=Tap()), heartbeat_interval=None) as e:
                hub = e.hub
                with in_call("00f067aa0ba902b9"):
                    hub.publish("via redis", state="done")
                assert await e.flush(10)
            await browser.wait_for(lambda b: len(b) >= 3)
            assert e.healthy
        finally:
            await browser.close()
            await other.close()
