"""One call to wire a worker process: ``kernel_ext.enable(...)``, undone by ``disable()``.

:func:`enable` puts together

1. a :class:`~kernel_ext.stream.StreamHub` with the stream rules, installed as the default
   hub (so :func:`kernel_ext.publish` uses it);
2. a :class:`~kernel_ext.processor.ToolSpanProcessor` on the tracer provider (the given
   one, else the global SDK provider, else a private SDK provider so that tool calls still
   get span ids), with the hub as its sink;
3. the :class:`~kernel_ext.instrument.ToolRuntimeInstrumentor` on ``targets`` (optional),
   with the hub as its sink (it writes the hub's per-call attributes onto each tool span);
4. a sender: ``emitter`` if given, else a :class:`~kernel_ext.emit.LoopbackEmitter` to the
   relay URL, else a :class:`~kernel_ext.emit.RedisEmitter` to the Redis URL, else none
   (blocks are then counted ``no_sender``; a warning is logged);
5. an event loop for the sender: ``loop`` if given, else the running loop when ``enable``
   is called from async code, else a background loop thread (daemon) it owns.

Arguments win over environment variables:

==================================  ==========================================================
``KERNEL_EXT_RELAY_URL``            the web process's base URL (``http://127.0.0.1:8000``)
``KERNEL_EXT_SECRET``               the relay's internal shared secret (with the relay URL)
``KERNEL_EXT_REDIS_URL``            ``redis://…``: emit through Redis instead (no relay URL)
``KERNEL_EXT_REDIS_CHANNEL``        the Socket.IO Redis channel (default ``socketio``)
``KERNEL_EXT_NAMESPACE``            the Socket.IO namespace (default ``/chat``)
``KERNEL_EXT_MAX_RUNNING_PER_SECOND``  running blocks per stream per second (default 10)
``KERNEL_EXT_MAX_STREAMS``          open streams kept (default 10000)
``KERNEL_EXT_MAX_QUEUE``            running blocks queued for the sender (default 10000)
``KERNEL_EXT_TARGETS``              comma-separated tool runtime targets to instrument
``KERNEL_EXT_DESCRIBE``             ``package.module:function``, the targets' describe hook
==================================  ==========================================================

Guarantees: :func:`enable` is idempotent (a second call returns the running
:class:`Enabled` and logs a warning if its arguments differ); a bad argument or
environment value raises :class:`~kernel_ext.errors.ConfigError` before anything is
changed. :func:`disable` (sync code) and ``await`` :func:`adisable` (async code) flush the
sender (bounded by ``timeout``), stop it and its loop thread, uninstrument what ``enable``
instrumented, detach the hub from the processor and the instrumentor, shut the processor
down (an SDK provider cannot drop a processor; a shut-down one stops taking tool spans) and
restore the previous default hub. Both are idempotent.

Shutdown flushes on every path, within ``timeout`` (default 5 s):

* async code: ``await kernel_ext.adisable()`` (like python-socketio's ``await
  disconnect()``); a sync :func:`disable` called on the sender's own event loop cannot wait
  there: it warns (``RuntimeWarning`` and an ERROR log), starts the flush as a task it
  returns (await it) and counts what is still unsent when that task ends or is cancelled
  (``unflushed``);
* normal interpreter exit: an ``atexit`` hook disables a plugin still enabled (the sender's
  thread is still alive then); an async kernel whose event loop ended first gets the loss
  counted and logged instead;
* ``SIGTERM``: unless ``handle_sigterm=False`` or the application has its own handler,
  ``enable`` called on the main thread installs one that flushes (``adisable`` on the
  sender's loop when that is the main thread's running loop, else ``disable``) and then
  terminates the process with ``SIGTERM`` as the default action would have (exit status
  143 in a shell). :func:`disable` puts the previous handler back.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernel_ext.emit import (
    DEFAULT_NAMESPACE,
    Emitter,
    LoopbackEmitter,
    RedisEmitter,
)
from kernel_ext.errors import ConfigError, check_positive_numbers
from kernel_ext.stream import StreamHub, set_default_hub

__all__ = ["Enabled", "adisable", "disable", "enable", "enabled"]

logger = logging.getLogger(__name__)

ENV_RELAY_URL = "KERNEL_EXT_RELAY_URL"
ENV_SECRET = "KERNEL_EXT_SECRET"
ENV_REDIS_URL = "KERNEL_EXT_REDIS_URL"
ENV_REDIS_CHANNEL = "KERNEL_EXT_REDIS_CHANNEL"
ENV_NAMESPACE = "KERNEL_EXT_NAMESPACE"
ENV_MAX_RUNNING = "KERNEL_EXT_MAX_RUNNING_PER_SECOND"
ENV_MAX_STREAMS = "KERNEL_EXT_MAX_STREAMS"
ENV_MAX_QUEUE = "KERNEL_EXT_MAX_QUEUE"
ENV_TARGETS = "KERNEL_EXT_TARGETS"
ENV_DESCRIBE = "KERNEL_EXT_DESCRIBE"

_START_TIMEOUT = 10.0


class _LoopThread:
    """A daemon thread running an event loop for the sender when the kernel has none."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kernel_ext-sender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the thread's loop and wait for it (at most ``timeout`` s)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class Enabled:
    """What :func:`enable` set up (read-only for callers)."""

    hub: StreamHub
    emitter: Emitter | None
    processor: Any
    tracer_provider: Any
    instrumentor: Any = None
    instrumented: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    options: dict[str, Any] = field(default_factory=dict)
    timeout: float = 5.0
    _loop_thread: _LoopThread | None = None
    _sigterm: Any = None
    _previous_hub: StreamHub | None = None
    _previous_sink: Any = None


