"""What a publish on Redis did: python-socketio's ``AsyncRedisManager`` reporting each
publish's receiver count, and a task's publishes sent as one pipeline.

:class:`PublishResult` is a mixin for python-socketio's ``AsyncRedisManager``; the probes
that say whether the python-socketio in use allows it stay with every other
private-name probe in :mod:`kernel_ext._shared.compat` (``publish_result_supported``,
``publish_pipeline_supported``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar
from typing import Any

from kernel_ext._shared.compat import (
    connect_redis,
    publish_pipeline_supported,
    publish_result_supported,
)

__all__ = ["PublishResult"]

# The logger these messages always had (operators filter on it).
_log = logging.getLogger("kernel_ext.compat")


class _Collected:
    """The pub/sub messages one task publishes on one manager inside
    :meth:`PublishResult.pipelined`, and (after) what Redis said of each."""

    __slots__ = ("manager", "messages", "receivers", "task")

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        # The task itself, not the tasks it starts (they copy the context variable).
        self.task = asyncio.current_task()
        self.messages: list[Any] = []
        self.receivers: list[int | None] = []


_COLLECTING: ContextVar[_Collected | None] = ContextVar("kernel_ext_redis_pipeline", default=None)


class PublishResult:
    """A mixin for python-socketio's ``AsyncRedisManager`` (listed first among the bases):
    after each publish, :attr:`last_receivers` is Redis's receiver count, or ``None`` when
    the publish failed (python-socketio only logs that). Where the probe failed
    (:func:`publish_result_supported` is false), it stays ``None``: callers treat every
    publish as unconfirmed. :meth:`_published` is called with each message and its count.

    :attr:`emit_tags`, when set, are added to every ``emit`` message it publishes (the
    pub/sub message ``_publish`` receives); python-socketio's managers ignore keys they do
    not know.

    :meth:`pipelined` collects the current task's publishes and sends them in one round
    trip."""

    last_receivers: int | None = None
    emit_tags: Mapping[str, Any] | None = None

    async def _publish(self, data: Any) -> Any:
        tags = self.emit_tags
        if tags and isinstance(data, dict) and data.get("method") == "emit":
            data.update(tags)
        collected = _COLLECTING.get()
        if (
            collected is not None
            and collected.manager is self
            and collected.task is asyncio.current_task()
        ):
            collected.messages.append(data)
            return None
        result = await self._publish_one(data)
        self._published(data, self.last_receivers)
        return result

    async def _publish_one(self, data: Any) -> Any:
        """python-socketio's publish (its two attempts), its receiver count kept; a message
        with commands of its own (:meth:`_route`) goes as a pipeline, with two attempts
        too."""
        await self._before_publish()
        if self._route(data) is not None:
            for attempt in (1, 2):
                receivers = await self._pipeline([data], quiet=attempt == 1)
                if receivers[0] is not None:
                    break
            self.last_receivers = receivers[0]
            return receivers[0]
        result = await super()._publish(data)  # type: ignore[misc, unused-ignore]
        supported = publish_result_supported()
        self.last_receivers = result if supported and isinstance(result, int) else None
        return result

    # Hooks of a routing manager (kernel_ext.redis.routing.RoutedPublish): what a message
    # is published as. Here: python-socketio's one channel.

    async def _before_publish(self) -> None:
        """Called before each publish (or pipeline of them)."""

    def _route(self, message: Any) -> Any:
        """``None`` when ``message`` is published as python-socketio publishes it."""
        return None

    def _queue(self, pipe: Any, message: Any, dumps: Any, after: dict[str, Any]) -> int:
        """Queue ``message``'s commands on ``pipe``; how many replies they give (the first
        is the publish's). ``after``: commands to queue once after every message, by key
        (``(name, *args)``; their replies are not read)."""
        pipe.publish(self.channel, dumps(message))  # type: ignore[attr-defined, unused-ignore]
        return 1

    def _receivers(self, replies: list[Any]) -> int | None:
        """A message's receiver count from the replies of its commands (:meth:`_queue`)."""
        count = replies[0]
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    def _published(self, data: Any, receivers: int | None) -> None:
        """Called after each message went to Redis (``receivers`` ``None``: it failed)."""

    @contextlib.asynccontextmanager
    async def pipelined(self) -> AsyncIterator[list[int | None]]:
        """Within the block, what this task publishes on this manager (``emit`` builds the
        messages, python-socketio's format) is collected; at its end (also when the block
        raised, not when it was cancelled) it is sent in order as one pipeline of
        ``PUBLISH`` commands, one round trip, and the yielded list filled with each
        message's receiver count (``None``: failed). Other tasks publish as usual
        meanwhile. Where :func:`publish_pipeline_supported` is false, the messages are
        published one after the other. A pipeline that fails is not sent again (part of it
        may have arrived): every message in it counts as failed, and the next publish
        connects anew."""
        collected = _Collected(self)
        token = _COLLECTING.set(collected)
        cancelled = False
        try:
            yield collected.receivers
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            _COLLECTING.reset(token)
            if not cancelled:
                await self._send_collected(collected)

    async def _send_collected(self, collected: _Collected) -> None:
        messages = collected.messages
        if not messages:
            return
        await self._before_publish()
        if len(messages) == 1 or not publish_pipeline_supported():
            for message in messages:
                await self._publish_one(message)
                collected.receivers.append(self.last_receivers)
                self._published(message, self.last_receivers)
            return
        receivers = await self._pipeline(messages)
        collected.receivers.extend(receivers)
        self.last_receivers = receivers[-1]
        for message, count in zip(messages, receivers, strict=True):
            self._published(message, count)

    async def _pipeline(self, messages: list[Any], *, quiet: bool = False) -> list[int | None]:
        """Send ``messages`` (:meth:`_queue`'s commands each) as one pipeline; each one's
        receiver count, all ``None`` when it failed (logged at ERROR unless ``quiet``; the
        next publish connects anew)."""
        manager: Any = self
        try:
            connect_redis(manager)
            pipe = manager.redis.pipeline(transaction=False)
            dumps = manager.json.dumps
            after: dict[str, Any] = {}
            sizes = [self._queue(pipe, message, dumps, after) for message in messages]
            for name, *args in after.values():
                pipe.execute_command(name, *args)
            results = await pipe.execute(raise_on_error=False)  # a reply may be an error
            if len(results) != sum(sizes) + len(after):
                raise RuntimeError(f"{len(results)} replies to {sum(sizes)} commands")
            receivers: list[int | None] = []
            at = 0
            for size in sizes:
                receivers.append(self._receivers(results[at : at + size]))
                at += size
            return receivers
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            manager.connected = False  # the next publish connects anew
            if not quiet:
                _log.error(
                    "kernel_ext: cannot publish %d messages to redis: %s", len(messages), exc
                )
            return [None] * len(messages)
