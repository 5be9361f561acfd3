"""A dead worker leaves no pane open forever (issue 13, item 7).

Real processes over 127.0.0.1: the worker is ``tests/support/stream_worker.py`` in a subprocess
(a stream hub and a real sender presenting a worker id), SIGKILLed or SIGSTOPped mid-stream;
the browser is a real python-socketio client joined to the room; the relay is the real
``create_app`` (in this loop, or ``tests/support/reliability_relay.py`` subprocesses on a real
redis-server for the write-only Redis path).

What each test proves, at the browser: one ``aborted`` terminal per stream left open by a
worker that is gone for longer than the grace period, none for streams that had ended,
none when the worker (or its restarted process) comes back in time and ends its streams
itself, never a second terminal, no false ``aborted`` while Redis is down — and that the
relay's tracking is empty again afterwards.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import socketio
from support.network import RedisServer, serve_asgi
from support.redis_helpers import wait_subscribed
from support.relay_helpers import CALL, CONV, NS, SECRET, barrier, terminals
from support.reliability_helpers import (
    RUNS,
    SHORT_PINGS,
    Clock,
    browser_on,
    report,
    running_relay,
    worker_process,
)
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.emit import LoopbackEmitter, RedisEmitter
from kernel_ext.errors import ConfigError
from kernel_ext.protocol import decode
from kernel_ext.relay import WORKER_GONE_MESSAGE, ChatRelay, allow_all, create_app

pytestmark = [pytest.mark.network, pytest.mark.timeout(120 + 15 * RUNS)]

GRACE = 2.0
TRACKING = ("workers_tracked", "workers_in_grace", "worker_streams")
EMPTY = dict.fromkeys(TRACKING, 0)
REDIS_TRACKING = ("redis_workers_tracked", "redis_worker_streams")


@asynccontextmanager
async def relay_with(**options: Any) -> AsyncIterator[tuple[int, ChatRelay]]:
    """A relay in this loop (short pings: a frozen worker is noticed in about 1.5 s)."""
    ready = create_app(SECRET, authorize_join=allow_all, **options)
    ready.sio.eio.ping_interval, ready.sio.eio.ping_timeout = SHORT_PINGS
    try:
        async with serve_asgi(ready.app) as port:
            yield port, ready.relay
    finally:
        await ready.relay.aclose()


def tracking(relay: ChatRelay) -> dict[str, int]:
    stats = relay.stats()
    return {key: stats[key] for key in TRACKING}


def aborted(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for b in blocks if b["state"] == "aborted"]


def states(stream: list[dict[str, Any]]) -> list[str]:
    return [b["state"] for b in stream]


def check_aborted(stream: list[dict[str, Any]]) -> None:
    """The stream ends with the relay's one aborted terminal, a valid block whose seq is
    one above the stream's highest."""
    final = stream[-1]
    assert terminals(stream) == [final]
    assert final["state"] == "aborted"
    decode(final)  # a valid block
    assert final["envelope"]["payload"] == {"message": WORKER_GONE_MESSAGE}
    assert final["envelope"]["status"] == "aborted"
    assert final["envelope"]["streamKey"] == final["taskId"]
    assert final["envelope"]["seq"] == max(b["envelope"]["seq"] for b in stream[:-1]) + 1


# -- the loopback path ------------------------------------------------------------------


OPEN_TWO_END_ONE = ("run t1 one", "run t1 two", "run t2 one", "run t0 one", "done t0 the answer")


