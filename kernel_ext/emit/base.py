"""The base of every sender: one task that takes from the hub and delivers, one way to count
and to report health.

Every :class:`Emitter` runs one asyncio task on one event loop and is the hub's one attached
sender while it runs. Guarantees common to all senders:

* Blocks of one stream leave in publish order; a kernel ``chat_event`` leaves before blocks
  published after it; nothing here ever raises into tool code (the hub is enqueue-only).
* :meth:`Emitter.stop` flushes within a timeout, then detaches; what it could not send is
  dropped, counted ``unflushed`` and logged at ERROR when it holds terminals.
* Counting: :attr:`Emitter.counts` holds what the sender went through, by event name
  (``disconnects``, ``ack_timeouts``, ``terminal_resends`` …); every increment also goes to
  the OpenTelemetry counter ``kernel_ext.sender.events`` (attributes ``sender`` and
  ``event``). Counting never raises.
* Health: :attr:`Emitter.healthy` says whether the transport is usable right now. Each
  change calls ``on_health(healthy)`` (an exception there is logged, never raised); a change
  outside :meth:`Emitter.stop` is also counted (the sender's ``up_event``/``down_event``)
  and logged in the sender's words.

A sender uses the hub only through its port, :attr:`Emitter.port` (a
:class:`~kernel_ext.stream.SenderPort`): it takes batches from it, and reports there the
blocks that leave (``port.delivered(n)``) and those lost after the hub let them through
(``port.dropped(reason, n, call_id)``, with the reasons of
:mod:`kernel_ext.observability.count_names`; the senders' own are re-exported below).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import logging
import os
import re
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, TypeVar, cast

from kernel_ext._shared.backoff import Backoff
from kernel_ext.errors import ConfigError, check_positive_ints, check_positive_numbers
from kernel_ext.observability import otel_metrics
from kernel_ext.observability._rare_log import RareLog

# The drop reasons counted by the senders, re-exported:
from kernel_ext.observability.count_names import (
    DISCONNECTED,
    NO_LISTENER,
    REDIS_DOWN,
    REJECTED,
    TERMINAL_EXPIRED,
    TERMINAL_OVERFLOW,
)
from kernel_ext.protocol import NAMESPACE, WORKER_ID_PATTERN
from kernel_ext.stream import UNFLUSHED, Outgoing, SenderPort, StreamHub, get_default_hub

__all__ = [
    "DEFAULT_NAMESPACE",
    "DISCONNECTED",
    "NO_LISTENER",
    "REDIS_DOWN",
    "REJECTED",
    "TERMINAL_EXPIRED",
    "TERMINAL_OVERFLOW",
    "Emitter",
    "backoff",
    "check_worker_id",
    "forked_worker_id",
    "remembers_arguments",
]

logger = logging.getLogger("kernel_ext.emit")
"""The one logger of the senders (``kernel_ext.emit``)."""
rare = RareLog(logger)
"""The senders' log of what may repeat often (``rare(event, message, *args)``: its 1st, 2nd,
4th … occurrence of each event, :class:`~kernel_ext.observability._rare_log.RareLog`)."""

DEFAULT_NAMESPACE = NAMESPACE


def check_worker_id(given: str | None) -> str:
    """``given`` (checked against ``protocol.WORKER_ID_PATTERN``), else a random id.

    Deliberately not read from the environment: the id must differ from one process run to
    the next. A process restarted under its predecessor's id would be taken for the old one
    reconnecting, and the streams the old one left open would stay open for as long as the
    new one lives; under a new id it can still end them (the relay hands a stream to whoever
    sends its next block), and the rest are ended after the grace period.

    Raises:
        ConfigError: ``given`` is not a valid worker id.
    """
    if given is None:
        return uuid.uuid4().hex
    if not isinstance(given, str) or re.fullmatch(WORKER_ID_PATTERN, given) is None:
        raise ConfigError(
            "worker_id must be 1-128 characters of letters, digits and ._:@- (starting with "
            f"a letter or digit), got {given!r}"
        )
    return given


def forked_worker_id(parent: str) -> str:
    """The worker id of a forked child whose parent's sender was given ``parent``: the
    parent's id and the child's pid (``"api.12345"``), within the pattern's 128 characters.
    A child never reuses its parent's id (the relay would take the two for one worker)."""
    suffix = f".{os.getpid()}"
    return parent[: 128 - len(suffix)] + suffix


