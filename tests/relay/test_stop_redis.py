"""The relay's side of a browser's ``stop_call`` behind a real redis-server (issue 35, phase
2b): a write-only worker (``RedisEmitter``, a real call running under the wrapped runtime)
is asked over its stop channel, whichever web process the browser is on; Redis's receiver
count decides ``stopping`` or ``unreachable``; an outage is ``unreachable``, counted; a
loopback worker connected to another web process is asked through that one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from support.network import RedisServer
from support.redis_helpers import wait_subscribed
from support.relay_helpers import Browser, RelayProcess, barrier, emitter_for, relay_server
from support.stop_calls import ask_stop, is_stopped, running_call, stop, stopped_terminals
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import RedisEmitter
from kernel_ext.redis.routing import relay_stop_channel, stop_channel
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.redis]

ROOM = "conv-stop-redis"


def new_hub() -> StreamHub:
    return StreamHub(max_running_per_second=None, tap=Tap())


async def listening_for_stops(redis_url: str, worker: str) -> int:
    """How many subscribers the worker's stop channel has on the Redis at ``redis_url``."""
    from redis import asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        result = await client.pubsub_numsub(stop_channel("socketio", worker))
        return int(result[0][1]) if result else 0
    finally:
        await client.aclose()


async def wait_listening(redis_url: str, emitter: RedisEmitter) -> None:
    async def listening() -> bool:
        return await listening_for_stops(redis_url, emitter.worker_id) >= 1

    await wait_until(listening, 20.0, "the worker did not subscribe to its stop channel")


async def browser_on(port: int, name: str) -> Browser:
    browser = Browser(name)
    await browser.connect(port)
    assert await browser.join(ROOM) == {"ok": True}
    return browser


async def test_a_browser_on_another_web_process_stops_a_write_only_workers_call(
    redis_server: RedisServer,
) -> None:
    hub = new_hub()
    webs = [RelayProcess(redis_url=redis_server.url) for _ in range(2)]
    made: list[Browser] = []
    try:
        for web in webs:
            web.start()
        for web in webs:
            await web.wait_ready()
        made.append(await browser_on(webs[0].port, "on-web1"))
        made.append(await browser_on(webs[1].port, "on-web2"))
        await wait_subscribed(redis_server.url, 2)
        async with RedisEmitter(redis_server.url, hub=hub) as emitter:
            await wait_listening(redis_server.url, emitter)
            async with running_call(hub, ROOM) as call, running_call(hub, ROOM) as other:
                for b in made:
                    await b.wait_for(
                        lambda x: {y["callId"] for y in x} >= {call.call_id, other.call_id}
                    )
                ack = await ask_stop(made[1], stop(ROOM, call.call_id))
                assert ack == {"answer": "stopping"}
                result = await asyncio.wait_for(call.task, CALL_TIMEOUT)
                assert result.startswith("The user stopped this tool call")
                for b in made:
                    await b.wait_for(lambda x: bool(stopped_terminals(x, call.call_id)))
                assert await ask_stop(made[1], stop(ROOM, call.call_id)) == {
                    "answer": "already_ended"
                }
                assert not other.task.done()
                assert await emitter.flush(10)
        for b, web in zip(made, webs, strict=True):
            await barrier(b, web.port)
            ends = stopped_terminals(b.blocks, call.call_id)
            assert len(ends) == 1, ends
            assert is_stopped(ends[0])
    finally:
        for b in made:
            await b.close()
        for web in webs:
            web.stop()


async def test_a_worker_not_listening_or_redis_down_is_unreachable_and_counted(
    redis_server: RedisServer,
) -> None:
    hub = new_hub()
    async with relay_server(redis_url=redis_server.url, stop_timeout=2.0) as (port, relay):
        browser = await browser_on(port, "browser")
        try:
            await wait_subscribed(redis_server.url, 1)
            emitter = RedisEmitter(redis_server.url, hub=hub)
            await emitter.start()
            await wait_listening(redis_server.url, emitter)
            async with running_call(hub, ROOM) as call:
                await browser.wait_for(lambda x: any(y["callId"] == call.call_id for y in x))
                await emitter.stop()  # its subscription goes; the relay still owns its stream
                ack = await ask_stop(browser, stop(ROOM, call.call_id))
                assert ack["answer"] == "unreachable"
                assert not call.task.done()
                redis_server.stop()  # Redis goes down: the publish fails
                ack = await ask_stop(browser, stop(ROOM, call.call_id))
                assert ack["answer"] == "unreachable"
                assert not call.task.done()
        finally:
            await browser.close()
            redis_server.start()
            await relay.aclose()
        stats = relay.stats()
        assert stats["stop_publish_failed"] == 1
        assert stats["stops_unreachable"] == 2


