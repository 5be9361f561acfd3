"""The wrapt wrappers of :class:`~kernel_ext.instrument.ToolRuntimeInstrumentor`, one per
function kind.

The kind — sync function, coroutine function, generator function, async generator
function — is read from the target when it is wrapped (:func:`kind_of`). When the wrapped
function is called, its wrapper

* passes the call through untouched (no span, no contextvar) when its wrapping was undone
  (``uninstrument()`` while another wrapper sat on top of ours) or when OpenTelemetry's
  instrumentation is suppressed in the caller's context
  (``opentelemetry.instrumentation.utils.suppress_instrumentation()``);
* otherwise attributes it (:mod:`kernel_ext.instrument._call`): a sync function or a
  coroutine for the duration of the call; a generator or async generator over its whole
  iteration (from the first step to exhaustion, error or close), with the call active
  around each step only, because a generator's frame runs in its consumer's context.

Arguments, values sent in, values thrown in, yielded and returned values and exceptions
pass through unchanged — but for a call that was stopped (:func:`kernel_ext.stop_call`): a
sync function or a coroutine then returns :meth:`ActiveCall.stopped_result` (shaped by the
target's ``stopped_as``) instead of its value or its exception (a coroutine's task is
cancelled by the stop and the cancellation caught here); a generator's values pass
unchanged (only its end reads as stopped). What a sync function or a coroutine returns, and
a generator's return value, is what the call is said to have returned
(:meth:`ActiveCall.returned`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Any, TypeVar

from opentelemetry.context import get_current
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.trace import Tracer

from kernel_ext._shared.compat import SUPPRESS_KEYS
from kernel_ext.instrument._call import (
    ActiveCall,
    Describe,
    SinkOf,
    StoppedAs,
    begin_described,
    log,
)
from kernel_ext.observability._rare_log import RareLog

__all__ = ["Wrapper", "Wrapping", "kind_of", "make_wrapper"]

_T = TypeVar("_T")

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
"""A wrapt wrapper: ``wrapper(wrapped, instance, args, kwargs)``."""


class Wrapping:
    """One wrapped target and what undoing it needs. ``active`` turns false when it is
    undone; its wrapper then passes calls through."""

    __slots__ = ("active", "attribute", "original", "owner", "target", "wrapper")

    def __init__(self, target: str, owner: Any, attribute: str, original: Any) -> None:
        self.target = target
        self.owner = owner
        self.attribute = attribute
        self.original = original
        self.wrapper: Any = None
        self.active = True


def kind_of(function: Any) -> str:
    """``"sync"``, ``"async"``, ``"generator"`` or ``"async_generator"``: how ``function``
    (or the function of a ``staticmethod``/``classmethod``) runs."""
    if isinstance(function, (staticmethod, classmethod)):
        function = function.__func__
    if inspect.isasyncgenfunction(function):
        return "async_generator"
    if inspect.iscoroutinefunction(function):
        return "async"
    if inspect.isgeneratorfunction(function):
        return "generator"
    return "sync"


def make_wrapper(
    wrapping: Wrapping,
    kind: str,
    describe: Describe,
    tracer: Tracer,
    sink_of: SinkOf,
    stopped_as: StoppedAs | None = None,
) -> Wrapper:
    """The wrapt wrapper for one target of function ``kind`` (module docstring); a stopped
    call's result shaped by ``stopped_as``, if given. Its faults are logged rarely, counted
    per wrapping."""
    rare = RareLog(log)
    # The other kinds begin later (the first step, the first await), in the context of then;
    # a sync call is run by the wrapper itself (one frame less per call).
    runner = _RUNS.get(kind)
    run = (
        functools.partial(runner, _Begin(tracer, describe, rare, sink_of, stopped_as))
        if runner is not None
        else None
    )
    deactivate = ActiveCall.deactivate
    # Suppressed (OpenTelemetry's suppress_instrumentation()): read from the context the
    # call is described in, when the probe found its keys; else asked the public way.
    key, plain = SUPPRESS_KEYS if SUPPRESS_KEYS is not None else ("", "")
    public = SUPPRESS_KEYS is None

    def wrapper(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        current = get_current()
        if (
            not wrapping.active
            or current.get(key)
            or current.get(plain)
            or (public and not is_instrumentation_enabled())
        ):
            return wrapped(*args, **kwargs)
        if run is not None:
            return run(wrapped, instance, args, kwargs)
        # A sync call begins now, in this context: begin() gets the context looked up here.
        active = begin_described(tracer, describe, rare, sink_of, instance, args, kwargs, current)
        if active is None:
            return wrapped(*args, **kwargs)
        # `with active:`, spelled out: two special-method calls from C fewer per call.
        tokens = active.activate()
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as error:
            deactivate(tokens)
            active.finish(error)
            if active.stopped and isinstance(error, Exception):
                return active.stopped_result(stopped_as, instance, args, kwargs)
            raise
        deactivate(tokens)
        active.result = result
        active.finish(None)
        if active.stopped:
            return active.stopped_result(stopped_as, instance, args, kwargs)
        return result

    return wrapper


class _Begin:
    """:func:`begin_described` with one wrapping's hook, tracer, log and sink."""

    __slots__ = ("describe", "rare", "sink_of", "stopped_as", "tracer")

    def __init__(
        self,
        tracer: Tracer,
        describe: Describe,
        rare: RareLog,
        sink_of: SinkOf,
        stopped_as: StoppedAs | None = None,
    ) -> None:
        self.tracer = tracer
        self.describe = describe
        self.rare = rare
        self.sink_of = sink_of
        self.stopped_as = stopped_as

    def __call__(
        self, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ActiveCall | None:
        return begin_described(
            self.tracer, self.describe, self.rare, self.sink_of, instance, args, kwargs
        )


async def _run_async(
    begin: _Begin,
    wrapped: Callable[..., Awaitable[_T]],
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:  # what the call returned, or a stopped call's result
    active = begin(instance, args, kwargs)
    if active is None:
        return await wrapped(*args, **kwargs)
    # _call.run_stoppable, spelled out (one frame and one closure fewer per call).
    active.watch()
    try:
        with active:
            result = active.returned(await wrapped(*args, **kwargs))
    except asyncio.CancelledError:
        if not active.stop_caught():
            raise
        return active.stopped_result(begin.stopped_as, instance, args, kwargs)
    except Exception:
        if not active.stopped:
            raise
        return active.stopped_result(begin.stopped_as, instance, args, kwargs)
    active.settle()
    if active.stopped:
        return active.stopped_result(begin.stopped_as, instance, args, kwargs)
    return result


def _run_generator(
    begin: _Begin,
    wrapped: Callable[..., Generator[Any, Any, Any]],
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Generator[Any, Any, Any]:
    active = begin(instance, args, kwargs)
    if active is None:
        return (yield from wrapped(*args, **kwargs))
    with active.ending():  # closed early (GeneratorExit): ends without an error
        return active.returned((yield from _stepped(active, wrapped(*args, **kwargs))))


async def _run_async_generator(
    begin: _Begin,
    wrapped: Callable[..., AsyncGenerator[Any, Any]],
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> AsyncGenerator[Any, Any]:
    active = begin(instance, args, kwargs)
    with active.ending() if active is not None else contextlib.nullcontext():
        # The async twin of _stepped (there is no `yield from` for async generators;
        # the two loops cannot share code across `await`): change both together.
        inner = wrapped(*args, **kwargs)
        to_send: Any = None
        to_throw: BaseException | None = None
        while True:
            tokens = active.activate() if active is not None else None
            try:
                if to_throw is not None:
                    thrown, to_throw = to_throw, None
                    item = await inner.athrow(thrown)
                else:
                    item = await inner.asend(to_send)
            except StopAsyncIteration:
                return
            finally:
                if tokens is not None:
                    ActiveCall.deactivate(tokens)
            try:
                to_send = yield item
            except GeneratorExit:
                tokens = active.activate() if active is not None else None
                try:
                    await inner.aclose()
                finally:
                    if tokens is not None:
                        ActiveCall.deactivate(tokens)
                raise
            except BaseException as exc:
                to_throw = exc


_RUNS: dict[str, Callable[..., Any]] = {
    "async": _run_async,
    "generator": _run_generator,
    "async_generator": _run_async_generator,
}


def _stepped(active: ActiveCall, inner: Generator[Any, Any, _T]) -> Generator[Any, Any, _T]:
    """Delegate to ``inner`` like ``yield from``, with the call active around each step.
    (:func:`_run_async_generator` above is its async twin: change both together.)"""
    to_send: Any = None
    to_throw: BaseException | None = None
    while True:
        tokens = active.activate()
        try:
            if to_throw is not None:
                thrown, to_throw = to_throw, None
                item = inner.throw(thrown)
            else:
                item = inner.send(to_send)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            active.deactivate(tokens)
        try:
            to_send = yield item
        except GeneratorExit:
            tokens = active.activate()
            try:
                inner.close()
            finally:
                active.deactivate(tokens)
            raise
        except BaseException as exc:
            to_throw = exc
