"""The attribution of one tool call: its ``execute_tool`` span (found or opened) and the
contextvar, from the call's start to its end.

:func:`begin` turns a :class:`ToolDescription` into an :class:`ActiveCall`:

1. it *reuses* the current span when the runtime already opened the ``execute_tool`` span
   of this call (same tool name, and same ``gen_ai.tool.call.id`` when both are known, and
   not the span of the enclosing active call) — or an OpenInference ``TOOL`` span of this
   call (tool name from ``tool.name``, else its span name; call id from ``tool.id`` or
   ``tool_call.id``; conversation, when the description has none, from ``session.id``) —
   and starts an ``INTERNAL`` span with the
   GenAI attributes (``gen_ai.operation.name``, ``gen_ai.tool.name``,
   ``gen_ai.tool.call.id``, ``gen_ai.conversation.id``) otherwise;
2. the :class:`ActiveCall` makes that span current and the call active (the contextvar,
   with the enclosing active call as ``parent``) while it is entered — once (``with``) or
   around each step of a generator (:meth:`ActiveCall.activate`);
3. its end (:meth:`ActiveCall.finish`: leaving ``with active`` or
   ``with active.ending()``) records an exception on a
   span it opened (``Exception`` subclasses, as the OTel SDK does: status ERROR), writes
   the sink's ``call_attributes(call_id)`` on the span while it is live (invariant 7),
   tells the sink the call ended (whether or not its span records), and ends the span if
   it opened it.

Exceptions propagate unchanged; the bookkeeping itself never raises into the tool: a fault
is logged (rarely) and the call runs on, unattributed when the fault comes before it runs.

:func:`tool_call_scope` is the public form, for runtimes with hooks rather than a method to
wrap; the wrappers (:mod:`kernel_ext.instrument._wrappers`) use :func:`begin_described`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import Token
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
from opentelemetry.semconv.attributes.exception_attributes import (
    EXCEPTION_MESSAGE,
    EXCEPTION_STACKTRACE,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider

from kernel_ext._shared.compat import sampled_trace_id
from kernel_ext._version import __version__
from kernel_ext.attribution._conventions import (
    CONVERSATION_ID,
    EXECUTE_TOOL,
    OI_SESSION,
    OI_TOOL_CALL_ID,
    OI_TOOL_ID,
    OPERATION,
    TOOL_CALL_ID,
    TOOL_NAME,
    attribute_text,
    span_llm_call_id,
    tool_name_from_span_name,
    tool_span_keys,
)
from kernel_ext.attribution.tap import CallSink, LiveCall
from kernel_ext.context import (
    CallLife,
    ToolCall,
    current_tool_call,
    reset_call,
    reset_call_id,
    set_call,
    set_call_id,
    span_id_hex,
)
from kernel_ext.observability._rare_log import RareLog
from kernel_ext.protocol import well_formed
from kernel_ext.stop import STOPPED_MESSAGE, note_end, register, stopped_result, take_running

__all__ = [
    "ActiveCall",
    "Describe",
    "SinkOf",
    "StoppedAs",
    "ToolDescription",
    "begin",
    "begin_described",
    "begin_scope",
    "default_describe",
    "run_stoppable",
    "tool_call_scope",
    "tracer_of",
]

_T = TypeVar("_T")

# One logger for the whole instrumentor package: its faults read as kernel_ext.instrument's.
log = logging.getLogger("kernel_ext.instrument")
_rare = RareLog(log)
_tuple_new = tuple.__new__
# Read once: an attribute of an Enum class goes through EnumType's __getattr__ hook.
_INTERNAL = SpanKind.INTERNAL
STOPPED_ERROR_TYPE = "cancelled"
"""The ``error.type`` of a stopped call's span (its status: ERROR, "stopped by the user")."""


