"""One call to wire a worker process: ``kernel_ext.enable(...)``, undone by ``disable()``.

:func:`enable` puts together a :class:`~kernel_ext.stream.StreamHub` (the default hub), a
:class:`~kernel_ext.attribution.processor.ToolSpanProcessor` on the tracer provider, the
:class:`~kernel_ext.instrument.ToolRuntimeInstrumentor` on ``targets``, a sender and an
event loop for it. Every setting not given as an argument comes from its ``KERNEL_EXT_*``
variable (:mod:`kernel_ext.settings`).

Guarantees:

* :func:`enable` is idempotent (a second call returns the running :class:`Enabled` and
  warns if its arguments differ); a bad argument or environment value raises
  :class:`~kernel_ext.errors.ConfigError` before anything is changed.
* :func:`disable` (sync code) and ``await`` :func:`adisable` (async code) flush the sender
  (bounded by ``timeout``), stop it, undo what ``enable`` did and restore the previous
  default hub. Both are idempotent.
* Shutdown flushes on every path, within ``timeout`` (default 5 s): ``adisable``, a sync
  ``disable`` on the sender's own loop (it warns and returns the flush task), normal
  interpreter exit (``atexit``) and ``SIGTERM`` (unless ``handle_sigterm=False`` or the
  application has its own handler: flush, then terminate as the default action would);
  what stays unsent is counted and logged.

Design: docs/contracts.md, "Wiring the worker".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import CallSink, Tap
from kernel_ext.emit import Emitter, LoopbackEmitter, RedisEmitter
from kernel_ext.errors import ConfigError, check_positive_numbers
from kernel_ext.instrument import Describe, ToolRuntimeInstrumentor, ToolTarget
from kernel_ext.settings import Settings, env_name, load_settings
from kernel_ext.stream import StreamHub, set_default_hub
from kernel_ext.worker._fork import call_in_child
from kernel_ext.worker._shutdown import (
    LoopThread,
    SigtermFlush,
    at_exit,
    at_multiprocessing_start,
    forking_for_multiprocessing,
    in_multiprocessing_child,
)

__all__ = ["Enabled", "adisable", "disable", "enable", "enabled"]

logger = logging.getLogger(__name__)

_START_TIMEOUT = 10.0


@dataclass
class Enabled:
    """What :func:`enable` set up (read-only for callers)."""

    hub: StreamHub
    emitter: Emitter | None
    processor: ToolSpanProcessor
    tracer_provider: TracerProvider
    instrumentor: ToolRuntimeInstrumentor
    instrumented: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    options: dict[str, Any] = field(default_factory=dict)
    timeout: float = 5.0
    _loop_thread: LoopThread | None = None
    _sigterm: SigtermFlush | None = None
    _previous_hub: StreamHub | None = None
    _previous_sink: CallSink | None = None


_state: Enabled | None = None
_lock = threading.RLock()


def enabled() -> Enabled | None:
    """What :func:`enable` set up, or ``None`` when the plugin is not enabled."""
    return _state


def _sdk_provider(tracer_provider: TracerProvider | None) -> TracerProvider:
    """The provider to hang the processor on: given, global SDK, or a private SDK one."""
    if tracer_provider is not None:
        if not hasattr(tracer_provider, "add_span_processor"):
            raise ConfigError(
                "tracer_provider must be an OpenTelemetry SDK TracerProvider, got "
                f"{type(tracer_provider).__name__}"
            )
        return tracer_provider
    current = trace.get_tracer_provider()
    if hasattr(current, "add_span_processor"):
        return cast(TracerProvider, current)
    logger.info(
        "kernel_ext: no SDK tracer provider installed; tool spans use a private one "
        "(they get span ids for attribution but are exported nowhere)"
    )
    return TracerProvider()


def _emitter_from(
    settings: Settings, hub: StreamHub, options: Mapping[str, Any] | None
) -> Emitter | None:
    """The sender the settings name: loopback to the relay URL, else Redis, else none."""
    if settings.relay_url:
        secret = settings.secret_value()
        if not secret:
            raise ConfigError(f"a relay URL needs the internal secret ({env_name('secret')})")
        return LoopbackEmitter(
            settings.relay_url,
            secret,
            hub=hub,
            namespace=settings.namespace,
            **dict(options or {}),
        )
    if settings.redis_url:
        return RedisEmitter(
            settings.redis_url,
            hub=hub,
            channel=settings.redis_channel,
            namespace=settings.namespace,
            **dict(options or {}),
        )
    return None


def enable(
    *,
    relay_url: str | None = None,
    secret: str | None = None,
    redis_url: str | None = None,
    redis_channel: str | None = None,
    namespace: str | None = None,
    emitter: Emitter | None = None,
    hub: StreamHub | None = None,
    max_running_per_second: float | None = None,
    max_streams: int | None = None,
    max_queue: int | None = None,
    targets: Iterable[str | ToolTarget] | None = None,
    describe: Describe | None = None,
    tracer_provider: TracerProvider | None = None,
    tap: Tap | None = None,
    loop: asyncio.AbstractEventLoop | None = None,
    emitter_options: Mapping[str, Any] | None = None,
    handle_sigterm: bool = True,
    shutdown_timeout: float = 5.0,
) -> Enabled:
    """Wire the worker side (module docstring); return what was set up.

    Each of ``relay_url``, ``secret``, ``redis_url``, ``redis_channel``, ``namespace``,
    ``max_running_per_second``, ``max_streams``, ``max_queue`` and ``targets`` that is
    ``None`` (not given) comes from its ``KERNEL_EXT_*`` variable (:mod:`kernel_ext.settings`),
    else its default. ``describe`` comes from ``KERNEL_EXT_DESCRIBE`` only with the targets
    of ``KERNEL_EXT_TARGETS``.

    ``handle_sigterm``: flush on ``SIGTERM`` (module docstring). ``shutdown_timeout``: how
    long the ``atexit`` and ``SIGTERM`` paths wait for the sender.

    ``hub`` replaces the stream-rule arguments. ``targets``/``describe`` are handed to the
    instrumentor (no targets: nothing is wrapped, an already instrumented runtime just gets
    the hub as its sink). ``emitter_options`` go to the emitter made from a URL.

    Raises:
        ConfigError: a bad argument or environment value; nothing was changed then.
    """
    global _state
    targets = tuple(targets) if targets is not None else None
    with _lock:
        options = _given(
            relay_url=relay_url,
            redis_url=redis_url,
            emitter=emitter,
            hub=hub,
            targets=targets,
            tracer_provider=tracer_provider,
        )
        if _state is not None:
            if options and options != {k: _state.options.get(k) for k in options}:
                logger.warning("kernel_ext.enable: already enabled; call disable() first")
            return _state
        # Configuration: may raise ConfigError, with nothing changed yet.
        settings = load_settings(
            relay_url=relay_url,
            secret=secret,
            redis_url=redis_url,
            redis_channel=redis_channel,
            namespace=namespace,
            max_running_per_second=max_running_per_second,
            max_streams=max_streams,
            max_queue=max_queue,
        )
        check_positive_numbers(shutdown_timeout=shutdown_timeout)
        hub, emitter = _hub_and_sender(settings, hub, emitter, tap, emitter_options)
        if targets is None and settings.targets:
            targets = settings.targets
            describe = describe or settings.describe_hook()
        state = _planned(hub, emitter, tap, tracer_provider, options, shutdown_timeout)
        # Wiring: undone as a whole if any step fails.
        _wire(state, targets, describe, loop, handle_sigterm)
        _state = state
        at_exit(_at_exit)
        at_multiprocessing_start(_in_multiprocessing_child, _at_exit)
        return state


def _given(**arguments: Any) -> dict[str, Any]:
    """The arguments of :func:`enable` that tell one setup from another, those given."""
    return {name: value for name, value in arguments.items() if value is not None}


def _hub_and_sender(
    settings: Settings,
    hub: StreamHub | None,
    emitter: Emitter | None,
    tap: Tap | None,
    emitter_options: Mapping[str, Any] | None,
) -> tuple[StreamHub, Emitter | None]:
    """The hub (given, the given emitter's, or new with the settings' stream rules) and the
    sender (given, attached to that hub, or made from the settings' URLs; may be none)."""
    if hub is None and emitter is not None:
        hub = emitter.given_hub  # an emitter made for a hub brings it along
    if hub is None:
        hub = StreamHub(
            max_running_per_second=settings.max_running_per_second,
            max_streams=settings.max_streams,
            max_queue=settings.max_queue,
            tap=tap,
        )
    if emitter is None:
        emitter = _emitter_from(settings, hub, emitter_options)
    elif emitter.given_hub is not hub:
        emitter.use_hub(hub)
    return hub, emitter


def _planned(
    hub: StreamHub,
    emitter: Emitter | None,
    tap: Tap | None,
    tracer_provider: TracerProvider | None,
    options: dict[str, Any],
    shutdown_timeout: float,
) -> Enabled:
    """What :func:`enable` is about to set up, nothing of it wired yet."""
    provider = _sdk_provider(tracer_provider)  # may raise ConfigError: first
    instrumentor = ToolRuntimeInstrumentor()
    return Enabled(
        hub=hub,
        emitter=emitter,
        processor=ToolSpanProcessor(tap=tap, sink=hub),
        tracer_provider=provider,
        instrumentor=instrumentor,
        options=options,
        timeout=float(shutdown_timeout),
        _previous_sink=instrumentor.sink,
    )


def _wire(
    state: Enabled,
    targets: Iterable[str | ToolTarget] | None,
    describe: Describe | None,
    loop: asyncio.AbstractEventLoop | None,
    handle_sigterm: bool,
) -> None:
    """Install the hub, the processor, the instrumentation, the sender and its loop, and
    the ``SIGTERM`` flush; if any step raises, undo the steps before it and re-raise."""
    state._previous_hub = set_default_hub(state.hub)
    emitter = state.emitter
    try:
        state.tracer_provider.add_span_processor(state.processor)
        _instrument(state, targets, describe)
        if emitter is None:
            logger.warning(
                "kernel_ext.enable: no sender configured (%s / %s); blocks are counted no_sender",
                env_name("relay_url"),
                env_name("redis_url"),
            )
            return
        _start_emitter(state, emitter, loop)
        if handle_sigterm and not in_multiprocessing_child():
            state._sigterm = SigtermFlush(_sigterm_disable, _sigterm_adisable, state.timeout)
            state._sigterm.install(state.loop)
    except BaseException:
        _undo(state, timeout=1.0)
        raise


def _instrument(
    state: Enabled, targets: Iterable[str | ToolTarget] | None, describe: Describe | None
) -> None:
    """Wrap ``targets`` with the hub as sink; without targets (or when something already
    instrumented the runtime) only attach the hub as the instrumentor's sink."""
    instrumentor = state.instrumentor
    if not targets:
        instrumentor.sink = state.hub
        return
    if instrumentor.is_instrumented_by_opentelemetry:
        logger.warning(
            "kernel_ext.enable: the tool runtime is already instrumented (%s); "
            "not wrapping %s again",
            ", ".join(instrumentor.targets),
            list(targets),
        )
        instrumentor.sink = state.hub
        return
    instrumentor.instrument(
        targets=list(targets),
        describe=describe,
        tracer_provider=state.tracer_provider,
        sink=state.hub,
    )
    state.instrumented = True


def _start_emitter(
    state: Enabled, emitter: Emitter, loop: asyncio.AbstractEventLoop | None
) -> None:
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
    if loop is not None:
        state.loop = loop
        emitter.attach(loop)  # blocks queue from now on
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            emitter.start_soon()
        else:
            asyncio.run_coroutine_threadsafe(emitter.start(), loop).result(_START_TIMEOUT)
        return
    thread = LoopThread()
    state._loop_thread = thread
    state.loop = thread.loop
    emitter.attach(thread.loop)
    thread.run(emitter.start(), _START_TIMEOUT)


def disable(timeout: float = 5.0) -> asyncio.Task[bool] | None:
    """Undo :func:`enable` (module docstring) from sync code. Idempotent.

    The sender is flushed for up to ``timeout`` seconds and stopped before this returns —
    unless this is called on the sender's own event loop (``enable`` was called from async
    code), where it cannot wait: then it warns (use ``await kernel_ext.adisable()``),
    starts the flush as a task and returns it (``await`` it; what it cannot send is counted
    ``unflushed``).
    """
    global _state
    with _lock:
        state, _state = _state, None
        if state is not None:
            return _undo(state, timeout)
        return None


async def adisable(timeout: float = 5.0) -> bool:
    """Undo :func:`enable` from async code, flushing the sender for up to ``timeout``
    seconds without blocking the event loop. Returns whether everything queued was sent
    (and acknowledged) in time; what was not is counted ``unflushed``. Idempotent (``True``
    when not enabled)."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is None:
        return True
    running = asyncio.get_running_loop()
    emitter = state.emitter
    if emitter is not None and state.loop is running:
        stopped = _stop_begins()
        try:
            flushed = await emitter.stop(timeout)
        finally:
            _stop_ends(stopped)
        state.emitter = None  # stopped: _undo has only the rest to do
        _undo(state, timeout)
        return flushed
    # The sender runs on another loop (its thread): wait for it off this loop, then give
    # SIGTERM back here (signal handlers are set and reset on the main thread).
    flushed = await asyncio.to_thread(_undo_flushed, state, timeout)
    _restore_sigterm(state)
    return flushed


_stopping: threading.Event | None = None
"""Set while :func:`disable`/:func:`adisable` stop the sender; the event fires when that
stop is over (from whichever thread ends it)."""


def _stop_begins() -> threading.Event:
    global _stopping
    _stopping = stopped = threading.Event()
    return stopped


def _stop_ends(stopped: threading.Event) -> None:
    global _stopping
    stopped.set()
    if _stopping is stopped:
        _stopping = None


def _sigterm_disable(timeout: float) -> None:
    """The SIGTERM flush of a sync kernel (on a helper thread): :func:`disable` — or, when
    the signal came while a disable was stopping the sender (on the thread the signal
    interrupted, which cannot go on until the handler returns), the end of that stop."""
    stopping = _stopping
    if stopping is not None:
        stopping.wait(timeout + 1)
        return
    disable(timeout)


async def _sigterm_adisable(timeout: float) -> None:
    """The SIGTERM flush of an async kernel: :func:`adisable`, or the end of the stop
    already under way (:func:`_sigterm_disable`)."""
    stopping = _stopping
    if stopping is not None:
        await asyncio.to_thread(stopping.wait, timeout + 1)
        return
    await adisable(timeout)


def _undo_flushed(state: Enabled, timeout: float) -> bool:
    emitter = state.emitter
    _undo(state, timeout, sigterm=False)
    return emitter is None or emitter.last_stop_flushed


def _restore_sigterm(state: Enabled) -> None:
    sigterm, state._sigterm = state._sigterm, None
    if sigterm is not None:
        sigterm.restore()


def _undo(state: Enabled, timeout: float, *, sigterm: bool = True) -> asyncio.Task[bool] | None:
    """Stop the sender (flushing), its loop thread, the instrumentation and the processor;
    then (``sigterm``) give SIGTERM its default back — last, so that a SIGTERM during the
    flush still waits for it."""
    emitter = state.emitter
    closing: asyncio.Task[bool] | None = None
    if emitter is not None:
        try:
            closing = _stop_emitter(state, emitter, timeout)
        except Exception:
            logger.exception("kernel_ext.disable: stopping the sender failed")
    if state._loop_thread is not None:
        state._loop_thread.stop(timeout)
    instrumentor = state.instrumentor
    try:
        if state.instrumented:
            instrumentor.uninstrument()
        if instrumentor.sink is state.hub:
            instrumentor.sink = state._previous_sink
    except Exception:
        logger.exception("kernel_ext.disable: uninstrumenting failed")
    processor = state.processor
    processor.sink = None
    try:
        processor.shutdown()
    except Exception:
        logger.exception("kernel_ext.disable: shutting the span processor down failed")
    set_default_hub(state._previous_hub)
    if sigterm:
        _restore_sigterm(state)
    return closing


def _stop_emitter(state: Enabled, emitter: Emitter, timeout: float) -> asyncio.Task[bool] | None:
    loop = state.loop
    if loop is None or loop.is_closed():
        emitter.abandon("left behind by its closed event loop")
        return None
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        warnings.warn(
            "kernel_ext.disable() was called on the event loop its sender runs on and cannot "
            "wait there for queued blocks; use `await kernel_ext.adisable()` (or await the "
            "task it returns)",
            RuntimeWarning,
            stacklevel=3,
        )
        logger.error(
            "kernel_ext.disable() on the sender's own event loop: the flush runs as a task; "
            "what it cannot send before the loop ends is counted unflushed"
        )
        return loop.create_task(emitter.stop(timeout))
    if loop.is_running():
        stopped = _stop_begins()
        future = asyncio.run_coroutine_threadsafe(emitter.stop(timeout), loop)
        future.add_done_callback(lambda _: stopped.set())  # on the loop's thread
        try:
            future.result(timeout + 5)
        finally:
            _stop_ends(stopped)
    else:
        emitter.abandon("left behind by its stopped event loop")
    return None


_left_by_parent: list[object] = []
"""In a forked child: the parent's sender, loop and loop thread, kept so that nothing of
theirs is finalized here (their sockets and pipes are shared with the parent)."""


def _after_fork_in_child() -> None:
    """In a forked child, once :mod:`kernel_ext.worker._fork` has reset the hubs and taps: the
    plugin stays enabled with a sender of its own — a copy of the parent's
    (:meth:`~kernel_ext.emit.Emitter.forked`) on a new loop thread, starting at once — a
    ``SIGTERM`` flush that is the child's, and a flush when a ``multiprocessing`` child
    ends. Nothing of the parent's sender is touched: it goes on in the parent."""
    global _lock
    _lock = threading.RLock()  # another thread of the parent may have held it
    state = _state
    if state is None:
        return
    parent_sender = state.emitter
    _left_by_parent.append((parent_sender, state.loop, state._loop_thread))
    state.emitter, state.loop, state._loop_thread = None, None, None
    if state._sigterm is not None:
        state._sigterm = state._sigterm.after_fork()
    if forking_for_multiprocessing():
        _in_multiprocessing_child()  # now, not only at its bootstrap: a SIGTERM may come first
    at_multiprocessing_start(_in_multiprocessing_child, _at_exit)
    if parent_sender is None:
        return
    sender = parent_sender.forked()
    if sender is None:
        logger.warning(
            "kernel_ext: in this forked process the sender %s cannot be copied (override "
            "its forked()); blocks are counted no_sender until disable() and enable() here",
            type(parent_sender).__name__,
        )
        return
    thread = LoopThread()
    state._loop_thread, state.loop, state.emitter = thread, thread.loop, sender
    sender.attach(thread.loop)  # blocks queue from now on
    thread.loop.call_soon_threadsafe(sender.start_soon)  # disable() waits for this start


call_in_child(_after_fork_in_child)


def _in_multiprocessing_child() -> None:
    """A process ``multiprocessing`` started: no SIGTERM flush here. A pool's
    ``terminate()`` (which its ``with`` block calls) needs its workers to die at once: a
    worker that flushes first can leave the pool hanging. Its finalizers flush when it
    ends normally (``close()`` and ``join()``)."""
    state = _state
    if state is not None:
        _restore_sigterm(state)


def _at_exit() -> None:
    """The interpreter exits with the plugin still enabled: flush and disable."""
    state = _state
    if state is not None:
        try:
            disable(state.timeout)
        except Exception:
            logger.exception("kernel_ext: disabling at exit failed")
