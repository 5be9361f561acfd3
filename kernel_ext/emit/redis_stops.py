"""The way back on Redis: a write-only worker hears the stops web processes ask of it.

A :class:`~kernel_ext.emit.RedisEmitter` that tags its emits with its worker id (heartbeats
on, the default) subscribes, while it runs, to its own stop channel
(:func:`kernel_ext._redis_routing.stop_channel`): :func:`listen_for_stops`. A web process
whose browser asks to stop a call of this worker (:mod:`kernel_ext.relay.stops`) publishes
``{"v": 1, "callId"}`` there; each message is handed to :func:`kernel_ext.stop_call` (a
malformed one: ``refused`` in its counts). The web process answers the browser by Redis's
receiver count: ``stopping`` while this subscription stands, ``unreachable`` while it does
not.

:class:`Subscription` is the subscription itself, also the web processes' for forwarding
stops among themselves (:mod:`kernel_ext.relay.redis_stops`): a Redis connection of its own
(a subscribed connection can do nothing else), made again after a jittered backoff (0.25 s
up to 5 s) when Redis drops or refuses it; the first failure of each outage is logged at
WARNING, later ones rarely, the recovery at INFO. Never raises into its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kernel_ext._shared.backoff import Backoff
from kernel_ext.observability._rare_log import RareLog
from kernel_ext.stop import stop_call

__all__ = ["Subscription", "listen_for_stops"]

_log = logging.getLogger("kernel_ext.redis")
_rare = RareLog(_log)

Handle = Callable[[str, Any], None]
"""``handle(channel, data)``: one message (``data`` as redis-py gives it: bytes)."""


class Subscription:
    """Subscribe to ``channels`` on the Redis at ``url`` (redis-py ``options``, less a read
    timeout: a subscription waits for messages) and hand each message to ``handle``, until
    :meth:`aclose`; ``what`` names it in the log. :attr:`subscribed` is set while the
    subscription stands."""

    def __init__(
        self,
        url: str,
        channels: list[str],
        handle: Handle,
        *,
        options: Mapping[str, Any] | None = None,
        what: str = "stops",
    ) -> None:
        self.url = url
        self.channels = list(channels)
        self._handle = handle
        self._options = {k: v for k, v in (options or {}).items() if k != "socket_timeout"}
        self._what = what
        self.subscribed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start listening in a task of the running loop (once)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        """Stop listening (the subscription's connection closed). Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.subscribed.clear()

    async def _run(self) -> None:
        from redis import asyncio as aioredis

        backoff = Backoff(0.25, 5.0)
        down = False
        while True:
            client = aioredis.Redis.from_url(self.url, **self._options)
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(*self.channels)
                self.subscribed.set()
                backoff.reset()
                if down:
                    _log.info("kernel_ext: listening for %s on Redis again", self._what)
                    down = False
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        channel = message.get("channel")
                        if isinstance(channel, bytes):
                            channel = channel.decode("utf-8", "replace")
                        self._handle(str(channel), message.get("data"))
                raise ConnectionError("the subscription ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.subscribed.clear()
                if not down:
                    _log.warning(
                        "kernel_ext: not listening for %s on Redis (%s); trying again",
                        self._what,
                        exc,
                    )
                    down = True
                else:
                    _rare("stop_listen", "kernel_ext: still not listening on Redis")
            finally:
                with contextlib.suppress(Exception):
                    close = getattr(client, "aclose", None) or client.close  # redis < 5.0.1
                    await close()
            await asyncio.sleep(backoff.next())


def listen_for_stops(url: str, channel: str, options: Mapping[str, Any]) -> Subscription:
    """A write-only worker's subscription to its stop ``channel`` (started)."""
    subscription = Subscription(url, [channel], _stop, options=options)
    subscription.start()
    return subscription


def _stop(channel: str, data: Any) -> None:
    """Stop the call a stop message asks for (anything malformed: ``refused``)."""
    try:
        request = json.loads(data)
    except (TypeError, ValueError):
        request = None
    call_id = request.get("callId") if isinstance(request, dict) and request.get("v") == 1 else None
    stop_call(call_id, reason="asked over Redis")
