"""The way back on Redis: a write-only worker hears the stops web processes ask of it.

A :class:`~kernel_ext.emit.RedisEmitter` that tags its emits with its worker id (heartbeats
on, the default) subscribes, while it runs, to its own stop channel
(:func:`kernel_ext._redis_routing.stop_channel`). A web process whose browser asks to stop a
call of this worker (:mod:`kernel_ext.relay.stops`) publishes ``{"v": 1, "callId"}`` there;
each message is handed to :func:`kernel_ext.stop_call` (a malformed one: ``refused`` in its
counts). The web process answers the browser by Redis's receiver count: ``stopping`` while
this subscription stands, ``unreachable`` while it does not.

The subscription is a Redis connection of its own (a subscribed connection can do nothing
else). When Redis drops or refuses it, it is made again after a jittered backoff (0.25 s up
to 5 s); the first failure of each outage is logged at WARNING, later ones rarely. Never
raises into the emitter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from kernel_ext._shared.backoff import Backoff
from kernel_ext.observability._rare_log import RareLog
from kernel_ext.stop import stop_call

__all__ = ["StopListener"]

_log = logging.getLogger("kernel_ext.emit.redis")
_rare = RareLog(_log)


class StopListener:
    """Subscribe to ``channel`` on the Redis at ``url`` (redis-py ``options``, less a read
    timeout: a subscription waits for messages) and stop each call asked for, until
    :meth:`aclose`. :attr:`subscribed` is set while the subscription stands."""

    def __init__(self, url: str, channel: str, options: Mapping[str, Any]) -> None:
        self.url = url
        self.channel = channel
        self._options = {k: v for k, v in options.items() if k != "socket_timeout"}
        self.subscribed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start listening in a task of the running loop."""
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
                await pubsub.subscribe(self.channel)
                self.subscribed.set()
                backoff.reset()
                if down:
                    _log.info("redis emitter: listening for stops on Redis again")
                    down = False
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        _stop(message.get("data"))
                raise ConnectionError("the subscription ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.subscribed.clear()
                if not down:
                    _log.warning("redis emitter: not listening for stops (%s); trying again", exc)
                    down = True
                else:
                    _rare("stop_listen", "redis emitter: still not listening for stops")
            finally:
                with contextlib.suppress(Exception):
                    close = getattr(client, "aclose", None) or client.close  # redis < 5.0.1
                    await close()
            await asyncio.sleep(backoff.next())


def _stop(data: Any) -> None:
    """Stop the call a stop message asks for (anything malformed: ``refused``)."""
    try:
        request = json.loads(data)
    except (TypeError, ValueError):
        request = None
    call_id = request.get("callId") if isinstance(request, dict) and request.get("v") == 1 else None
    stop_call(call_id, reason="asked over Redis")