_state: Enabled | None = None
_lock = threading.RLock()


def enabled() -> Enabled | None:
    """What :func:`enable` set up, or ``None`` when the plugin is not enabled."""
    return _state


def _env_number(name: str, kind: type, default: Any) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a {kind.__name__}, got {raw!r}") from None


def _sdk_provider(tracer_provider: Any) -> Any:
    """The provider to hang the processor on: given, global SDK, or a private SDK one."""
    if tracer_provider is not None:
        if not hasattr(tracer_provider, "add_span_processor"):
            raise ConfigError(
                "tracer_provider must be an OpenTelemetry SDK TracerProvider, got "
                f"{type(tracer_provider).__name__}"
            )
        return tracer_provider
    from opentelemetry import trace

    current = trace.get_tracer_provider()
    if hasattr(current, "add_span_processor"):
        return current
    from opentelemetry.sdk.trace import TracerProvider

    logger.info(
        "kernel_ext: no SDK tracer provider installed; tool spans use a private one "
        "(they get span ids for attribution but are exported nowhere)"
    )
    return TracerProvider()


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
    targets: Iterable[Any] | None = None,
    describe: Callable[..., Any] | None = None,
    tracer_provider: Any = None,
    tap: Any = None,
    loop: asyncio.AbstractEventLoop | None = None,
    emitter_options: Mapping[str, Any] | None = None,
    handle_sigterm: bool = True,
    shutdown_timeout: float = 5.0,
) -> Enabled:
    """Wire the worker side (module docstring); return what was set up.

    ``handle_sigterm``: flush on ``SIGTERM`` (module docstring). ``shutdown_timeout``: how
    long the ``atexit`` and ``SIGTERM`` paths wait for the sender.

    ``hub`` replaces the stream-rule arguments. ``targets``/``describe`` are handed to the
    instrumentor (``KERNEL_EXT_TARGETS``/``KERNEL_EXT_DESCRIBE`` when not given; no
    targets: nothing is wrapped, an already instrumented runtime just gets the hub as its
    sink). ``emitter_options`` go to the emitter made from a URL.

    Raises:
        ConfigError: a bad argument or environment value; nothing was changed then.
    """
    global _state
    with _lock:
        options = {
            k: v
            for k, v in dict(
                relay_url=relay_url,
                redis_url=redis_url,
                emitter=emitter,
                hub=hub,
                targets=tuple(targets) if targets is not None else None,
                tracer_provider=tracer_provider,
            ).items()
            if v is not None
        }
        if _state is not None:
            if options and options != {k: _state.options.get(k) for k in options}:
                logger.warning("kernel_ext.enable: already enabled; call disable() first")
            return _state

        # -- configuration (may raise ConfigError; nothing changed yet) ----------------
        relay_url = relay_url or os.environ.get(ENV_RELAY_URL) or None
        redis_url = redis_url or os.environ.get(ENV_REDIS_URL) or None
        namespace = namespace or os.environ.get(ENV_NAMESPACE) or DEFAULT_NAMESPACE
        if hub is None and emitter is not None:
            hub = emitter._hub  # an emitter made for a hub brings it along
        if hub is None:
            rate = (
                max_running_per_second
                if max_running_per_second is not None
                else _env_number(ENV_MAX_RUNNING, float, 10.0)
            )
            hub = StreamHub(
                max_running_per_second=rate,
                max_streams=max_streams or _env_number(ENV_MAX_STREAMS, int, 10_000),
                max_queue=max_queue or _env_number(ENV_MAX_QUEUE, int, 10_000),
                tap=tap,
            )
        if emitter is None and relay_url:
            secret = secret or os.environ.get(ENV_SECRET) or None
            if not secret:
                raise ConfigError(f"a relay URL needs the internal secret ({ENV_SECRET})")
            emitter = LoopbackEmitter(
                relay_url, secret, hub=hub, namespace=namespace, **dict(emitter_options or {})
            )
        elif emitter is None and redis_url:
            channel = redis_channel or os.environ.get(ENV_REDIS_CHANNEL) or "socketio"
            emitter = RedisEmitter(
                redis_url,
                hub=hub,
                channel=channel,
                namespace=namespace,
                **dict(emitter_options or {}),
            )
        elif emitter is not None and emitter._hub is not hub:
            emitter._hub = hub
        if targets is None:
            raw = os.environ.get(ENV_TARGETS, "")
            env_targets = [t.strip() for t in raw.split(",") if t.strip()]
            targets = env_targets or None
            if targets and describe is None and os.environ.get(ENV_DESCRIBE, "").strip():
                from kernel_ext.instrument import _load_callable

                describe = _load_callable(os.environ[ENV_DESCRIBE].strip(), ENV_DESCRIBE)
        provider = _sdk_provider(tracer_provider)

        # -- wiring ----------------------------------------------------------------------
        from kernel_ext.instrument import ToolRuntimeInstrumentor
        from kernel_ext.processor import ToolSpanProcessor

        check_positive_numbers(shutdown_timeout=shutdown_timeout)
        state = Enabled(
            hub=hub,
            emitter=emitter,
            processor=None,
            tracer_provider=provider,
            options=options,
            timeout=float(shutdown_timeout),
        )
        state._previous_hub = set_default_hub(hub)
        try:
            processor = ToolSpanProcessor(tap=tap, sink=hub)
            provider.add_span_processor(processor)
            state.processor = processor
            instrumentor = ToolRuntimeInstrumentor()
            state.instrumentor = instrumentor
            state._previous_sink = instrumentor.sink
            if targets:
                if instrumentor.is_instrumented_by_opentelemetry:
                    logger.warning(
                        "kernel_ext.enable: the tool runtime is already instrumented (%s); "
                        "not wrapping %s again",
                        ", ".join(instrumentor.targets),
                        list(targets),
                    )
                    instrumentor.sink = hub
                else:
                    instrumentor.instrument(
                        targets=list(targets),
                        describe=describe,
                        tracer_provider=provider,
                        sink=hub,
                    )
                    state.instrumented = True
            else:
                instrumentor.sink = hub
            if emitter is not None:
                _start_emitter(state, emitter, loop)
            else:
                logger.warning(
                    "kernel_ext.enable: no sender configured (%s / %s); blocks are counted "
                    "no_sender",
                    ENV_RELAY_URL,
                    ENV_REDIS_URL,
                )
            if emitter is not None and handle_sigterm:
                _install_sigterm(state)
        except BaseException:
            _undo(state, timeout=1.0)
            raise
        _state = state
        _register_atexit()
        return state


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
    thread = _LoopThread()
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
    _restore_sigterm(state)  # here: signal handlers are set and reset on the main thread
    running = asyncio.get_running_loop()
    emitter = state.emitter
    if emitter is not None and state.loop is running:
        flushed = await emitter.stop(timeout)
        state.emitter = None  # stopped: _undo has only the rest to do
        _undo(state, timeout)
        return flushed
    # The sender runs on another loop (its thread): wait for it off this loop.
    return await asyncio.to_thread(_undo_flushed, state, timeout)


