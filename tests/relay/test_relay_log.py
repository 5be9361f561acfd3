"""What the relay logs, as an operator reads it.

* ``kernel-ext relay`` writes every line on stderr in one format: the start-up line, and
  every log record of ``--log-level`` or above — its own, uvicorn's, the libraries' — as
  ``kernel-ext relay: <level>: <message>``.
* A dropped event names who sent it once (``browser event 'x' from <sid>``); a count in a
  line agrees with its noun (``seen 1 time``, ``after 1 failed attempt``).
* A recovery is not a problem: Redis answering again is logged at INFO.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import signal

import pytest
import socketio
from support.cli_helpers import EXIT_AFTER, STARTUP, running, stopping_line
from support.network import RedisServer, free_port, need_binary, started
from support.relay_helpers import SECRET
from support.timing import wait_until

from kernel_ext.observability._rare_log import RareLog, plural
from kernel_ext.relay import RelayRedisManager, allow_all, mount_relay
from kernel_ext.relay import guarded as guarded_module

pytestmark = [pytest.mark.timeout(120)]

LOG_RECORD = r"^kernel-ext relay: (debug|info|warning|error|critical): \S.*$"
"""A log record on the relay command's stderr."""


def assert_one_format(err: str) -> list[re.Match[str]]:
    """Every line of ``err`` is the start-up line, a log record or the line a stop signal
    writes (once); the log records."""
    stops = {stopping_line("kernel-ext relay", signum) for signum in EXIT_AFTER}
    lines = err.splitlines()
    assert sum(line in stops for line in lines) <= 1, lines
    lines = [line for line in lines if line not in stops]
    assert lines
    records = []
    for line in lines:
        record = re.match(LOG_RECORD, line)
        assert record is not None or re.match(STARTUP, line), f"another format: {line!r}"
        if record is not None:
            records.append(record)
    return records


# -- wording -----------------------------------------------------------------------------


def test_plural_agrees_the_noun_with_its_count() -> None:
    assert plural(1, "failed attempt") == "1 failed attempt"
    assert [plural(n, "time") for n in (0, 2, 11)] == ["0 times", "2 times", "11 times"]


def test_a_rare_log_line_says_seen_1_time_then_seen_2_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("kernel_ext.tests.rare")
    rare = RareLog(logger)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        rare("reason", "something happened")
        rare("reason", "something happened")
    assert [record.getMessage() for record in caplog.records] == [
        "something happened [reason; seen 1 time]",
        "something happened [reason; seen 2 times]",
    ]


async def test_a_browsers_unknown_event_is_logged_naming_the_browser_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A rare log of its own, so that this is the first occurrence whatever ran before.
    monkeypatch.setattr(guarded_module, "rare", RareLog(logging.getLogger("kernel_ext.relay")))
    relay = mount_relay(socketio.AsyncServer(async_mode="asgi"), SECRET, authorize_join=allow_all)
    with caplog.at_level(logging.WARNING, logger="kernel_ext.relay"):
        assert await relay.trigger_event("tool_event_stream", "sid-1", {"x": 1}) is None
    assert [record.getMessage() for record in caplog.records] == [
        "relay: dropped browser event 'tool_event_stream' from sid-1 (unknown_event) "
        "[relay_unknown_event; seen 1 time]"
    ]
    assert relay.stats()["rejected_unknown_event"] == 1


# -- the recovery's level ----------------------------------------------------------------


@pytest.mark.network
@pytest.mark.redis
async def test_redis_answering_again_is_logged_at_info_with_its_failed_attempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    redis = RedisServer(need_binary("redis-server", "REDIS_SERVER"))  # not started yet
    manager = RelayRedisManager(redis.url, reconnect_delay=0.05, reconnect_delay_max=0.2)
    relay = mount_relay(socketio.AsyncServer(async_mode="asgi", client_manager=manager), SECRET)
    caplog.set_level(logging.INFO, logger="kernel_ext.relay")
    started("network")
    try:
        manager.start()
        assert await manager.tried(10) == "unreachable"
        await asyncio.to_thread(redis.start)
        await wait_until(lambda: manager.redis_state == "connected", 30, "never subscribed")
        failures = manager.counts["redis_unreachable"]  # before this outage ended
        recoveries = [r for r in caplog.records if "answers again" in r.getMessage()]
    finally:
        await relay.aclose()
        await asyncio.to_thread(redis.stop)
        shutil.rmtree(redis.dir, ignore_errors=True)
    assert failures >= 1
    assert [(r.levelno, r.getMessage()) for r in recoveries] == [
        (
            logging.INFO,
            f"relay: Redis at {redis.url} answers again (after "
            f"{failures} failed attempt{'' if failures == 1 else 's'})",
        )
    ]


# -- kernel-ext relay's stderr -------------------------------------------------------------


@pytest.mark.network
async def test_kernel_ext_relay_writes_every_line_in_one_format() -> None:
    # --log-level info: uvicorn's records too; --allow-anyone: a warning of the relay's own.
    port = str(free_port())
    async with running("relay", "--port", port, "--allow-anyone", "--log-level", "info") as relay:
        await relay.wait_for_line(STARTUP)
        code, err = await relay.stop(signal.SIGTERM)
    assert code == 143
    records = assert_one_format(err)
    levels = {record.group(1) for record in records}
    assert {"info", "warning"} <= levels, err
    assert "kernel-ext relay: warning: relay started with --allow-anyone" in err
    assert "kernel-ext relay: info: Started server process" in err  # uvicorn's
