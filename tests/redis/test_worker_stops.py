"""A write-only worker's side of a stop on Redis (``kernel_ext.redis.stops.WorkerStops``,
run by a real ``RedisEmitter`` on a real redis-server): the answer of ``stop_call`` goes to
the reply channel a request names; a request without ``from`` and ``id`` (an older web
process) still stops its call, unanswered; a request whose ``from`` or ``id`` is not one
gets no answer and breaks nothing; an answer Redis does not take is counted and logged."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.network import RedisServer
from support.redis_helpers import wait_channel_subscribers
from support.stop_calls import running_call
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import RedisEmitter
from kernel_ext.redis.routing import stop_channel, stop_reply_channel
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.redis, pytest.mark.timeout(120)]

ROOM = "conv-worker-stops"
UNKNOWN_CALL = "0123456789abcdef"


def new_hub() -> StreamHub:
    return StreamHub(max_running_per_second=None, tap=Tap())


@contextlib.asynccontextmanager
async def listening_worker(url: str, hub: StreamHub) -> AsyncIterator[RedisEmitter]:
    """A ``RedisEmitter`` on ``url``, healthy and subscribed to its stop channel."""
    async with RedisEmitter(url, hub=hub) as emitter:
        await wait_channel_subscribers(url, stop_channel("socketio", emitter.worker_id))
        await wait_until(lambda: emitter.healthy)
        yield emitter


@contextlib.asynccontextmanager
async def replies_heard(url: str) -> AsyncIterator[Any]:
    """A raw Redis subscription to every web process's reply channel; its pubsub."""
    from redis import asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.psubscribe(stop_reply_channel("socketio", "*"))
        yield pubsub
    finally:
        await pubsub.aclose()
        await client.aclose()


async def replies_until(pubsub: Any, channel: str) -> list[tuple[str, Any]]:
    """Every reply heard, up to and including the first one on ``channel`` (a deadline)."""
    heard: list[tuple[str, Any]] = []

    async def collect() -> None:
        while not heard or heard[-1][0] != channel:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                heard.append((message["channel"].decode(), json.loads(message["data"])))

    await asyncio.wait_for(collect(), CALL_TIMEOUT)
    return heard


async def test_the_workers_answer_goes_to_the_channel_the_request_names_and_only_then(
    redis_server: RedisServer,
) -> None:
    from redis import asyncio as aioredis

    hub = new_hub()
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        async with (
            listening_worker(redis_server.url, hub) as emitter,
            replies_heard(redis_server.url) as pubsub,
            running_call(hub, ROOM) as call,
            running_call(hub, ROOM) as other,
        ):
            asks = stop_channel("socketio", emitter.worker_id)
            # A web process from before the replies: the call stops, nothing is answered.
            assert await raw.publish(asks, json.dumps({"v": 1, "callId": call.call_id})) == 1
            result = await asyncio.wait_for(call.task, CALL_TIMEOUT)
            assert result.startswith("The user stopped this tool call")
            # No reply address, or one that is not a web process's id: no answer, and the
            # call is stopped all the same when the rest is a stop request.
            unanswered: list[Any] = [
                {"v": 1, "callId": other.call_id, "from": "web#kx-room#1:/conv", "id": 1},
                {"v": 1, "callId": UNKNOWN_CALL, "from": "a" * 129, "id": 2},
                {"v": 1, "callId": UNKNOWN_CALL, "from": "", "id": 3},
                {"v": 1, "callId": UNKNOWN_CALL, "from": 5, "id": 4},
                {"v": 1, "callId": UNKNOWN_CALL, "from": "web-\ud800", "id": 5},
                {"v": 1, "callId": UNKNOWN_CALL, "from": "web-a", "id": True},
                {"v": 1, "callId": UNKNOWN_CALL, "from": "web-a", "id": "6"},
                {"v": 1, "callId": UNKNOWN_CALL, "from": "web-a", "id": 7.0},
                {"v": 1, "callId": UNKNOWN_CALL, "from": "web-a"},
                {"v": 1, "callId": UNKNOWN_CALL, "id": 8},
                [1, 2],
            ]
            for request in unanswered:
                await raw.publish(asks, json.dumps(request))
            await raw.publish(asks, b"\xff not json")
            await raw.publish(asks, "[" * 100_000)  # nested deeper than the parser goes
            result = await asyncio.wait_for(other.task, CALL_TIMEOUT)
            assert result.startswith("The user stopped this tool call")
            # Then a request with a reply address: its answer, and nothing before it.
            probe = {"v": 1, "callId": UNKNOWN_CALL, "from": "web-b", "id": 9}
            await raw.publish(asks, json.dumps(probe))
            to = stop_reply_channel("socketio", "web-b")
            assert await replies_until(pubsub, to) == [(to, {"id": 9, "answer": "unknown"})]
            # What stop_call says, whatever it is: refused for a malformed request.
            await raw.publish(asks, json.dumps({"v": 2, "from": "web-b", "id": 10}))
            assert await replies_until(pubsub, to) == [(to, {"id": 10, "answer": "refused"})]
            await raw.publish(asks, json.dumps({"v": 1, **probe, "callId": call.call_id}))
            assert await replies_until(pubsub, to) == [(to, {"id": 9, "answer": "already_ended"})]
            assert emitter.counts["stop_reply_failed"] == 0
    finally:
        await raw.aclose()


async def test_an_answer_redis_does_not_take_is_counted_and_logged_on_the_worker(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    from redis import asyncio as aioredis

    # A real refusal: the worker's Redis user may use its own channels but not the web
    # processes' reply channels (Redis ACLs), so its answer's publish fails (NOPERM).
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        await raw.execute_command(
            "ACL", "SETUSER", "worker", "on", ">worker-password", "~*", "+@all",
            "&socketio", "&socketio#kx-routed", "&socketio#kx-room#*", "&socketio#kx-stop#*",
        )  # fmt: skip
    except Exception:
        await raw.aclose()
        raise
    url = redis_server.url.replace("redis://", "redis://worker:worker-password@", 1)
    try:
        async with listening_worker(url, new_hub()) as emitter:
            asks = stop_channel("socketio", emitter.worker_id)
            for key in (1, 2, 3):
                request = {"v": 1, "callId": UNKNOWN_CALL, "from": "web-a", "id": key}
                assert await raw.publish(asks, json.dumps(request)) == 1
            await wait_until(
                lambda: emitter.counts["stop_reply_failed"] == 3,
                CALL_TIMEOUT,
                lambda: f"counts: {dict(emitter.counts)}",
            )
            assert emitter.healthy  # the stop's answer is not the sender's health
    finally:
        await raw.aclose()
    logged = [r for r in caplog.records if "a stop's answer was not published" in r.getMessage()]
    assert len(logged) == 2, [r.getMessage() for r in logged]  # the 1st and 2nd of 3
