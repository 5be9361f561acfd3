"""The tool-runtime instrumentor: each tool call gets an ``execute_tool`` span and the contextvar.

:class:`ToolRuntimeInstrumentor` wraps a tool runtime's invoke method, named by a target
string ``"package.module:Class.method"`` (or ``"package.module:function"``), with ``wrapt``.
Around each call it

1. asks the target's *describe hook* ``describe(instance, args, kwargs)`` for a
   :class:`ToolDescription` (tool name, conversation id, the model's tool-call id); a hook
   that returns ``None`` leaves that call alone;
2. makes sure there is an ``execute_tool <name>`` span with the GenAI attributes
   (``gen_ai.operation.name``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
   ``gen_ai.conversation.id``): it *reuses* the current span when the runtime already opened
   the ``execute_tool`` span of this call (same tool name, and same ``gen_ai.tool.call.id``
   when both are known, and not the span of the enclosing active call), and starts an
   ``INTERNAL`` span otherwise;
3. sets the contextvar (:func:`kernel_ext.current_tool_call`) for the duration, with the
   enclosing active call as ``parent``;
4. before the call returns, writes the sink's ``call_attributes(call_id)`` onto the span
   (while it is live, invariant 7), and ends the span if it opened it.

Sync functions, coroutine functions, async generator functions and generator functions
are supported (the kind is read from the target when it is instrumented). For generators
the span covers the whole iteration (from the first step to exhaustion, error or close),
and the contextvar is set around each step, because a generator's frame runs in its
consumer's context. Exceptions propagate unchanged; on a span the instrumentor opened they
are recorded and set the status to ERROR (``Exception`` subclasses, as the OTel SDK does).
Instrumentation itself never raises into the tool: a failing describe hook or tracer is
logged and the call runs unattributed.

:func:`tool_call_scope` gives the same treatment to runtimes that have hooks rather than a
method to wrap (the pydantic-ai integration uses it).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import os
import threading
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Collection,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import contextmanager
from contextvars import Token
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import (  # type: ignore[attr-defined]
    BaseInstrumentor,
)
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider

from kernel_ext._telemetry import RareLog, slot_constructor
from kernel_ext.context import (
    _CURRENT_CALL,
    _CURRENT_CALL_ID,
    CallLife,
    ToolCall,
)
from kernel_ext.errors import ConfigError
from kernel_ext.tap import CallSink, LiveCall

__all__ = [
    "ENV_DESCRIBE",
    "ENV_TARGETS",
    "Describe",
    "ToolDescription",
    "ToolRuntimeInstrumentor",
    "ToolTarget",
    "default_describe",
    "tool_call_scope",
]

_log = logging.getLogger(__name__)
_rare = RareLog(_log)

ENV_TARGETS = "KERNEL_EXT_TARGETS"
"""Comma-separated targets (``package.module:Class.method``) read by ``instrument()``."""
ENV_DESCRIBE = "KERNEL_EXT_DESCRIBE"
"""``package.module:function``: the describe hook for the targets of :data:`ENV_TARGETS`."""

OPERATION = "gen_ai.operation.name"
EXECUTE_TOOL = "execute_tool"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
CONVERSATION_ID = "gen_ai.conversation.id"

_T = TypeVar("_T")
_new_tool_call = slot_constructor(ToolCall)  # half the cost of the frozen dataclass __init__
_new_live_call = slot_constructor(LiveCall)


@dataclass(frozen=True, slots=True)
class ToolDescription:
    """What a describe hook says about one tool call.

    ``tool_name`` names the tool (the span is ``execute_tool <tool_name>``);
    ``conversation_id`` is the conversation (``gen_ai.conversation.id``), ``None`` to
    inherit the enclosing call's; ``llm_call_id`` is the model's tool-call id
    (``gen_ai.tool.call.id``), if any.
    """

    tool_name: str
    conversation_id: str | None = None
    llm_call_id: str | None = None


class Describe(Protocol):
    """``describe(instance, args, kwargs)``: the :class:`ToolDescription` of a call of the
    wrapped method (``instance`` is ``None`` for plain functions), or ``None`` to leave the
    call alone. It runs on every call: keep it cheap; it should not raise (if it does, the
    call runs unattributed and the fault is logged)."""

    def __call__(
        self, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ToolDescription | None: ...


@dataclass(frozen=True, slots=True)
class ToolTarget:
    """One method to wrap: ``target`` is ``"package.module:Class.method"`` (or
    ``"package.module:function"``); ``describe`` its hook (default: the ``describe`` given
    to ``instrument()``, else :func:`default_describe`)."""

    target: str
    describe: Describe | None = None


def default_describe(
    instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ToolDescription | None:
    """A describe hook that guesses from keyword arguments and the instance.

    Tool name: keyword ``tool_name`` or ``name``, else the instance's ``tool_name`` or
    ``name`` attribute, else the instance's class name (``"tool"`` for plain functions).
    Conversation: keyword ``conversation_id``. Model call id: keyword ``tool_call_id``.
    Values that are not non-empty strings are ignored.
    """
    name = _str_or_none(kwargs.get("tool_name")) or _str_or_none(kwargs.get("name"))
    if name is None and instance is not None:
        name = _str_or_none(getattr(instance, "tool_name", None)) or _str_or_none(
            getattr(instance, "name", None)
        )
        if name is None:
            name = type(instance).__name__
    return ToolDescription(
        name or "tool",
        _str_or_none(kwargs.get("conversation_id")),
        _str_or_none(kwargs.get("tool_call_id")),
    )


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


# ---------------------------------------------------------------------------------------
# The attribution of one call: span (found or opened) + contextvar
# ---------------------------------------------------------------------------------------


_Tokens = tuple[
    "Token[otel_context.Context]",
    "Token[ToolCall | None] | None",
    "Token[str | None] | None",
]


class _ActiveCall:
    """One attributed call: its span, whether we opened it, and its :class:`ToolCall`."""

    __slots__ = ("call", "context", "opened", "rare", "span")

    def __init__(
        self,
        span: Span,
        opened: bool,
        call: ToolCall | None,
        context: otel_context.Context,
        rare: RareLog,
    ) -> None:
        self.span = span
        self.opened = opened
        self.call = call
        self.context = context
        self.rare = rare

    def activate(self) -> _Tokens:
        """Make the span current and the call active in this context; return the tokens."""
        otel_token = otel_context.attach(self.context)
        call = self.call
        if call is None:
            return otel_token, None, None
        # set_tool_call() without its ToolCallToken (a NamedTuple costs ~0.3 µs to build).
        return otel_token, _CURRENT_CALL.set(call), _CURRENT_CALL_ID.set(call.call_id)

    @staticmethod
    def deactivate(tokens: _Tokens) -> None:
        """Undo :meth:`activate` (same context, reverse order)."""
        otel_token, call_token, call_id_token = tokens
        if call_id_token is not None:
            _CURRENT_CALL_ID.reset(call_id_token)
        if call_token is not None:
            _CURRENT_CALL.reset(call_token)
        otel_context.detach(otel_token)

    def finish(self, error: BaseException | None, sink: CallSink | None) -> None:
        """End the call: record ``error``, write the sink's call attributes, tell the sink
        the call ended (whether or not its span records: the SDK calls no processor hook
        for a span its sampler dropped), end the span if ours. Never raises."""
        span = self.span
        call = self.call
        try:
            if span.is_recording():
                if error is not None and self.opened and isinstance(error, Exception):
                    span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, _error_text(error)))
                if sink is not None and call is not None:
                    call_attributes = getattr(sink, "call_attributes", None)
                    if call_attributes is not None:
                        attributes = call_attributes(call.call_id)
                        if attributes:
                            span.set_attributes(attributes)
        except Exception:
            self.rare("finish_error", "tool span bookkeeping failed", exc_info=True)
        finally:
            if call is not None:
                call.life.ended = True
                if sink is not None:
                    try:
                        sink.tool_call_ended(
                            _new_live_call(
                                call.call_id,
                                call.tool_name,
                                call.conversation_id,
                                call.llm_call_id,
                                call.parent.call_id if call.parent is not None else None,
                                0,
                            ),
                            None if error is None else _error_text(error),
                        )
                    except Exception:
                        self.rare("finish_error", "sink.tool_call_ended failed", exc_info=True)
            if self.opened:
                try:
                    span.end()
                except Exception:
                    self.rare("finish_error", "tool span could not be ended", exc_info=True)


def _error_text(error: BaseException) -> str | None:
    """How a call's error reads in its span status and its streams' ``aborted`` message:
    ``Type: message`` for an ``Exception``, a fixed text for a cancellation, ``None`` (the
    default message) for other exits (``GeneratorExit``, ``KeyboardInterrupt``)."""
    if isinstance(error, Exception):
        return f"{type(error).__name__}: {error}"
    if isinstance(error, asyncio.CancelledError):
        return "the tool call was cancelled"
    return None


def _begin(tracer: Tracer, description: ToolDescription, rare: RareLog) -> _ActiveCall:
    """Find the runtime's ``execute_tool`` span for this call or start one; build the call."""
    parent = _CURRENT_CALL.get()
    # The current context once, handed on: the tracer and its sampler would each look it
    # up again otherwise (the same context either way).
    current = otel_context.get_current()
    span = trace.get_current_span(current)
    opened = not _is_span_of(span, description, parent)
    conversation_id = description.conversation_id
    llm_call_id = description.llm_call_id
    if opened:
        if conversation_id is None and parent is not None:
            conversation_id = parent.conversation_id
        attributes: dict[str, str] = {OPERATION: EXECUTE_TOOL, TOOL_NAME: description.tool_name}
        if llm_call_id is not None:
            attributes[TOOL_CALL_ID] = llm_call_id
        if conversation_id is not None:
            attributes[CONVERSATION_ID] = conversation_id
        span = tracer.start_span(
            "execute_tool " + description.tool_name,
            current,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
        )
    else:
        span_attributes = getattr(span, "attributes", None) or {}
        if conversation_id is None:
            conversation_id = _str_or_none(span_attributes.get(CONVERSATION_ID))
            if conversation_id is None and parent is not None:
                conversation_id = parent.conversation_id
        if llm_call_id is None:
            llm_call_id = _str_or_none(span_attributes.get(TOOL_CALL_ID))
    span_context = span.get_span_context()
    call: ToolCall | None = None
    if span_context.is_valid:
        call = _new_tool_call(
            span_context.span_id.to_bytes(8, "big").hex(),
            description.tool_name,
            conversation_id,
            llm_call_id,
            parent,
            CallLife(),
        )
    else:
        rare(
            "no_span_id",
            "no valid span for tool %r (no tracer provider?): its call id is unknown, "
            "the contextvar is not set",
            description.tool_name,
        )
    return _ActiveCall(span, opened, call, trace.set_span_in_context(span, current), rare)