async def test_a_browser_on_another_web_process_stops_a_loopback_workers_call(
    redis_server: RedisServer,
) -> None:
    hub = new_hub()
    webs = [RelayProcess(redis_url=redis_server.url) for _ in range(2)]
    made: list[Browser] = []
    try:
        for web in webs:
            web.start()
        for web in webs:
            await web.wait_ready()
        made.append(await browser_on(webs[0].port, "on-web1"))
        made.append(await browser_on(webs[1].port, "on-web2"))
        await wait_subscribed(redis_server.url, 2)
        emitter = emitter_for(webs[0].port, hub)  # connected to web1 only
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            await wait_until(forwarding_listeners(redis_server.url, 1), 20.0, "web1 listens")
            async with running_call(hub, ROOM) as call, running_call(hub, ROOM) as other:
                for b in made:
                    await b.wait_for(
                        lambda x: {y["callId"] for y in x} >= {call.call_id, other.call_id}
                    )
                ack = await ask_stop(made[1], stop(ROOM, call.call_id))  # from web2
                assert ack == {"answer": "stopping"}
                result = await asyncio.wait_for(call.task, CALL_TIMEOUT)
                assert result.startswith("The user stopped this tool call")
                for b in made:
                    await b.wait_for(lambda x: bool(stopped_terminals(x, call.call_id)))
                assert not other.task.done()
                assert await emitter.flush(10)
                # The worker is gone from web1 (its grace runs): no one can answer for it.
                await emitter.stop()
                ack = await ask_stop(made[1], stop(ROOM, other.call_id))
                assert ack["answer"] == "unreachable"
                assert not other.task.done()
        for b, web in zip(made, webs, strict=True):
            await barrier(b, web.port)
            ends = stopped_terminals(b.blocks, call.call_id)
            assert len(ends) == 1, ends
            assert is_stopped(ends[0])
    finally:
        for b in made:
            await b.close()
        for web in webs:
            web.stop()


def forwarding_listeners(redis_url: str, n: int) -> Callable[[], Awaitable[bool]]:
    """Whether at least ``n`` web processes listen for forwarded stops."""

    async def listening() -> bool:
        from redis import asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        try:
            result = await client.pubsub_numsub(relay_stop_channel("socketio"))
            return bool(result) and int(result[0][1]) >= n
        finally:
            await client.aclose()

    return listening


async def test_a_write_only_worker_listens_for_stops_again_after_a_redis_outage(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    hub = new_hub()
    web = RelayProcess(redis_url=redis_server.url)
    browser: Browser | None = None
    try:
        web.start()
        await web.wait_ready()
        browser = await browser_on(web.port, "browser")
        await wait_subscribed(redis_server.url, 1)
        async with RedisEmitter(redis_server.url, hub=hub, retry_interval=0.1) as emitter:
            await wait_listening(redis_server.url, emitter)
            redis_server.stop()
            redis_server.start()  # same port, nothing subscribed any more
            await wait_subscribed(redis_server.url, 1)  # the web process is back
            await wait_listening(redis_server.url, emitter)  # and the worker's stop channel
            await wait_until(lambda: emitter.healthy)
            async with running_call(hub, ROOM) as call:
                await browser.wait_for(lambda x: any(y["callId"] == call.call_id for y in x))
                ack = await ask_stop(browser, stop(ROOM, call.call_id))
                assert ack == {"answer": "stopping"}
                await asyncio.wait_for(call.task, CALL_TIMEOUT)
                await browser.wait_for(lambda x: bool(stopped_terminals(x, call.call_id)))
        warnings = [
            r
            for r in caplog.records
            if "not listening for stops on Redis" in r.getMessage() and r.levelname == "WARNING"
        ]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
    finally:
        if browser is not None:
            await browser.close()
        web.stop()