StoppedAs = Callable[..., Any]
"""``stopped_as(instance, args, kwargs, text)``: a stopped call's result the way the wrapped
runtime returns results (:class:`~kernel_ext.instrument.ToolTarget`), built from the call's
own arguments and the stopped result's ``text``. Called only for a stopped call."""

SinkOf = Callable[[], "CallSink | None"]
"""Where a call's end reports to, read when the call ends (a sink may be set meanwhile)."""


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


_Tokens = tuple[
    "Token[otel_context.Context]",
    "Token[ToolCall | None] | None",
    "Token[str | None] | None",
]


class ActiveCall:
    """One attributed call: its span, whether we opened it, and its :class:`ToolCall`
    (``None`` when the span has no valid id: then only the span is made current).

    ``with active:`` activates it for the block and finishes it at the block's end, with
    the block's exception if any (which propagates); the sync wrapper does the same with
    :meth:`activate`, :meth:`deactivate` and :meth:`finish` (no special-method calls on its
    hot path). Generators activate it around each step instead and finish it once, at the
    end of ``with active.ending():``.

    How the call ended is what the sink is told: with the exception that left the block,
    else with the one :meth:`failed` recorded (a runtime that turns the tool's exception
    into its result), else returned — with the value :meth:`returned` recorded (the
    ``done`` text of the streams the hub opened for the call).
    """

    __slots__ = (
        "_tokens",
        "call",
        "context",
        "error",
        "opened",
        "rare",
        "result",
        "sink_of",
        "span",
        "stopped",
    )

    def __init__(
        self,
        span: Span,
        opened: bool,
        call: ToolCall | None,
        context: otel_context.Context,
        rare: RareLog,
        sink_of: SinkOf,
    ) -> None:
        self.span = span
        self.opened = opened
        self.call = call
        self.context = context
        self.rare = rare
        self.sink_of = sink_of
        self._tokens: _Tokens | None = None
        self.error: BaseException | None = None
        self.result: object = None
        self.stopped = False

    def watch(self) -> None:
        """An async runtime, in the task that runs the call's code: a stop
        (:func:`kernel_ext.stop_call`) cancels this task (the runtime then catches the
        cancellation with :meth:`stop_caught`)."""
        call = self.call
        if call is not None:
            call.life.task = asyncio.current_task()

    def stop_caught(self) -> bool:
        """In ``except asyncio.CancelledError`` after the call's block: whether the
        cancellation was the stop's (then the runtime returns :meth:`stopped_result`; the
        task's cancellation is undone, unless something else cancelled it too), else it
        must propagate."""
        call = self.call
        if call is None or not self.stopped or not call.life.cancelling:
            return False
        return self._uncancel(call)

    def settle(self) -> None:
        """After the call's block returned: undo the stop's cancellation of the task when the
        tool's code swallowed it."""
        call = self.call
        if call is not None and call.life.cancelling:
            self._uncancel(call)

    @staticmethod
    def _uncancel(call: ToolCall) -> bool:
        life = call.life
        life.cancelling = False
        task = life.task
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+
        if uncancel is None:
            return True
        return bool(uncancel() == 0)

    def stopped_result(self, shape: StoppedAs | None = None, *arguments: Any) -> Any:
        """The tool result of a stopped call (:func:`kernel_ext.stop.stopped_result`): with
        what the call recorded so far, else what its code returned when it is text; shaped by
        ``shape(*arguments, text)`` when given (its fault: the text itself, logged)."""
        call = self.call
        so_far = call.life.so_far if call is not None else None
        if so_far is None and isinstance(self.result, str):
            so_far = self.result
        text = stopped_result(so_far)
        if shape is None:
            return text
        try:
            return shape(*arguments, text)
        except Exception:
            self.rare("stopped_as_error", "stopped_as hook failed; text returned", exc_info=True)
            return text

    def activate(self) -> _Tokens:
        """Make the span current and the call active in this context; return the tokens."""
        otel_token = otel_context.attach(self.context)
        call = self.call
        if call is None:
            return otel_token, None, None
        # set_tool_call() without its ToolCallToken: no NamedTuple built per call.
        return otel_token, set_call(call), set_call_id(call.call_id)

    @staticmethod
    def deactivate(tokens: _Tokens) -> None:
        """Undo :meth:`activate` (same context, reverse order)."""
        otel_token, call_token, call_id_token = tokens
        if call_id_token is not None:
            reset_call_id(call_id_token)
        if call_token is not None:
            reset_call(call_token)
        otel_context.detach(otel_token)

    def returned(self, result: _T) -> _T:
        """Record what the call's code returned; returns ``result`` (``return
        active.returned(await tool())`` inside ``with active:``)."""
        self.result = result
        return result

    def failed(self, error: BaseException) -> None:
        """Record that the call failed with ``error`` though its block returns normally
        (the runtime turned the exception into the call's result)."""
        self.error = error

    def __enter__(self) -> ToolCall | None:
        self._tokens = self.activate()
        return self.call

    def __exit__(
        self,
        error_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        tokens, self._tokens = self._tokens, None
        if tokens is not None:
            self.deactivate(tokens)
        self.finish(error)

    @contextmanager
    def ending(self) -> Iterator[None]:
        """A context manager that finishes the call when its block ends, with the block's
        exception if any (which propagates), without activating it."""
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.finish(error)

    def finish(self, error: BaseException | None) -> None:
        """End the call — failed with ``error``, else as the class docstring says: record
        the error, write the sink's call attributes, tell the sink the call ended (whether
        or not its span records: the SDK calls no processor hook for a span its sampler
        dropped), end the span if ours. Never raises."""
        if error is None:
            error = self.error
        span = self.span
        call = self.call
        # The step that decides against a concurrent stop (kernel_ext.stop: the end noted,
        # then the call taken from the running ones: None when a stop took it first).
        if call is not None:
            call_id = call.call_id
            note_end(call_id)
            if take_running(call_id, None) is None:
                self.stopped = True
                error = None
        sink = self.sink_of()
        try:
            if span.is_recording():
                if self.stopped:
                    span.set_attribute(ERROR_TYPE, STOPPED_ERROR_TYPE)
                    span.set_status(Status(StatusCode.ERROR, STOPPED_MESSAGE))
                elif error is not None and self.opened and isinstance(error, Exception):
                    span.record_exception(error, _exception_attributes(error))
                    span.set_status(Status(StatusCode.ERROR, _error_text(error)))
                if sink is not None and call is not None:
                    attributes = sink.call_attributes(call.call_id)
                    if attributes:
                        span.set_attributes(attributes)
        except Exception:
            self.rare("finish_error", "tool span bookkeeping failed", exc_info=True)
        finally:
            if call is not None:
                call.life.ended = True
                if sink is not None:
                    try:
                        # LiveCall(...) without its generated __new__ (half the cost).
                        ended = _tuple_new(
                            LiveCall,
                            (
                                call.call_id,
                                call.tool_name,
                                call.conversation_id,
                                call.llm_call_id,
                                call.parent.call_id if call.parent is not None else None,
                                0,
                                call.trace_id,
                            ),
                        )
                        # The sink's optional tool_call_returned (tap.CallSink).
                        returned = (
                            None if error is not None else getattr(sink, "tool_call_returned", None)
                        )
                        stopped = getattr(sink, "tool_call_stopped", None) if self.stopped else None
                        if stopped is not None:
                            stopped(ended)
                        elif self.stopped:
                            sink.tool_call_ended(ended, STOPPED_MESSAGE)
                        elif returned is not None:
                            returned(ended, self.result)
                        else:
                            sink.tool_call_ended(ended, _error_text(error))
                    except Exception:
                        self.rare("finish_error", "sink.tool_call_ended failed", exc_info=True)
            if self.opened:
                try:
                    span.end()
                except Exception:
                    self.rare("finish_error", "tool span could not be ended", exc_info=True)


async def run_stoppable(active: ActiveCall, body: Callable[[], Awaitable[_T]]) -> _T | Any:
    """Run ``await body()`` as the call ``active`` (inside ``with active:``; ``body`` records
    what it returned), in the current task, stoppable: the runtimes with hooks (pydantic-ai,
    the OpenAI Agents SDK) run their tool so. Returns what ``body`` returned, or the stopped
    result when a stop won (:meth:`ActiveCall.stopped_result`); a cancellation that is not
    the stop's, and an exception of a call not stopped, propagate. (The instrumentor's
    coroutine wrapper is this, spelled out for its hot path: change both together.)"""
    active.watch()
    try:
        with active:
            result = await body()
    except asyncio.CancelledError:
        if not active.stop_caught():
            raise
        return active.stopped_result()
    except Exception:
        if not active.stopped:
            raise
        return active.stopped_result()
    active.settle()
    if active.stopped:
        return active.stopped_result()
    return result


def _exception_attributes(error: Exception) -> dict[str, str] | None:
    """What replaces the SDK's own message and stack trace in the span's exception event
    when the error's message holds a lone surrogate (U+FFFD instead: span exporters encode
    UTF-8); ``None`` — the SDK's own — otherwise."""
    try:
        message = str(error)
    except Exception:
        return None
    if well_formed(message) is message:
        return None
    stacktrace = "".join(traceback.format_exception(error))
    return {EXCEPTION_MESSAGE: well_formed(message), EXCEPTION_STACKTRACE: well_formed(stacktrace)}


def _error_text(error: BaseException | None) -> str | None:
    """How a call's end reads in its span status and its sink's ``tool_call_ended``:
    ``Type: message`` for an ``Exception`` (``Type`` alone when its message cannot be
    read; a lone surrogate in it as U+FFFD, :func:`~kernel_ext.protocol.well_formed`), a
    fixed text for a cancellation and for an interruption (``KeyboardInterrupt``,
    ``SystemExit``), ``None`` — returned — for no error and for ``GeneratorExit`` (a
    generator its consumer closed early)."""
    if error is None or isinstance(error, GeneratorExit):
        return None
    if isinstance(error, Exception):
        try:
            return well_formed(f"{type(error).__name__}: {error}")
        except Exception:
            return type(error).__name__
    if isinstance(error, asyncio.CancelledError):
        return "the tool call was cancelled"
    return f"the tool call was interrupted ({type(error).__name__})"


def begin(
    tracer: Tracer,
    description: ToolDescription,
    rare: RareLog,
    sink_of: SinkOf,
    current: otel_context.Context | None = None,
) -> ActiveCall:
    """Find the runtime's ``execute_tool`` span for this call or start one; build the call
    (module docstring). ``current``: the current OpenTelemetry context, if the caller has
    it. May raise what the tracer raises."""
    parent = current_tool_call()
    # The current context once, handed on: the tracer and its sampler would each look it
    # up again otherwise (the same context either way).
    if current is None:
        current = otel_context.get_current()
    span = trace.get_current_span(current)
    # A span that does not record (no span at all, or one we cannot read) is not this
    # call's: asked here, that answer costs no _is_span_of frame.
    opened = not (span.is_recording() and _is_span_of(span, description, parent))
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
            kind=_INTERNAL,
            attributes=attributes,
        )
    else:
        span_attributes = getattr(span, "attributes", None) or {}
        if conversation_id is None:
            conversation_id = _str_or_none(span_attributes.get(CONVERSATION_ID)) or _str_or_none(
                span_attributes.get(OI_SESSION)
            )
            if conversation_id is None and parent is not None:
                conversation_id = parent.conversation_id
        if llm_call_id is None:
            llm_call_id = (
                _str_or_none(span_attributes.get(TOOL_CALL_ID))
                or _str_or_none(span_attributes.get(OI_TOOL_ID))
                or _str_or_none(span_attributes.get(OI_TOOL_CALL_ID))
            )
    span_context = span.get_span_context()
    call: ToolCall | None = None
    if span_context.is_valid:
        # ToolCall(...) without its Python __new__ (tuple.__new__ with every field given,
        # as the span processor builds its LiveCalls): one frame less per wrapped call.
        call = _tuple_new(
            ToolCall,
            (
                span_id_hex(span_context.span_id),
                description.tool_name,
                conversation_id,
                llm_call_id,
                parent,
                CallLife(),
                sampled_trace_id(span_context),
            ),
        )
        register(call.call_id, call.life)  # stoppable by its call id (kernel_ext.stop)
    else:
        rare(
            "no_span_id",
            "no valid span for tool %r (no tracer provider?): its call id is unknown, "
            "the contextvar is not set",
            description.tool_name,
        )
    return ActiveCall(span, opened, call, trace.set_span_in_context(span, current), rare, sink_of)