def _is_span_of(span: Span, description: ToolDescription, parent: ToolCall | None) -> bool:
    """Is ``span`` the ``execute_tool`` span the runtime opened for this very call?"""
    if not span.is_recording():  # no span, or one we cannot read
        return False
    attributes = getattr(span, "attributes", None)
    if not attributes or attributes.get(OPERATION) != EXECUTE_TOOL:
        return False
    if (
        parent is not None
        and parent.call_id == span.get_span_context().span_id.to_bytes(8, "big").hex()
    ):
        return False  # the enclosing call's span: this is a nested call
    span_llm_call_id = attributes.get(TOOL_CALL_ID)
    if description.llm_call_id is not None and span_llm_call_id is not None:
        return bool(span_llm_call_id == description.llm_call_id)
    return bool(attributes.get(TOOL_NAME) == description.tool_name)


def _safe_begin(
    tracer: Tracer,
    describe: Describe,
    rare: RareLog,
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> _ActiveCall | None:
    """:func:`_begin` for a wrapped call; ``None`` (call runs unattributed) on any fault."""
    try:
        description = describe(instance, args, kwargs)
        if description is None:
            return None
        if not isinstance(description, ToolDescription) or not isinstance(
            description.tool_name, str
        ):
            rare(
                "bad_description",
                "describe hook returned %r, not a ToolDescription; call not attributed",
                type(description).__name__,
            )
            return None
        return _begin(tracer, description, rare)
    except Exception:
        rare("describe_error", "describe hook or tracer failed; call not attributed", exc_info=True)
        return None


@contextmanager
def tool_call_scope(
    description: ToolDescription,
    *,
    tracer_provider: TracerProvider | None = None,
    sink: CallSink | None = None,
) -> Iterator[ToolCall | None]:
    """Attribute the code in the ``with`` block as one tool call, like the instrumentor does.

    Reuses the current span when it is this call's ``execute_tool`` span, starts one
    otherwise (from ``tracer_provider``, default: the global one); sets the contextvar for
    the block; writes ``sink.call_attributes`` on the span before the block ends; an
    exception from the block propagates unchanged (recorded on a span opened here).
    Yields the active :class:`ToolCall` (``None`` when no valid span exists). Use it in the
    task or thread that runs the tool's code; it restores everything in ``finally``.
    """
    try:
        active: _ActiveCall | None = _begin(_tracer(tracer_provider), description, _rare)
    except Exception:
        _rare(
            "describe_error", "tool span could not be started; call not attributed", exc_info=True
        )
        active = None
    if active is None:
        yield None
        return
    tokens = active.activate()
    error: BaseException | None = None
    try:
        yield active.call
    except BaseException as exc:
        error = exc
        raise
    finally:
        active.deactivate(tokens)
        active.finish(error, sink)


@functools.lru_cache(maxsize=16)
def _tracer(tracer_provider: TracerProvider | None) -> Tracer:
    """kernel_ext's tracer from ``tracer_provider`` (None: the global provider, resolved
    lazily by OpenTelemetry's proxy)."""
    from kernel_ext import __version__

    return trace.get_tracer("kernel_ext", __version__, tracer_provider=tracer_provider)


# ---------------------------------------------------------------------------------------
# Wrappers, one per function kind
# ---------------------------------------------------------------------------------------

_Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class _Wrapping:
    """One wrapped target and what undoing it needs."""

    __slots__ = ("active", "attribute", "original", "owner", "target", "wrapper")

    def __init__(self, target: str, owner: Any, attribute: str, original: Any) -> None:
        self.target = target
        self.owner = owner
        self.attribute = attribute
        self.original = original
        self.wrapper: Any = None
        self.active = True


def _make_wrapper(
    wrapping: _Wrapping,
    kind: str,
    describe: Describe,
    tracer: Tracer,
    sink_of: Callable[[], CallSink | None],
) -> _Wrapper:
    """The wrapt wrapper for one target, for its function ``kind``. Its faults are logged
    rarely, counted per wrapping."""
    rare = RareLog(_log)

    def call_sync(
        wrapped: Callable[..., _T], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _T:
        active = (
            _safe_begin(tracer, describe, rare, instance, args, kwargs) if wrapping.active else None
        )
        if active is None:
            return wrapped(*args, **kwargs)
        tokens = active.activate()
        error: BaseException | None = None
        try:
            return wrapped(*args, **kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            active.deactivate(tokens)
            active.finish(error, sink_of())

    async def run_async(
        wrapped: Callable[..., Awaitable[_T]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> _T:
        active = _safe_begin(tracer, describe, rare, instance, args, kwargs)
        if active is None:
            return await wrapped(*args, **kwargs)
        tokens = active.activate()
        error: BaseException | None = None
        try:
            return await wrapped(*args, **kwargs)
        except BaseException as exc:
            error = exc
            raise
        finally:
            active.deactivate(tokens)
            active.finish(error, sink_of())

    def call_async(
        wrapped: Callable[..., Awaitable[_T]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Awaitable[_T]:
        if not wrapping.active:
            return wrapped(*args, **kwargs)
        return run_async(wrapped, instance, args, kwargs)

    def run_generator(
        wrapped: Callable[..., Generator[Any, Any, Any]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Generator[Any, Any, Any]:
        active = _safe_begin(tracer, describe, rare, instance, args, kwargs)
        if active is None:
            return (yield from wrapped(*args, **kwargs))
        error: BaseException | None = None
        try:
            return (yield from _stepped(active, wrapped(*args, **kwargs)))
        except GeneratorExit:
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            active.finish(error, sink_of())

    def call_generator(
        wrapped: Callable[..., Generator[Any, Any, Any]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Generator[Any, Any, Any]:
        if not wrapping.active:
            return wrapped(*args, **kwargs)
        return run_generator(wrapped, instance, args, kwargs)

    async def run_async_generator(
        wrapped: Callable[..., AsyncGenerator[Any, Any]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[Any, Any]:
        active = _safe_begin(tracer, describe, rare, instance, args, kwargs)
        inner = wrapped(*args, **kwargs)
        error: BaseException | None = None
        try:
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
                        _ActiveCall.deactivate(tokens)
                try:
                    to_send = yield item
                except GeneratorExit:
                    tokens = active.activate() if active is not None else None
                    try:
                        await inner.aclose()
                    finally:
                        if tokens is not None:
                            _ActiveCall.deactivate(tokens)
                    raise
                except BaseException as exc:
                    to_throw = exc
        except GeneratorExit:
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if active is not None:
                active.finish(error, sink_of())

    def call_async_generator(
        wrapped: Callable[..., AsyncGenerator[Any, Any]],
        instance: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[Any, Any]:
        if not wrapping.active:
            return wrapped(*args, **kwargs)
        return run_async_generator(wrapped, instance, args, kwargs)

    wrappers: dict[str, _Wrapper] = {
        "sync": call_sync,
        "async": call_async,
        "generator": call_generator,
        "async_generator": call_async_generator,
    }
    return wrappers[kind]


def _stepped(active: _ActiveCall, inner: Generator[Any, Any, _T]) -> Generator[Any, Any, _T]:
    """Delegate to ``inner`` like ``yield from``, with the call active around each step."""
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


def _kind_of(function: Any) -> str:
    if isinstance(function, (staticmethod, classmethod)):
        function = function.__func__
    if inspect.isasyncgenfunction(function):
        return "async_generator"
    if inspect.iscoroutinefunction(function):
        return "async"
    if inspect.isgeneratorfunction(function):
        return "generator"
    return "sync"


def _resolve_target(target: str) -> tuple[Any, str, Any, str]:
    """``"pkg.mod:Class.method"`` → (module, "Class.method", owner, "method")."""
    if not isinstance(target, str) or target.count(":") != 1:
        raise ConfigError(f"target must look like 'package.module:Class.method', got {target!r}")
    module_name, path = target.split(":")
    parts = path.split(".")
    if not module_name or not all(parts):
        raise ConfigError(f"target must look like 'package.module:Class.method', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"target {target!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from exc
    owner: Any = module
    for part in parts[:-1]:
        try:
            owner = getattr(owner, part)
        except AttributeError:
            raise ConfigError(f"target {target!r}: {part!r} not found") from None
    attribute = parts[-1]
    if not hasattr(owner, attribute):
        raise ConfigError(f"target {target!r}: {attribute!r} not found")
    return module, path, owner, attribute


def _load_callable(spec: str, what: str) -> Callable[..., Any]:
    if spec.count(":") != 1:
        raise ConfigError(f"{what} must look like 'package.module:function', got {spec!r}")
    module_name, path = spec.split(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in path.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"{what} {spec!r} cannot be loaded ({type(exc).__name__}: {exc})"
        ) from exc
    if not callable(found):
        raise ConfigError(f"{what} {spec!r} is a {type(found).__name__}, not callable")
    return found  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------
# The instrumentor
# ---------------------------------------------------------------------------------------


class ToolRuntimeInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Wraps tool runtimes' invoke methods so that each call has its ``execute_tool`` span
    and its contextvar (see the module docstring for what happens around a call).

    Like every OpenTelemetry instrumentor it is a process-wide singleton:
    ``ToolRuntimeInstrumentor()`` always returns the same object, so the
    ``opentelemetry-instrument`` entry point, :mod:`kernel_ext.plugin` and user code share
    one set of wrapped targets. ``instrument()`` and ``uninstrument()`` are idempotent (a
    repeated call logs a warning and does nothing); to change targets, ``uninstrument()``
    and ``instrument()`` again.

    ``instrument(**kwargs)``:

    * ``targets``: an iterable of target strings ``"package.module:Class.method"`` (or
      ``"package.module:function"``) and/or :class:`ToolTarget` objects. Without targets,
      the environment is read (below).
    * ``describe``: the describe hook of string targets (default :func:`default_describe`).
    * ``tracer_provider``: where spans go (default: the global provider, resolved lazily).
    * ``sink``: sets :attr:`sink`.

    Raises :class:`~kernel_ext.ConfigError` for a malformed or unknown target or hook;
    nothing is wrapped then.

    Environment (used when ``instrument()`` gets no ``targets``, as from
    ``opentelemetry-instrument``):

    * ``KERNEL_EXT_TARGETS``: comma-separated targets. Unset or empty: nothing happens.
    * ``KERNEL_EXT_DESCRIBE``: ``package.module:function``, the describe hook (optional).

    When targets are configured this way, ``kernel_ext.plugin.enable(targets=...,
    describe=...)`` is called to wire the whole pipeline (processor, stream hub, sender);
    if the plugin is not available, or did not instrument, the targets are wrapped here
    without a sink.

    Wrapping is per attribute: code that imported the function itself (``from mod import
    func``) before instrumenting keeps the unwrapped one. ``uninstrument()`` puts the
    original attribute back (the same object); if something else wrapped the attribute
    after us, our wrapper stays in place but passes calls through untouched.

    :attr:`sink` (a :class:`~kernel_ext.CallSink`, or ``None``) may be set at any time;
    when it has ``call_attributes(call_id)``, those attributes are written on each call's
    span before the call returns.
    """

    sink: CallSink | None
    _wrapped: list[_Wrapping]
    _lock: threading.RLock

    def __init__(self) -> None:
        # The singleton's __init__ runs at every ToolRuntimeInstrumentor(): set up once.
        if "_wrapped" not in self.__dict__:
            self.sink = None
            self._wrapped = []
            self._lock = threading.RLock()

    def instrumentation_dependencies(self) -> Collection[str]:
        """No package requirement: targets are whatever runtime the user names."""
        return ()

    @property
    def targets(self) -> tuple[str, ...]:
        """The targets currently wrapped."""
        return tuple(w.target for w in self._wrapped)

    def _instrument(self, **kwargs: Any) -> None:
        if "sink" in kwargs:
            self.sink = kwargs["sink"]
        tracer_provider: TracerProvider | None = kwargs.get("tracer_provider")
        targets: Iterable[str | ToolTarget] | None = kwargs.get("targets")
        describe: Describe | None = kwargs.get("describe")
        if targets is None:
            self._instrument_from_env(tracer_provider)
            return
        self._wrap(list(targets), describe, tracer_provider)

    def _uninstrument(self, **kwargs: Any) -> None:
        with self._lock:
            wrappings = self._wrapped
            for wrapping in reversed(wrappings):
                _restore(wrapping)
            wrappings.clear()

    def _wrap(
        self,
        targets: Sequence[str | ToolTarget],
        describe: Describe | None,
        tracer_provider: TracerProvider | None,
    ) -> None:
        tracer = _tracer(tracer_provider)
        done: list[_Wrapping] = []
        with self._lock:
            try:
                for target in targets:
                    spec = target if isinstance(target, ToolTarget) else ToolTarget(target)
                    hook = spec.describe or describe or default_describe
                    if not callable(hook):
                        raise ConfigError(
                            f"describe for {spec.target!r} must be callable, "
                            f"got {type(hook).__name__}"
                        )
                    module, path, owner, attribute = _resolve_target(spec.target)
                    original = vars(owner).get(attribute, getattr(owner, attribute))
                    wrapping = _Wrapping(spec.target, owner, attribute, original)
                    wrapper = _make_wrapper(
                        wrapping, _kind_of(original), hook, tracer, self._current_sink
                    )
                    wrapping.wrapper = wrapt.wrap_function_wrapper(module, path, wrapper)
                    done.append(wrapping)
            except BaseException:
                for wrapping in reversed(done):
                    _restore(wrapping)
                raise
            self._wrapped.extend(done)

    def _current_sink(self) -> CallSink | None:
        return self.sink

    def _instrument_from_env(self, tracer_provider: TracerProvider | None) -> None:
        raw = os.environ.get(ENV_TARGETS, "")
        targets = [t.strip() for t in raw.split(",") if t.strip()]
        if not targets:
            _log.debug("%s is not set: no tool runtime instrumented", ENV_TARGETS)
            return
        describe_spec = os.environ.get(ENV_DESCRIBE, "").strip()
        describe: Describe | None = (
            _load_callable(describe_spec, ENV_DESCRIBE) if describe_spec else None
        )
        try:
            plugin: Any = importlib.import_module("kernel_ext.plugin")
        except ModuleNotFoundError as exc:
            if exc.name != "kernel_ext.plugin":
                raise
            plugin = None
        enable = getattr(plugin, "enable", None)
        if enable is not None:
            enable(targets=targets, describe=describe)
        if not self._wrapped:  # no plugin, or it did not instrument
            self._wrap(targets, describe, tracer_provider)
        _log.info("kernel_ext instrumented %s from %s", ", ".join(targets), ENV_TARGETS)


def _restore(wrapping: _Wrapping) -> None:
    """Put the original attribute back if our wrapper is still the attribute; otherwise
    leave the newer wrapper alone and make ours pass calls through."""
    wrapping.active = False
    owner, attribute = wrapping.owner, wrapping.attribute
    if vars(owner).get(attribute) is not wrapping.wrapper:
        _log.warning(
            "%s was re-wrapped after kernel_ext instrumented it; leaving it in place "
            "(kernel_ext's wrapper now passes calls through)",
            wrapping.target,
        )
        return
    unwrap(owner, attribute)
    if vars(owner).get(attribute) is not wrapping.original:
        # unwrap() restores the bound form of classmethods/staticmethods; put back the
        # very object that was there.
        setattr(owner, attribute, wrapping.original)
