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
changed. :func:`disable` flushes the sender (bounded by ``timeout``), stops it and its loop
thread, uninstruments what ``enable`` instrumented, detaches the hub from the processor
and the instrumentor, shuts the processor down (an SDK provider cannot drop a processor;
a shut-down one stops taking tool spans) and restores the previous default hub. It is
idempotent too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernel_ext.emit import (
    DEFAULT_NAMESPACE,
    Emitter,
    LoopbackEmitter,
    RedisEmitter,
)
from kernel_ext.errors import ConfigError
from kernel_ext.stream import StreamHub, set_default_hub

__all__ = ["Enabled", "disable", "enable", "enabled"]

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
    _loop_thread: _LoopThread | None = None
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
) -> Enabled:
    """Wire the worker side (module docstring); return what was set up.

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

        state = Enabled(
            hub=hub,
            emitter=emitter,
            processor=None,
            tracer_provider=provider,
            options=options,
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
        except BaseException:
            _undo(state, timeout=1.0)
            raise
        _state = state
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
            loop.create_task(emitter.start())
        else:
            asyncio.run_coroutine_threadsafe(emitter.start(), loop).result(_START_TIMEOUT)
        return
    thread = _LoopThread()
    state._loop_thread = thread
    state.loop = thread.loop
    emitter.attach(thread.loop)
    thread.run(emitter.start(), _START_TIMEOUT)


def disable(timeout: float = 5.0) -> asyncio.Task[None] | None:
    """Undo :func:`enable` (module docstring). Idempotent.

    When the sender runs on another thread's loop (or the plugin's own loop thread), it is
    flushed for up to ``timeout`` seconds and stopped before this returns. When called on
    the sender's own loop (``enable`` was called from async code), the sender is detached
    at once and its transport closed in a task, which is returned: ``await`` it to wait for
    the close.
    """
    global _state
    with _lock:
        state, _state = _state, None
        if state is not None:
            return _undo(state, timeout)
        return None


def _undo(state: Enabled, timeout: float) -> asyncio.Task[None] | None:
    emitter = state.emitter
    closing: asyncio.Task[None] | None = None
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


def _stop_emitter(state: Enabled, emitter: Emitter, timeout: float) -> asyncio.Task[None] | None:
    loop = state.loop
    if loop is None or loop.is_closed():
        return None
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        consumer = emitter._consumer
        if consumer is not None:
            consumer.close()
        return loop.create_task(emitter.stop(timeout=0))
    if loop.is_running():
        asyncio.run_coroutine_threadsafe(emitter.stop(timeout), loop).result(timeout + 5)
    return None
