"""Whether a Redis answers, asked once before a process depends on it.

python-socketio's Redis managers only log every message they lose when Redis is not there;
a command that starts one (the demo's ``--redis``) asks first, so that it can say so and
stop.
"""

from __future__ import annotations

import contextlib

__all__ = ["RedisUnreachable", "ping"]


class RedisUnreachable(Exception):
    """``url`` is no Redis URL, or the Redis there did not answer (the message says which)."""


async def ping(url: str, timeout: float = 3.0) -> None:
    """Return once the Redis at ``url`` answered ``PING`` within ``timeout`` seconds.

    Raises:
        RedisUnreachable: ``url`` does not parse, or the Redis there did not answer.
    """
    from redis import asyncio as aioredis

    try:
        client = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout
        )
    except ValueError as exc:
        raise RedisUnreachable(f"{url!r} is not a Redis URL: {exc}") from exc
    try:
        await client.ping()
    except Exception as exc:
        raise RedisUnreachable(f"Redis at {url} does not answer: {exc}") from exc
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()
