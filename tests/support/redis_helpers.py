"""Test helpers for scale-out through a real redis-server: how many web processes listen on
the Socket.IO channel (or anyone on another channel), and waiting until enough do."""

from __future__ import annotations

from support.timing import wait_until


async def subscribers(redis_url: str) -> int:
    from redis import asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        result = await client.pubsub_numsub("socketio")
        return int(result[0][1]) if result else 0
    finally:
        await client.aclose()


async def wait_subscribed(redis_url: str, n: int, timeout: float = 20.0) -> None:
    """Poll (with a deadline) until ``n`` web processes listen on the Socket.IO channel."""

    async def subscribed() -> bool:
        return await subscribers(redis_url) >= n

    await wait_until(
        subscribed, timeout, f"{n} web processes did not subscribe to Redis", interval=0.05
    )


async def channel_subscribers(redis_url: str, channel: str) -> int:
    """How many connections subscribe to ``channel`` on the Redis at ``redis_url``."""
    from redis import asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        result = await client.pubsub_numsub(channel)
        return int(result[0][1]) if result else 0
    finally:
        await client.aclose()


async def wait_channel_subscribers(
    redis_url: str, channel: str, n: int = 1, timeout: float = 20.0
) -> None:
    """Poll (with a deadline) until at least ``n`` connections subscribe to ``channel``."""

    async def subscribed() -> bool:
        return await channel_subscribers(redis_url, channel) >= n

    await wait_until(subscribed, timeout, f"{n} did not subscribe to {channel}", interval=0.05)