def _undo_flushed(state: Enabled, timeout: float) -> bool:
    emitter = state.emitter
    _undo(state, timeout)
    return emitter is None or emitter._flushed_at_stop


def _undo(state: Enabled, timeout: float) -> asyncio.Task[bool] | None:
    _restore_sigterm(state)
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
    if instrumentor is not None:
        try:
            if state.instrumented:
                instrumentor.uninstrument()
            if instrumentor.sink is state.hub:
                instrumentor.sink = state._previous_sink
        except Exception:
            logger.exception("kernel_ext.disable: uninstrumenting failed")
    processor = state.processor
    if processor is not None:
        processor.sink = None
        try:
            processor.shutdown()
        except Exception:
            logger.exception("kernel_ext.disable: shutting the span processor down failed")
    set_default_hub(state._previous_hub)
    return closing


def _stop_emitter(state: Enabled, emitter: Emitter, timeout: float) -> asyncio.Task[bool] | None:
    loop = state.loop
    if loop is None or loop.is_closed():
        emitter._give_up("left behind by its closed event loop")
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
        asyncio.run_coroutine_threadsafe(emitter.stop(timeout), loop).result(timeout + 5)
    else:
        emitter._give_up("left behind by its stopped event loop")
    return None


# -- shutdown paths: atexit and SIGTERM -----------------------------------------------------

