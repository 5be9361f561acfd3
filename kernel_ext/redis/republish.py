"""Terminals that did not reach Redis, published again once Redis is back: a part of
:class:`~kernel_ext.redis.manager.RelayRedisManager`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import socketio

from kernel_ext._shared.backoff import Backoff
from kernel_ext._shared.bounded import BoundedMap
from kernel_ext.observability.count_names import (
    REDIS_GIVEN_UP,
    REDIS_PUBLISH_FAILED,
    REDIS_REPUBLISHED,
)
from kernel_ext.protocol import TERMINAL_STATES, TOOL_EVENT_STREAM
from kernel_ext.redis.routing import RoutedPublish
from kernel_ext.relay._log import rare

__all__ = ["Republish"]


class Republish(RoutedPublish, socketio.AsyncRedisManager):  # type: ignore[misc, unused-ignore]
    """Publishes again a terminal whose publish failed
    (the rules: docs/contracts.md, "The relay's Redis manager")."""

    # Its state, set by the manager's constructor.
    _retrying: asyncio.Task[None] | None
    _pending: BoundedMap[int, Any]
    _listeners: int
    _confirmed: bool
    _settle: float
    _ids: Iterator[int]

    def _published(self, data: Any, receivers: int | None) -> None:
        if not self._confirmed:
            return
        if receivers is not None:
            if not self._pending:
                self._listeners = receivers
        elif _is_terminal_emit(data):
            self._bump(REDIS_PUBLISH_FAILED)
            rare(
                "redis_down",
                "relay: a terminal did not reach Redis; retrying",
                level=logging.ERROR,
            )
            self._pending.set(next(self._ids), data)
            if self._retrying is None or self._retrying.done():
                self._retrying = asyncio.get_running_loop().create_task(self._retry())

    def _given_up(self, key: int, data: Any, reason: str) -> None:
        self._bump(REDIS_GIVEN_UP)

    async def _retry(self) -> None:
        """Publish the pending terminals again, oldest first, once Redis answers and as
        many web processes listen as before (or ``settle`` seconds after it answered)."""
        pending = self._pending
        backoff = Backoff(0.25, 2.0, jitter=0.0)  # the schedule it always had
        back_since: float | None = None
        while True:
            pending.expire()
            if not pending:
                return
            await asyncio.sleep(backoff.next())
            try:
                listening = (await self.redis.pubsub_numsub(self.channel))[0][1]
            except Exception:
                back_since = None
                continue
            now = time.monotonic()
            back_since = back_since or now
            if listening < self._listeners and now - back_since < self._settle:
                continue
            for key, data in pending.items():
                if key not in pending:
                    continue  # forgotten meanwhile (beyond the bound)
                await self._publish_one(data)
                if self.last_receivers is None:
                    break
                pending.pop(key)
                self._bump(REDIS_REPUBLISHED)


def _is_terminal_emit(data: Any) -> bool:
    if not isinstance(data, dict) or data.get("event") != TOOL_EVENT_STREAM:
        return False
    args = data.get("data")
    block = args[0] if isinstance(args, list) and args else None
    return isinstance(block, dict) and block.get("state") in TERMINAL_STATES