async def test_a_killed_worker_gets_one_aborted_per_open_stream_within_the_grace() -> None:
    """Repeated ``KERNEL_EXT_RELIABILITY_RUNS`` times: each run a new worker process opens
    two streams and ends a third, then is SIGKILLed."""
    seen_after: list[float] = []
    async with relay_with(worker_grace=GRACE) as (port, relay), browser_on(port) as browser:
        for run in range(RUNS):
            call_id = f"{run + 1:016x}"
            where: dict[str, Any] = {"relay_port": port, "call_id": call_id}
            async with worker_process(f"worker-killed-{run}", **where) as worker:
                await worker.do(*OPEN_TWO_END_ONE)
                await browser.wait_for(lambda _, c=call_id: len(browser.stream(c)) == 5)
                assert tracking(relay) == {**EMPTY, "workers_tracked": 1, "worker_streams": 2}
                clock = Clock()
                await worker.kill()
                await browser.wait_for(
                    lambda _, c=call_id: len(aborted(browser.stream(c))) == 2, timeout=GRACE + 5
                )
                seen_after.append(clock.elapsed())
            await wait_until(lambda: tracking(relay) == EMPTY)  # released after the abort
            await barrier(browser, port)
            for task in ("t1", "t2"):
                check_aborted(browser.stream(call_id, task))
            assert states(browser.stream(call_id, "t1")) == ["running", "running", "aborted"]
            assert states(browser.stream(call_id, "t0")) == ["running", "done"]  # had ended
            assert len(terminals(browser.stream(call_id))) == 3
        stats = relay.stats()
    assert (stats["worker_aborted"], stats["workers_gone"]) == (2 * RUNS, RUNS)
    report(
        "worker SIGKILLed mid-stream (loopback)",
        runs=RUNS,
        grace_s=GRACE,
        open_streams=2 * RUNS,
        aborted_delivered=len(aborted(browser.blocks)),
        seconds_from_kill_to_aborted=f"{min(seen_after):.2f}–{max(seen_after):.2f}",
    )
    print(f"loopback: SIGKILL -> both aborted seen after {max(seen_after):.2f} s (grace {GRACE})")


async def test_a_worker_restarted_within_the_grace_under_its_old_id_ends_its_streams() -> None:
    grace = 30.0  # far longer than a Python process takes to start
    async with relay_with(worker_grace=grace) as (port, relay), browser_on(port) as browser:
        async with worker_process("worker-restarted", relay_port=port) as first:
            await first.do("run t1 one", "run t2 one")
            await browser.wait_for(lambda blocks: len(blocks) == 2)
            await first.kill()
        await wait_until(lambda: relay.stats()["workers_in_grace"] == 1)  # the grace runs
        async with worker_process("worker-restarted", relay_port=port) as second:
            await wait_until(lambda: relay.stats()["workers_in_grace"] == 0)
            await second.do("done t1 answer one", "done t2 answer two")
            await browser.wait_for(lambda blocks: len(terminals(blocks)) == 2)
            # Settled: no open stream and no grace timer left, so nothing can end them now.
            await wait_until(lambda: tracking(relay) == EMPTY)
        await barrier(browser, port)
        stats = relay.stats()
    assert stats["workers_resumed"] == 1
    assert stats.get("worker_aborted", 0) == 0
    for task, answer in (("t1", "answer one"), ("t2", "answer two")):
        stream = browser.stream(CALL, task)
        assert states(stream) == ["running", "done"]
        assert stream[-1]["envelope"]["payload"] == {"text": answer}


async def test_a_restarted_worker_takes_over_the_streams_it_goes_on_with_the_rest_end() -> None:
    """A restarted process has a new worker id: the streams of its predecessor that it
    ends or goes on with are its own; the one it ignores is ended after the grace."""
    grace = 10.0  # longer than a Python process takes to start
    async with relay_with(worker_grace=grace) as (port, relay), browser_on(port) as browser:
        async with worker_process("before-restart", relay_port=port) as first:
            await first.do("run t1 one", "run t2 one", "run t3 one")
            await browser.wait_for(lambda blocks: len(blocks) == 3)
            await first.kill()
        await wait_until(lambda: relay.stats()["workers_in_grace"] == 1)
        async with worker_process("after-restart", relay_port=port) as second:
            await second.do("done t1 answer one", "run t2 two")
            assert tracking(relay) == {
                "workers_tracked": 2,
                "workers_in_grace": 1,
                "worker_streams": 2,
            }
            await browser.wait_for(lambda blocks: bool(aborted(blocks)), timeout=grace + 5)
            await second.do("done t2 answer two")
            await wait_until(lambda: tracking(relay) == EMPTY)
        await barrier(browser, port)
        stats = relay.stats()
    assert states(browser.stream(CALL, "t1")) == ["running", "done"]
    assert states(browser.stream(CALL, "t2")) == ["running", "running", "done"]
    check_aborted(browser.stream(CALL, "t3"))
    assert (stats["worker_aborted"], stats["workers_gone"]) == (1, 1)