_atexit_registered = False


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_at_exit)
        _atexit_registered = True


def _at_exit() -> None:
    """The interpreter exits with the plugin still enabled: flush and disable."""
    state = _state
    if state is not None:
        try:
            disable(state.timeout)
        except Exception:
            logger.exception("kernel_ext: disabling at exit failed")


def _install_sigterm(state: Enabled) -> None:
    """Flush on SIGTERM (module docstring), if this is the main thread and SIGTERM still has
    its default action."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the application handles SIGTERM: it should call (a)disable itself
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is state.loop:
            running.add_signal_handler(signal.SIGTERM, _on_sigterm_in_loop, running)
            state._sigterm = ("loop", running)
        else:
            signal.signal(signal.SIGTERM, _on_sigterm)
            state._sigterm = ("signal", signal.SIG_DFL)
    except (ValueError, OSError, RuntimeError, NotImplementedError) as exc:
        logger.info("kernel_ext: no SIGTERM flush (%s)", exc)


def _restore_sigterm(state: Enabled) -> None:
    installed, state._sigterm = state._sigterm, None
    if installed is None:
        return
    try:
        kind, value = installed
        if kind == "loop":
            if not value.is_closed():
                value.remove_signal_handler(signal.SIGTERM)  # back to SIG_DFL
        elif signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, value)
    except (ValueError, OSError, RuntimeError) as exc:
        logger.info("kernel_ext: SIGTERM handler not restored (%s)", exc)


def _terminate() -> None:
    """Die of SIGTERM, as its default action would have made us."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM in a sync kernel (the sender on its own thread): flush, then terminate. The
    flush runs on a helper thread, bounded, so a lock the interrupted code holds cannot
    keep the process alive."""
    state = _state
    if state is not None:
        logger.warning("kernel_ext: SIGTERM; flushing the sender (at most %g s)", state.timeout)
        helper = threading.Thread(target=disable, args=(state.timeout,), daemon=True)
        helper.start()
        helper.join(state.timeout + 5)
    _terminate()


def _on_sigterm_in_loop(loop: asyncio.AbstractEventLoop) -> None:
    """SIGTERM in an async kernel whose loop runs the sender: flush there, then terminate."""
    state = _state
    timeout = state.timeout if state is not None else 5.0
    logger.warning("kernel_ext: SIGTERM; flushing the sender (at most %g s)", timeout)

    async def flush_then_terminate() -> None:
        try:
            await adisable(timeout)
        finally:
            _terminate()

    task = loop.create_task(flush_then_terminate())
    _shutdown_tasks.add(task)  # a task nobody references may be collected before it runs
    task.add_done_callback(_shutdown_tasks.discard)


_shutdown_tasks: set[asyncio.Task[None]] = set()