def _is_span_of(span: Span, description: ToolDescription, parent: ToolCall | None) -> bool:
    """Is ``span``, a recording span, the tool span the runtime opened for this very call?

    A tool span by the span processor's rule (:func:`tool_span_keys`: GenAI, OpenInference,
    or named ``"execute_tool …"``), not the enclosing call's own span; then the same call
    when the model's tool-call ids of both are known (:func:`span_llm_call_id`), else when
    the tool names match (the span's attribute, else its name: :func:`attribute_text`,
    :func:`tool_name_from_span_name`), exactly as the processor reads that span."""
    attributes = getattr(span, "attributes", None) or {}
    name = getattr(span, "name", None)
    keys = tool_span_keys(attributes, name)
    if keys is None:
        return False
    if parent is not None and parent.call_id == span_id_hex(span.get_span_context().span_id):
        return False  # the enclosing call's span: this is a nested call
    span_call_id = span_llm_call_id(attributes, keys)
    if description.llm_call_id is not None and span_call_id is not None:
        return span_call_id == description.llm_call_id
    tool_name = attribute_text(attributes.get(keys.tool_name))
    return (tool_name or tool_name_from_span_name(name, keys)) == description.tool_name


def begin_described(
    tracer: Tracer,
    describe: Describe,
    rare: RareLog,
    sink_of: SinkOf,
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    current: otel_context.Context | None = None,
) -> ActiveCall | None:
    """:func:`begin` for a wrapped call, described by ``describe``; ``None`` (the call
    runs unattributed) when the hook says ``None`` and on any fault (logged rarely)."""
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
        return begin(tracer, description, rare, sink_of, current)
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
    An explicit request: unlike the wrappers, it attributes the block also inside
    OpenTelemetry's ``suppress_instrumentation()``. A block that ends without an exception
    ends the call as returned, without a result (the streams the hub opened for the call's
    nested tool calls end ``done`` with the neutral text).
    """
    active = begin_scope(description, tracer_provider, sink)
    if active is None:
        yield None
        return
    with active as call:
        yield call


def begin_scope(
    description: ToolDescription,
    tracer_provider: TracerProvider | None,
    sink: CallSink | None,
) -> ActiveCall | None:
    """:func:`begin` for :func:`tool_call_scope` and the integrations with hooks: ``None``
    (the call runs unattributed) when the span cannot be started (logged rarely)."""
    try:
        return begin(tracer_of(tracer_provider), description, _rare, lambda: sink)
    except Exception:
        _rare(
            "describe_error", "tool span could not be started; call not attributed", exc_info=True
        )
        return None


@functools.lru_cache(maxsize=16)
def tracer_of(tracer_provider: TracerProvider | None) -> Tracer:
    """kernel_ext's tracer from ``tracer_provider`` (None: the global provider, resolved
    lazily by OpenTelemetry's proxy)."""
    return trace.get_tracer("kernel_ext", __version__, tracer_provider=tracer_provider)
