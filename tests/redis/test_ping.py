"""``kernel_ext.redis.ping``: the one question asked of a Redis before a process depends on it
(the demo's ``--redis``), against a real redis-server and a port where nothing listens."""

from __future__ import annotations

import asyncio

import pytest
from support.network import RedisServer, free_port

from kernel_ext.redis.ping import RedisUnreachable, ping

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.redis
@pytest.mark.network
def test_a_running_redis_answers(redis_server: RedisServer) -> None:
    asyncio.run(ping(redis_server.url))


@pytest.mark.network
def test_nothing_listening_is_unreachable_and_says_where() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnreachable, match=rf"^Redis at {url} does not answer: "):
        asyncio.run(ping(url, timeout=2.0))


@pytest.mark.parametrize("url", ["notaurl", "http://127.0.0.1:6379/0"])
def test_a_url_that_is_no_redis_url_is_said_so_before_any_connection(url: str) -> None:
    with pytest.raises(RedisUnreachable, match=r"is not a Redis URL"):
        asyncio.run(ping(url))