async def test_a_worker_back_after_the_grace_re_sends_its_terminal_and_it_is_not_shown() -> None:
    grace = 1.0
    async with relay_with(worker_grace=grace) as (port, relay), browser_on(port) as browser:
        async with worker_process("worker-frozen", relay_port=port) as worker:
            await worker.do("run t1 one")
            await browser.wait_for(lambda blocks: len(blocks) == 1)
            worker.signal(signal.SIGSTOP)
            try:
                # Frozen: the relay drops it at its ping timeout and ends t1 after the grace.
                worker.send("run t1 while frozen", "done t1 the answer")
                await browser.wait_for(lambda blocks: bool(aborted(blocks)), timeout=grace + 15)
            finally:
                worker.signal(signal.SIGCONT)
            # Back: it reconnects as the same worker and re-sends the terminal until the
            # relay acknowledges it.
            assert await worker.answer() == "ok True"
            assert await worker.answer() == "ok True"
            await wait_until(lambda: relay.stats()["duplicate_terminal"] == 1)
        await wait_until(lambda: tracking(relay) == EMPTY)
        await barrier(browser, port)
    stream = browser.stream(CALL, "t1")
    assert states(stream) == ["running", "aborted"]
    check_aborted(stream)


async def test_the_relays_worker_tracking_is_bounded_and_empty_after_the_streams_end() -> None:
    def block(task: str, state: str = "running", call_id: str | None = CALL) -> dict[str, Any]:
        payload = {"message" if state == "aborted" else "text": "x"}
        envelope = {"v": 1, "kind": "text", "streamKey": task, "seq": 1, "status": state}
        return {
            "v": 1,
            "callId": call_id,
            "taskId": task,
            "state": state,
            "ts": 1,
            "envelope": {**envelope, "payload": payload},
        }

    options = {"worker_grace": 60.0, "max_workers": 2, "max_worker_streams": 3}
    async with relay_with(**options) as (port, relay):
        senders = []
        try:
            for worker in ("w1", "w2", "w3"):
                sender = socketio.AsyncClient(reconnection=False)
                senders.append(sender)
                await sender.connect(
                    f"http://127.0.0.1:{port}",
                    namespaces=[NS],
                    auth={"internal": SECRET, "worker": worker},
                    transports=["websocket"],
                    wait_timeout=CALL_TIMEOUT,
                )
            w1, w2, w3 = senders
            # Five streams of w1 and one without a callId (no pane: not tracked).
            blocks = [block(f"t{i}") for i in range(5)] + [block("anon", call_id=None)]
            await w1.call("kx_blocks", {"v": 1, "room": CONV, "blocks": blocks}, namespace=NS)
            assert tracking(relay) == {**EMPTY, "workers_tracked": 1, "worker_streams": 3}
            assert relay.stats()["worker_streams_dropped"] == 2
            for sender, task in ((w2, "u"), (w3, "v")):
                frame = {"v": 1, "room": CONV, "blocks": [block(task)]}
                await sender.call("kx_blocks", frame, namespace=NS)
            assert tracking(relay)["workers_tracked"] == 2  # w1, the oldest, was forgotten
            assert relay.stats()["workers_dropped"] == 1
            for sender, task in ((w2, "u"), (w3, "v")):
                frame = {"v": 1, "room": CONV, "blocks": [block(task, "done")]}
                await sender.call("kx_blocks", frame, namespace=NS)
            assert tracking(relay) == EMPTY
        finally:
            for sender in senders:
                await sender.disconnect()
        await wait_until(lambda: relay.stats()["internal"] == 0)
        assert tracking(relay) == EMPTY  # nothing open: no grace timer either


@pytest.mark.parametrize("bad", [5, "", "two words", "x" * 129, "-leading", "nl\n"])
async def test_a_bad_worker_id_is_refused_and_counted(bad: Any) -> None:
    async with relay_with() as (port, relay):
        sender = socketio.AsyncClient(reconnection=False)
        with pytest.raises(socketio.exceptions.ConnectionError):
            await sender.connect(
                f"http://127.0.0.1:{port}",
                namespaces=[NS],
                auth={"internal": SECRET, "worker": bad},
                transports=["websocket"],
                wait_timeout=CALL_TIMEOUT,
            )
        await sender.disconnect()
        assert relay.stats()["rejected_bad_worker"] == 1
        assert relay.stats()["internal"] == 0


