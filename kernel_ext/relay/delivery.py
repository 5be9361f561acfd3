"""How a block reaches a room's browsers: supplied by the server's client manager.

The namespace hands each room's valid blocks to its :class:`Delivery` and never asks which
manager the server has. :func:`delivery_for` picks the delivery once, when the namespace
is registered on its server: a manager that offers one (``relay_delivery``: the Redis
manager, :mod:`kernel_ext.redis.manager`) supplies its own; python-socketio's managers get
one of the three here:

* the in-process ``AsyncManager`` itself: each block queued to its browsers' connections
  in the step that picks them (:func:`~kernel_ext.relay._send.send_local`), one after the
  other;
* another manager of the same kind keeps its own ``emit``, each block's as a task: asyncio
  runs new tasks in creation order, so they overlap and keep their order;
* a pub/sub manager publishes after an await, so there they go one after the other, and
  back-pressure skips nobody (its browsers may be on other processes).

Catch-up memory is filled in one place, :meth:`Delivery.hold`: here before each emit, and
by the Redis manager (given that method when it attaches) for every block it emits to
this process's browsers, wherever it came from.

A browser's stop of a call that no worker connected to this process owns goes to the
delivery too (:meth:`Delivery.stop`): the Redis manager's reaches write-only workers and
the other web processes' workers; python-socketio's reach none.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from socketio.async_pubsub_manager import AsyncPubSubManager

from kernel_ext.protocol import TOOL_EVENT_STREAM
from kernel_ext.relay._log import rare
from kernel_ext.relay._send import local_sends, send_local
from kernel_ext.relay.replay import ReplayMemory

__all__ = ["Delivery", "Emit", "StopWays", "deliver", "delivery_for"]

Emit = Callable[..., Awaitable[None]]
"""A relay's ``emit(event, data, room=…, skip_sid=…, to=…)`` (python-socketio's namespace
``emit``, or a subclass's own)."""


@dataclasses.dataclass(frozen=True)
class StopWays:
    """What a delivery needs to route a browser's stop (:mod:`kernel_ext.relay.stops`):
    ``local(room, call_id)``, the answer of this process's worker that owns the call
    (``None``: none does); the relay's ``count``; ``timeout``, the seconds to wait for
    Redis or another web process."""

    local: Callable[[str, str], Awaitable[dict[str, Any] | None]]
    count: Callable[[str], None]
    timeout: float


class Delivery:
    """How blocks reach a room's browsers with a python-socketio manager that keeps its own
    ``emit`` (each block's as a task, in order). Subclasses change what differs."""

    reserves = True
    """Whether back-pressure may skip a browser that is behind (only where this process
    sees every browser the emit goes to)."""
    concurrent = True
    """Whether a frame's blocks of one room are emitted as overlapping tasks."""

    def __init__(
        self, emit: Emit, server: Any, namespace: str, memory: ReplayMemory | None
    ) -> None:
        self.emit = emit
        """The relay's own ``emit`` (a subclass's, if it has one)."""
        self.server = server
        self.namespace = namespace
        self.memory = memory

    def hold(self, room: str, raw: Mapping[str, Any], data: bytes | None = None) -> None:
        """Hold a block for catch-up (the one place the memory is filled), in the same step
        as the emit that follows picks the room's browsers. Never raises."""
        memory = self.memory
        if memory is None:
            return
        try:
            memory.add(room, raw, data)
        except Exception:
            rare("replay_add", "relay: holding a block for catch-up failed", exc_info=True)

    async def block(
        self, raw: Any, room: str, data: bytes | None = None, skip: list[str] | None = None
    ) -> None:
        """Emit one block to ``room`` but the browsers in ``skip``, held first."""
        self.hold(room, raw, data)
        await self.emit(TOOL_EVENT_STREAM, raw, room=room, skip_sid=skip)

    def frame(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """Around the emit of one frame's blocks."""
        return contextlib.nullcontext()

    def joining(self, room: str) -> contextlib.AbstractAsyncContextManager[Any]:
        """Around a browser's entry into ``room``."""
        return contextlib.nullcontext()

    def not_ready(self) -> str | None:
        """Why the relay cannot deliver now, if it cannot (``None``: it can)."""
        return None

    def counts(self) -> dict[str, int]:
        """The delivery's counts and sizes, for the relay's stats."""
        return dict(getattr(self.server.manager, "counts", None) or {})

    async def stop(
        self, room: str, call_id: str, running: bool, ways: StopWays
    ) -> dict[str, Any] | None:
        """A browser's stop of a call no worker connected here owns
        (:mod:`kernel_ext.relay.stops`): the answer when this delivery reaches its worker
        another way, else ``None`` (here: none). ``running``: this process holds a running
        stream of it."""
        return None

    def serve_stops(self, ways: StopWays) -> None:
        """Answer the stops other web processes forward for this process's workers, if this
        delivery reaches other web processes. Idempotent."""

    def start(self) -> None:
        """Start what delivers, if it starts later by itself (at start-up). Idempotent."""

    async def aclose(self) -> None:
        """Stop what the delivery runs (when the server stops). Idempotent."""


class _Local(Delivery):
    """python-socketio's in-process ``AsyncManager`` itself: each block queued to its
    browsers' connections in the step that picks them, one after the other."""

    concurrent = False

    async def block(
        self, raw: Any, room: str, data: bytes | None = None, skip: list[str] | None = None
    ) -> None:
        self.hold(room, raw, data)
        await send_local(self.server, self.namespace, TOOL_EVENT_STREAM, raw, room, skip)


class _Published(Delivery):
    """A python-socketio pub/sub manager: each block published after the one before; no
    browser skipped (they may be on other web processes)."""

    reserves = False
    concurrent = False


@functools.singledispatch
def _library_delivery(manager: Any) -> type[Delivery]:
    return _Local if local_sends(manager) else Delivery


@_library_delivery.register
def _(manager: AsyncPubSubManager) -> type[Delivery]:
    return _Published


def delivery_for(emit: Emit, server: Any, namespace: str, memory: ReplayMemory | None) -> Delivery:
    """The delivery of ``server``'s client manager for the relay of ``namespace`` (``emit``:
    its own): the manager's (its ``relay_delivery(emit, server, namespace, memory)``) or
    python-socketio's (module docstring)."""
    manager = server.manager
    offered = getattr(manager, "relay_delivery", None)
    if offered is not None:
        delivery: Delivery = offered(emit, server, namespace, memory)
        return delivery
    return _library_delivery(manager)(emit, server, namespace, memory)


async def deliver(
    delivery: Delivery,
    blocks: list[tuple[Any, bytes | None]],
    room: str,
    skips: list[list[str] | None],
) -> None:
    """One ``tool_event_stream`` per block to ``room``, in order (each with its ``skip``)."""
    if len(blocks) > 1 and delivery.concurrent:
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(delivery.block(raw, room, data, skip))
            for (raw, data), skip in zip(blocks, skips, strict=True)
        ]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return
    for (raw, data), skip in zip(blocks, skips, strict=True):
        await delivery.block(raw, room, data, skip)
