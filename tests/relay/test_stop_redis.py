"""The relay's side of a browser's ``stop_call`` behind a real redis-server (issue 35, phase
2b): a write-only worker (``RedisEmitter``, a real call running under the wrapped runtime)
is asked over its stop channel, whichever web process the browser is on, and its own answer
comes back on the web process's reply channel (``already_ended`` when the call ended first,
though its terminal had not reached the relay); nothing listening, no answer in time or an
outage is ``unreachable``, counted; hostile replies are ignored; a loopback worker connected
to another web process is asked through that one."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.network import RedisServer
from support.redis_helpers import wait_channel_subscribers, wait_subscribed
from support.relay_helpers import Browser, RelayProcess, barrier, emitter_for, relay_server
from support.stop_calls import (
    RunningCall,
    ask_stop,
    gated_call,
    is_stopped,
    running_call,
    stop,
    stopped_terminals,
)
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import RedisEmitter
from kernel_ext.redis.routing import relay_stop_channel, stop_channel, stop_reply_channel
from kernel_ext.relay import ChatRelay
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.redis]

ROOM = "conv-stop-redis"


def new_hub() -> StreamHub:
    return StreamHub(max_running_per_second=None, tap=Tap())


async def wait_listening(redis_url: str, emitter: RedisEmitter) -> None:
    """Return once the worker subscribes to its stop channel."""
    await wait_channel_subscribers(redis_url, stop_channel("socketio", emitter.worker_id))


async def browser_on(port: int, name: str) -> Browser:
    browser = Browser(name)
    await browser.connect(port)
    assert await browser.join(ROOM) == {"ok": True}
    return browser


@contextlib.asynccontextmanager
async def a_call_whose_worker_stopped(
    redis_url: str, **options: Any
) -> AsyncIterator[tuple[ChatRelay, Browser, RunningCall, str]]:
    """A relay on ``redis_url`` (``create_app`` ``options``), a browser in the room, and a
    running call whose ``RedisEmitter`` stopped once the browser had its running block: the
    relay still takes that worker (its id, yielded) for the call's owner, within its
    grace. The relay, the browser and the call are closed at the end."""
    hub = new_hub()
    async with relay_server(redis_url=redis_url, **options) as (port, relay):
        browser = await browser_on(port, "browser")
        try:
            await wait_subscribed(redis_url, 1)
            emitter = RedisEmitter(redis_url, hub=hub)
            await emitter.start()
            await wait_listening(redis_url, emitter)
            async with running_call(hub, ROOM) as call:
                await browser.wait_for(lambda x: any(y["callId"] == call.call_id for y in x))
                await emitter.stop()  # its subscription goes; the relay still owns its stream
                yield relay, browser, call, emitter.worker_id
        finally:
            await browser.close()
            await relay.aclose()


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
    async with a_call_whose_worker_stopped(redis_server.url, stop_timeout=2.0) as (
        relay,
        browser,
        call,
        _,
    ):
        ack = await ask_stop(browser, stop(ROOM, call.call_id))
        assert ack["answer"] == "unreachable"
        assert not call.task.done()
        redis_server.stop()  # Redis goes down: the publish fails
        try:
            ack = await ask_stop(browser, stop(ROOM, call.call_id))
            assert ack["answer"] == "unreachable"
            assert not call.task.done()
        finally:
            redis_server.start()
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
            await wait_channel_subscribers(redis_server.url, relay_stop_channel("socketio"))
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


async def test_a_call_that_ended_before_the_stop_came_is_already_ended_in_the_workers_words(
    redis_server: RedisServer,
) -> None:
    # The call ends in the worker while its terminal cannot reach the relay (its sender has
    # stopped), so the relay still takes the call for running and asks its worker id; the
    # worker, back under that id, says what stop_call says: already_ended, not stopping.
    gate = asyncio.Event()
    async with relay_server(redis_url=redis_server.url) as (port, relay):
        browser = await browser_on(port, "browser")
        try:
            await wait_subscribed(redis_server.url, 1)
            hub = new_hub()
            first = RedisEmitter(redis_server.url, hub=hub, worker_id="worker-race")
            await first.start()
            async with gated_call(hub, ROOM, gate) as call:
                await browser.wait_for(lambda x: any(y["callId"] == call.call_id for y in x))
                await first.stop()
                gate.set()
                assert await asyncio.wait_for(call.task, CALL_TIMEOUT) == "done"
            async with RedisEmitter(
                redis_server.url, hub=new_hub(), worker_id="worker-race"
            ) as second:
                await wait_listening(redis_server.url, second)
                ack = await ask_stop(browser, stop(ROOM, call.call_id))
                assert ack == {"answer": "already_ended"}
            await barrier(browser, port)
            assert stopped_terminals(browser.blocks, call.call_id) == []  # the relay saw none
        finally:
            await browser.close()
            await relay.aclose()
        stats = relay.stats()
        assert stats["stops_already_ended"] == 1
        assert stats.get("stops_stopping", 0) == 0


@contextlib.asynccontextmanager
async def hung_worker(redis_url: str, worker: str) -> AsyncIterator[Any]:
    """A fake for a fault: a raw Redis subscription on ``worker``'s stop channel standing
    in for a worker that hears stop requests but never answers (a hung process); its
    pubsub, to read the requests it heard."""
    from redis import asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(stop_channel("socketio", worker))
        await wait_channel_subscribers(redis_url, stop_channel("socketio", worker))
        yield pubsub
    finally:
        await pubsub.aclose()
        await client.aclose()


async def heard(pubsub: Any) -> dict[str, Any]:
    """The next request the fake worker heard (with a deadline)."""

    async def next_message() -> dict[str, Any]:
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                request = json.loads(message["data"])
                assert isinstance(request, dict)
                return request

    return await asyncio.wait_for(next_message(), CALL_TIMEOUT)


async def test_a_write_only_worker_that_never_answers_is_unreachable_and_counted(
    redis_server: RedisServer,
) -> None:
    async with a_call_whose_worker_stopped(redis_server.url, stop_timeout=1.0) as (
        relay,
        browser,
        call,
        worker,
    ):
        async with hung_worker(redis_server.url, worker) as pubsub:
            ack = await ask_stop(browser, stop(ROOM, call.call_id))
            assert ack == {"answer": "unreachable", "reason": "the call's worker did not answer"}
            request = await heard(pubsub)
        host = relay.server.manager.host_id
        assert request == {"v": 1, "callId": call.call_id, "from": host, "id": 1}
        assert not call.task.done()
    stats = relay.stats()
    assert stats["stop_no_answer"] == 1
    assert stats["stops_unreachable"] == 1
    assert stats.get("stop_publish_failed", 0) == 0


async def test_hostile_replies_neither_break_the_relay_nor_answer_a_request(
    redis_server: RedisServer,
) -> None:
    from redis import asyncio as aioredis

    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        async with (
            a_call_whose_worker_stopped(redis_server.url) as (relay, browser, call, worker),
            hung_worker(redis_server.url, worker) as pubsub,
        ):
            asking = asyncio.create_task(ask_stop(browser, stop(ROOM, call.call_id)))
            request = await heard(pubsub)
            to, key = stop_reply_channel("socketio", request["from"]), request["id"]
            hostile: list[Any] = [
                b"not json",
                "[" * 100_000,  # nested deeper than the parser goes
                b"\xff\xfe",
                json.dumps([key, "stopping"]),
                json.dumps({"answer": "stopping"}),
                json.dumps({"id": True, "answer": "stopping"}),
                json.dumps({"id": float(key), "answer": "stopping"}),
                json.dumps({"id": str(key), "answer": "stopping"}),
                json.dumps({"id": key + 1, "answer": "stopping"}),  # no one's
                json.dumps({"id": key, "answer": "yes"}),
                json.dumps({"id": key, "answer": ["stopping"]}),
                json.dumps({"id": key, "answer": None}),
            ]
            for message in hostile:
                await raw.publish(to, message)
            lone = json.dumps({"id": key, "answer": "unknown", "reason": "a \ud800 b"})
            await raw.publish(to, lone)
            await raw.publish(to, json.dumps({"id": key, "answer": "stopping"}))  # late
            assert await asyncio.wait_for(asking, CALL_TIMEOUT) == {"answer": "unknown"}
            # The next request (the next id, answered "no one's" above before it was
            # asked) waits for its own answer.
            asking = asyncio.create_task(ask_stop(browser, stop(ROOM, call.call_id)))
            again = await heard(pubsub)
            assert again["id"] == key + 1
            reply = {"id": key + 1, "answer": "refused", "reason": "r" * 201}
            await raw.publish(to, json.dumps(reply))
            assert await asyncio.wait_for(asking, CALL_TIMEOUT) == {
                "answer": "refused",
                "reason": "r" * 200,  # its first 200 characters
            }
            assert not call.task.done()
    finally:
        await raw.aclose()
    stats = relay.stats()
    assert stats["stops_unknown"] == 1
    assert stats["stops_refused"] == 1
    assert stats.get("stop_no_answer", 0) == 0