def test_senders_present_a_worker_id_of_their_own_or_the_one_given() -> None:
    one = LoopbackEmitter("http://127.0.0.1:1", SECRET)
    other = RedisEmitter("redis://127.0.0.1:1/0")
    assert len(one.worker_id) == 32
    assert one.worker_id != other.worker_id
    given = LoopbackEmitter("http://127.0.0.1:1", SECRET, worker_id="host-3:worker@1")
    assert given.worker_id == "host-3:worker@1"
    with pytest.raises(ConfigError, match="worker_id"):
        LoopbackEmitter("http://127.0.0.1:1", SECRET, worker_id="two words")
    with pytest.raises(ConfigError, match="worker_id"):
        RedisEmitter("redis://127.0.0.1:1/0", worker_id="x" * 129)
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        RedisEmitter("redis://127.0.0.1:1/0", worker_id="w", heartbeat_interval=0)


# -- the write-only Redis path ----------------------------------------------------------


async def redis_tracking(web: Any) -> dict[str, int]:
    counts = (await web.stats())["counts"]
    return {key: counts.get(key) for key in REDIS_TRACKING}


@asynccontextmanager
async def two_web_processes(
    redis_url: str, grace: float
) -> AsyncIterator[tuple[Any, Any, Any, Any]]:
    async with (
        running_relay(redis_url, worker_grace=grace) as web1,
        running_relay(redis_url, worker_grace=grace) as web2,
        browser_on(web1.port, name="on-web1") as b1,
        browser_on(web2.port, name="on-web2") as b2,
    ):
        await wait_subscribed(redis_url, 2)
        yield web1, web2, b1, b2


@pytest.mark.redis
async def test_a_killed_redis_worker_gets_one_aborted_per_open_stream_on_every_web_process(
    redis_server: RedisServer,
) -> None:
    async with two_web_processes(redis_server.url, GRACE) as (web1, web2, b1, b2):
        async with worker_process("redis-worker", redis_url=redis_server.url) as worker:
            await worker.do(*OPEN_TWO_END_ONE)
            for browser in (b1, b2):
                await browser.wait_for(lambda blocks: len(blocks) == 5)
            # The scenario: the worker stays idle for longer than the grace; its heartbeats
            # alone must keep it alive (a fixed duration, not a synchronisation).
            await asyncio.sleep(2 * GRACE)
            for web in (web1, web2):
                assert await redis_tracking(web) == {
                    "redis_workers_tracked": 1,
                    "redis_worker_streams": 2,
                }
            assert aborted(b1.blocks) == aborted(b2.blocks) == []
            clock = Clock()
            await worker.kill()
            for browser in (b1, b2):
                await browser.wait_for(lambda blocks: len(aborted(blocks)) == 2, timeout=GRACE + 5)
            seen_after = clock.elapsed()
        empty = dict.fromkeys(REDIS_TRACKING, 0)
        for web in (web1, web2):
            await wait_until(lambda web=web: _equals(redis_tracking(web), empty), 20, interval=0.05)
        await barrier(b1, web1.port)
        await barrier(b2, web2.port)
        counts = [(await web.stats())["counts"] for web in (web1, web2)]
    for browser in (b1, b2):
        for task in ("t1", "t2"):
            check_aborted(browser.stream(CALL, task))
        assert states(browser.stream(CALL, "t0")) == ["running", "done"]
        assert len(terminals(browser.blocks)) == 3  # one per stream: no web process doubled it
    for web_counts in counts:
        assert web_counts["redis_worker_aborted"] == 2
    report(
        "worker SIGKILLed mid-stream (write-only Redis emitter, 2 web processes)",
        grace_s=GRACE,
        open_streams=2,
        aborted_delivered_per_browser=2,
        seconds_from_kill_to_aborted=round(seen_after, 2),
    )
    print(f"redis: SIGKILL -> aborted at both browsers after {seen_after:.2f} s (grace {GRACE} s)")


