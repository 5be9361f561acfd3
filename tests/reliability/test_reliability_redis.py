"""Redis stopped and restarted, ``KERNEL_EXT_RELIABILITY_RUNS`` times, under both Redis
deployments (a real redis-server; relays are subprocesses with a Redis client manager):

* the write-only :class:`~kernel_ext.emit.RedisEmitter` (the worker emits into the rooms
  through Redis): the outage is reported (health callback, ERROR log, ``redis_down``
  counts); running blocks are dropped and counted; every terminal arrives exactly once
  after Redis is back;
* the relays' server-side client manager (worker → web process 1 over the loopback
  emitter; browsers on web processes 1 and 2): the outage is reported (logged at ERROR and
  counted ``redis_publish_failed`` by the web process); the browser on the worker's own web
  process loses nothing; the browser on the other web process gets the terminal published
  during the outage once Redis is back (``redis_republished``), exactly once, and
  everything published after.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from support.network import RedisServer
from support.redis_helpers import wait_subscribed
from support.relay_helpers import CONV, barrier, terminals
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

from kernel_ext.emit import RedisEmitter
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.redis, pytest.mark.timeout(60 + 30 * RUNS)]


def has_terminal(browser: Any, call_id: str) -> Any:
    return lambda _: bool(terminals(browser.stream(call_id)))


async def test_redis_outage_under_the_write_only_emitter_is_reported_and_no_terminal_is_lost(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kernel_ext.emit")
    health: list[bool] = []

    def redis_emitter(hub: StreamHub) -> RedisEmitter:
        return RedisEmitter(redis_server.url, hub=hub, on_health=health.append, retry_interval=0.1)

    published = 0
    async with running_relay(redis_server.url) as relay, browser_on(relay.port) as browser:
        await wait_subscribed(redis_server.url, 1)
        async with Worker(emitter=redis_emitter) as worker:
            for run in range(RUNS):
                with worker.call(CONV) as call:
                    for i in range(3):
                        worker.hub.publish(f"run {run}: step {i}")
                    await browser.wait_for(lambda _: len(browser.stream(call.call_id)) >= 3)
                    redis_server.stop()
                    for i in range(3):
                        worker.hub.publish(f"run {run}: while Redis is down {i}")
                    worker.hub.publish(f"run {run}: the answer", state="done")
                    published += 4
                    await wait_until(lambda: not worker.emitter.healthy)  # reported
                    redis_server.start()  # same port
                await browser.wait_for(has_terminal(browser, call.call_id), timeout=30)
                await settled(worker, timeout=30)
                await barrier(browser, relay.port)
                final = one_terminal_last(browser.stream(call.call_id))
                assert final["envelope"]["payload"] == {"text": f"run {run}: the answer"}
            assert isinstance(worker.emitter, RedisEmitter)
            outages = worker.emitter.outages
            losses = worker.losses()
    assert published == 4 * RUNS
    assert outages == RUNS
    assert health == [False, True] * RUNS
    assert losses["redis_down"] >= RUNS  # running blocks dropped while down, counted
    reported = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(reported) == RUNS
    delivered = len(terminals(browser.blocks))
    assert delivered == RUNS
    report(
        "Redis stopped and restarted under the write-only Redis emitter",
        runs=RUNS,
        terminals_expected=RUNS,
        terminals_delivered=delivered,
        duplicates=0,
        outages_reported=outages,
        worker_drops=losses,
    )


async def test_redis_outage_under_the_relays_client_manager_is_reported_and_recovers(
    redis_server: RedisServer,
) -> None:
    async with (
        running_relay(redis_server.url) as web1,
        running_relay(redis_server.url) as web2,
        browser_on(web1.port, name="on-web1") as local,
        browser_on(web2.port, name="on-web2") as remote,
    ):
        await wait_subscribed(redis_server.url, 2)
        async with Worker(web1.port, ack_timeout=5.0) as worker:  # the worker talks to web1
            for run in range(RUNS):
                with worker.call(CONV) as before:
                    worker.hub.publish(f"run {run}: step")
                    for browser in (local, remote):
                        await browser.wait_for(lambda _, b=browser: bool(b.stream(before.call_id)))
                    redis_server.stop()
                    worker.hub.publish(f"run {run}: the answer during the outage", state="done")
                    await local.wait_for(has_terminal(local, before.call_id))
                await settled(worker)
                # Reported: web1 logs and counts the terminal that did not reach Redis.
                await wait_until(lambda: "did not reach Redis" in web1.log())
                redis_server.start()
                await wait_subscribed(redis_server.url, 2, timeout=60)
                # Recovered: the other web process's browser gets it after the outage.
                await remote.wait_for(has_terminal(remote, before.call_id), timeout=30)
                # Recovered: a call after the outage reaches both web processes' browsers.
                with worker.call(CONV) as after:
                    worker.hub.publish(f"run {run}: after the outage")
                    worker.hub.publish(f"run {run}: the answer after the outage", state="done")
                for browser in (local, remote):
                    await browser.wait_for(has_terminal(browser, after.call_id), timeout=30)
                await barrier(local, web1.port)
                await barrier(remote, web2.port)
                for browser in (local, remote):
                    one_terminal_last(browser.stream(before.call_id))
                    one_terminal_last(browser.stream(after.call_id))
            losses = worker.losses()
            stats = (await web1.stats())["counts"]
    assert len(terminals(local.blocks)) == len(terminals(remote.blocks)) == 2 * RUNS
    assert stats["redis_publish_failed"] == stats["redis_republished"] == RUNS
    report(
        "Redis stopped and restarted under the relays' Redis client manager (2 web processes)",
        runs=RUNS,
        terminals_expected=4 * RUNS,
        terminals_delivered_same_process=len(terminals(local.blocks)),
        terminals_delivered_other_process=len(terminals(remote.blocks)),
        republished_after_the_outage=stats["redis_republished"],
        duplicates=0,
        worker_drops=losses,
    )