_Init = TypeVar("_Init", bound=Callable[..., None])


def remembers_arguments(init: _Init) -> _Init:
    """Decorate a sender's ``__init__`` so that :meth:`Emitter.forked` can make another
    sender like it. A subclass that defines an ``__init__`` of its own is not remembered
    (its arguments are not these); it overrides :meth:`Emitter.forked` if it can."""

    @functools.wraps(init)
    def wrapper(self: Emitter, *args: Any, **kwargs: Any) -> None:
        if type(self).__init__ is wrapper:
            self._arguments = (args, kwargs)
        init(self, *args, **kwargs)

    return cast(_Init, wrapper)


def backoff(**delays: float) -> Backoff:
    """The :class:`~kernel_ext._shared.backoff.Backoff` between two delays given by their argument
    names, first and longest (``backoff(reconnect_delay=0.1, reconnect_delay_max=5.0)``).

    Raises:
        ConfigError: naming the arguments, when they do not make a backoff.
    """
    check_positive_numbers(**delays)
    (first_name, first), (longest_name, longest) = delays.items()
    try:
        return Backoff(first, longest)
    except ConfigError as exc:
        raise ConfigError(f"{first_name}, {longest_name}: {exc}") from None


class Emitter(abc.ABC):
    """Base of the senders: one task that takes batches from the hub and sends them.

    Args:
        hub: the hub to consume (default: :func:`~kernel_ext.stream.get_default_hub` at
            :meth:`attach` time).
        batch_max: items taken from the hub at once.
        on_health: called with the new state on every change of :attr:`healthy`.

    Subclasses implement :meth:`_send` (and optionally :meth:`_open`, :meth:`_close`,
    :meth:`_ready`, :meth:`_pending`, :meth:`_abandon_pending`), name themselves in
    :attr:`sender`, and report their transport's state with :meth:`_set_healthy`.
    """

    sender: ClassVar[str] = "emitter"
    """The ``sender`` attribute of this sender's ``kernel_ext.sender.events``."""
    up_event: ClassVar[str | None] = None
    """The event counted when :attr:`healthy` turns true (outside :meth:`stop`)."""
    down_event: ClassVar[str | None] = None
    """The event counted when :attr:`healthy` turns false (outside :meth:`stop`)."""
    _arguments: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    """How this sender was made (:func:`remembers_arguments`), for :meth:`forked`."""

    def __init__(
        self,
        *,
        hub: StreamHub | None = None,
        batch_max: int = 256,
        on_health: Callable[[bool], None] | None = None,
    ) -> None:
        check_positive_ints(batch_max=batch_max)
        self._hub = hub
        self.batch_max = batch_max
        self._on_health = on_health
        self.counts: Counter[str] = Counter()
        """What this sender went through, by event name (module docstring)."""
        self._healthy = True
        self._consumer: SenderPort | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._busy = False
        self._flushed_at_stop = True  # what the last stop() returned
        self._starting: asyncio.Task[None] | None = None  # start_soon()'s task
        self._watcher: asyncio.Task[None] | None = None  # the transport's own task
        self._wakeup = asyncio.Event()  # cuts the watcher's current pause short

    @property
    def hub(self) -> StreamHub:
        """The hub this emitter consumes (the process-wide one unless it was given one)."""
        if self._hub is None:
            self._hub = get_default_hub()
        return self._hub

    @property
    def port(self) -> SenderPort:
        """The hub's port this sender takes from and reports to (:class:`SenderPort`: a
        sender uses nothing else of the hub), from :meth:`attach` on; after :meth:`stop` the
        last one, so that what was taken can still be reported.

        Raises:
            RuntimeError: before :meth:`attach`.
        """
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError(f"{type(self).__name__}: not attached to a hub yet")
        return consumer

    @property
    def given_hub(self) -> StreamHub | None:
        """The hub this emitter was made for, or ``None`` (then :attr:`hub` is the default)."""
        return self._hub

    def use_hub(self, hub: StreamHub) -> None:
        """Consume ``hub`` from now on (before :meth:`attach`/:meth:`start`)."""
        self._hub = hub

    def forked(self) -> Emitter | None:
        """A new sender like this one, for a process forked from this one: the same
        arguments and hub, its own connection (not started; a worker id given to this one
        becomes :func:`forked_worker_id` of it, a random one stays random). ``None`` when
        this sender cannot tell how it was made (a subclass with an ``__init__`` of its
        own, which may override this)."""
        if self._arguments is None:
            return None
        args, kwargs = self._arguments
        kwargs = dict(kwargs)
        if kwargs.get("worker_id") is not None:
            kwargs["worker_id"] = forked_worker_id(kwargs["worker_id"])
        return type(self)(*args, **kwargs)

    @property
    def last_stop_flushed(self) -> bool:
        """What the last :meth:`stop` returned (``True`` before any)."""
        return self._flushed_at_stop

    @property
    def running(self) -> bool:
        """Whether the send task is running."""
        return self._task is not None and not self._task.done()

    @property
    def healthy(self) -> bool:
        """Whether the transport is usable right now."""
        return self._healthy

    # -- counting and health (the one mechanism of every sender) -------------------------

    def _count(self, event: str, n: int = 1) -> None:
        """Count ``n`` of ``event`` in :attr:`counts` and in ``kernel_ext.sender.events``;
        never raises."""
        self.counts[event] += n
        with contextlib.suppress(Exception):  # a broken meter provider must not stop a sender
            otel_metrics.sender_events.add(n, {"sender": self.sender, "event": event})

    def _set_healthy(self, healthy: bool, why: object = None) -> bool:
        """Record the transport's state; on a change (``False`` when there was none): count
        it and log it (:meth:`_health_message`) unless stopping, then call ``on_health``."""
        if healthy == self._healthy:
            return False
        self._healthy = healthy
        if not self._stopping:
            event = self.up_event if healthy else self.down_event
            if event is not None:
                self._count(event)
            level, message, args = self._health_message(healthy, why)
            logger.log(level, message, *args)
        if self._on_health is not None:
            try:
                self._on_health(healthy)
            except Exception:
                logger.exception("emitter: on_health callback failed")
        return True

    def _health_message(self, healthy: bool, why: object) -> tuple[int, str, tuple[object, ...]]:
        """``(level, message, args)`` logged for a change of :attr:`healthy`."""
        if healthy:
            return logging.INFO, "%s emitter: healthy", (self.sender,)
        return logging.WARNING, "%s emitter: unhealthy (%s)", (self.sender, why)

    # -- the task -------------------------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Attach to the hub as its one sender on ``loop`` (default: the running loop), so
        blocks are queued from now on, before :meth:`start` runs. May be called from any
        thread."""
        if self._consumer is None or self._consumer.closed:
            self._loop = loop if loop is not None else asyncio.get_running_loop()
            self._consumer = self.hub.attach_sender(self._loop)

    async def start(self) -> None:
        """Attach (if not yet) and start the send task on the running loop. Idempotent."""
        if self.running:
            return
        self._stopping = False
        self.attach(asyncio.get_running_loop())
        await self._open()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def start_soon(self) -> asyncio.Task[None]:
        """Attach now and :meth:`start` in a task of the running loop (for sync code running
        on the loop); :meth:`stop` waits for that start before it flushes."""
        self.attach(asyncio.get_running_loop())
        self._starting = asyncio.get_running_loop().create_task(self.start())
        return self._starting

    async def stop(self, timeout: float = 5.0) -> bool:
        """Send what is queued (terminals awaiting acknowledgement included) for up to
        ``timeout`` seconds, then stop the task, detach from the hub and close the
        transport. Returns whether everything was sent (and acknowledged) in time; what was
        not is dropped, counted ``unflushed`` and logged at ERROR when it holds terminals —
        also when this is cancelled (the event loop closing). Idempotent."""
        flushed = True
        try:
            starting, self._starting = self._starting, None
            if starting is not None and not starting.done():
                await asyncio.wait_for(asyncio.shield(starting), timeout)
            if self._task is not None and not self._task.done():
                flushed = await self.flush(timeout)
        finally:
            if self.abandon("stopped") and flushed:
                flushed = False
            self._flushed_at_stop = flushed
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.exception("emitter task failed")
        await self._close()
        return flushed

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the hub's queue is empty and nothing awaits an acknowledgement;
        ``True`` when that happened within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            consumer = self._consumer
            queued = consumer.queue_size if consumer is not None else 0
            if not queued and not self._busy and not self._pending():
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.005)  # polling with a deadline

    def abandon(self, why: str) -> int:
        """Stop taking from the hub; drop (count ``unflushed``) what is queued and what awaits
        delivery, logging ``why`` with the loss. For when :meth:`stop` cannot run (its event
        loop is gone). Returns how many blocks that was."""
        self._stopping = True
        lost = 0
        consumer = self._consumer
        if consumer is not None and not consumer.closed:
            lost += consumer.queue_size
            consumer.close(UNFLUSHED)  # the hub counts what was queued, logs its terminals
        pending = self._abandon_pending()
        if pending:
            self.port.dropped(UNFLUSHED, pending)
            logger.error(
                "emitter %s: %d terminal(s) not confirmed delivered are given up", why, pending
            )
        return lost + pending

    async def __aenter__(self) -> Emitter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        # Until the transport's first attempt is over, blocks wait in the hub's bounded
        # queue instead of being dropped as "disconnected".
        try:
            await self._ready()
            while not consumer.closed:
                items = await consumer.get(self.batch_max)
                self._busy = True
                try:
                    await self._send(items)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    rare("send_error", "emitter: sending a batch failed", exc_info=True)
                finally:
                    self._busy = False
        except asyncio.CancelledError:
            if not self._stopping:  # not stop(): the event loop is ending under the sender
                logger.error(
                    "emitter: its event loop is closing while it runs; what is queued is "
                    "lost — await kernel_ext.adisable() (or emitter.stop()) before the loop "
                    "ends"
                )
                self.abandon("cancelled")
            raise

    # -- for subclasses -------------------------------------------------------------------

    @abc.abstractmethod
    async def _send(self, items: list[Outgoing]) -> None:
        """Deliver ``items`` (publish order); ``[]`` means "woken, check your state"."""

    async def _open(self) -> None:
        """Start the transport (called by :meth:`start`, before the send task)."""
        return None  # optional hook: nothing to do by default

    async def _close(self) -> None:
        """Close the transport (called by :meth:`stop`)."""
        return None  # optional hook: nothing to do by default

    async def _ready(self) -> None:
        """Return once the transport's first connection attempt is over (either way)."""
        return None  # optional hook: nothing to do by default

    # -- the transport's own task (a connect loop, a health monitor) ----------------------

    def _start_watcher(self, watch: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``watch()`` as the transport's own task until :meth:`_stop_watcher`."""
        self._wakeup = asyncio.Event()
        self._watcher = asyncio.get_running_loop().create_task(watch())

    async def _stop_watcher(self) -> None:
        """Stop (and wait for) the task of :meth:`_start_watcher`; from now on the sender is
        stopping."""
        self._stopping = True
        self._wakeup.set()
        task, self._watcher = self._watcher, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less when something sets the wake-up event."""
        self._wakeup.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), seconds)

    def _pending(self) -> int:
        """Items held back by the transport (e.g. terminals awaiting acknowledgement)."""
        return 0

    def _abandon_pending(self) -> int:
        """Forget what :meth:`_pending` counts (at stop); return how many."""
        return 0