@pytest.mark.redis
async def test_a_browser_joining_after_a_redis_worker_died_elsewhere_sees_its_streams_end(
    redis_server: RedisServer,
) -> None:
    """Room routing: web2 had no browser of the room while the write-only worker published
    and died. A browser that joins there afterwards is caught up from the room's log, and
    web2 — which learns the worker's open streams from that log — ends them with one
    ``aborted`` each after the grace; the finished stream stays finished."""
    async with (
        running_relay(redis_server.url, worker_grace=GRACE) as web1,
        running_relay(redis_server.url, worker_grace=GRACE) as web2,
        browser_on(web1.port, name="on-web1") as b1,
    ):
        await wait_subscribed(redis_server.url, 1)  # web2 listens from its first browser on
        async with worker_process("redis-worker", redis_url=redis_server.url) as worker:
            await worker.do(*OPEN_TWO_END_ONE)
            await b1.wait_for(lambda blocks: len(blocks) == 5)
            await worker.kill()
        async with browser_on(web2.port, name="joins-web2-later") as late:
            await late.wait_for(lambda blocks: len(aborted(blocks)) == 2, timeout=GRACE + 10)
            await barrier(late, web2.port)
            for task in ("t1", "t2"):
                check_aborted(late.stream(CALL, task))
            assert states(late.stream(CALL, "t0")) == ["running", "done"]
            assert len(terminals(late.blocks)) == 3
        await b1.wait_for(lambda blocks: len(aborted(blocks)) == 2, timeout=GRACE + 10)


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return bool(await value == expected)


@pytest.mark.redis
async def test_a_restarted_redis_worker_ends_its_predecessors_stream_within_the_grace(
    redis_server: RedisServer,
) -> None:
    async with two_web_processes(redis_server.url, 30.0) as (web1, web2, b1, b2):
        async with worker_process("redis-before-restart", redis_url=redis_server.url) as first:
            await first.do("run t1 one")
            for browser in (b1, b2):
                await browser.wait_for(lambda blocks: len(blocks) == 1)
            await first.kill()
        async with worker_process("redis-after-restart", redis_url=redis_server.url) as second:
            await second.do("done t1 the answer")
            for browser in (b1, b2):
                await browser.wait_for(lambda blocks: bool(terminals(blocks)))
        empty = dict.fromkeys(REDIS_TRACKING, 0)
        for web in (web1, web2):  # settled: nothing tracked, so nothing can be ended now
            await wait_until(lambda web=web: _equals(redis_tracking(web), empty), 20, interval=0.05)
        await barrier(b1, web1.port)
        await barrier(b2, web2.port)
    for browser in (b1, b2):
        stream = browser.stream(CALL, "t1")
        assert states(stream) == ["running", "done"]


@pytest.mark.redis
async def test_a_redis_outage_longer_than_the_grace_does_not_end_a_live_workers_streams(
    redis_server: RedisServer,
) -> None:
    async with two_web_processes(redis_server.url, GRACE) as (web1, web2, b1, b2):
        async with worker_process("redis-survivor", redis_url=redis_server.url) as worker:
            await worker.do("run t1 one")
            for browser in (b1, b2):
                await browser.wait_for(lambda blocks: len(blocks) == 1)
            redis_server.stop()
            # The fault: Redis stays down for longer than the grace (no heartbeat arrives).
            await asyncio.sleep(GRACE + 2)
            redis_server.start()  # same port
            for web in (web1, web2):  # each heard nothing for a while: every grace restarts
                await wait_until(lambda web=web: _resumed(web), 60, interval=0.05)
            await worker.do("done t1 the answer")  # held by the worker until Redis is back
            for browser in (b1, b2):
                await browser.wait_for(lambda blocks: bool(terminals(blocks)), timeout=30)
        empty = dict.fromkeys(REDIS_TRACKING, 0)
        for web in (web1, web2):
            await wait_until(lambda web=web: _equals(redis_tracking(web), empty), 20, interval=0.05)
        await barrier(b1, web1.port)
        await barrier(b2, web2.port)
        counts = [(await web.stats())["counts"] for web in (web1, web2)]
    for browser in (b1, b2):
        assert states(browser.stream(CALL, "t1")) == ["running", "done"]
    for web_counts in counts:
        assert web_counts.get("redis_worker_aborted", 0) == 0


async def _resumed(web: Any) -> bool:
    return bool((await web.stats())["counts"].get("redis_watch_resumed", 0) >= 1)
