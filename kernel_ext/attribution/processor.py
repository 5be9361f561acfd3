"""The OpenTelemetry span processor that feeds the trajectory tap and the stream layer.

:class:`ToolSpanProcessor` watches tool spans, whoever opened them (the kernel_ext
instrumentor, pydantic-ai, any framework that follows the GenAI semantic conventions, the
OpenInference instrumentations). A span is a tool span when, at start, its
``gen_ai.operation.name`` is ``execute_tool``; or, lacking that, its
``openinference.span.kind`` is ``TOOL``; or, lacking both, its name starts with
``"execute_tool "``. Attributes set after start are not seen.

* ``on_start``: the call enters the tap (call id = the span id as 16 lower-case hex
  digits); a tool span that starts under a live tool call is reported to the sink,
  ``sink.tool_call_started(parent, child)``.
* ``on_end``: the call leaves the tap and ``sink.tool_call_ended(call, error)`` is called
  (``error`` is ``None`` when the span did not fail).

Guarantees: it never raises into the traced code and never blocks (bounded in-memory work
under one short lock; the sink must be enqueue-only). Every fault gets a defined outcome,
is counted (:attr:`ToolSpanProcessor.faults`) and logged (1st, 2nd, 4th, … occurrence of
each kind) on the ``kernel_ext.attribution.processor`` logger.

Design (the attributes read, the faults and their outcomes): docs/contracts.md, "The span
processor".
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import SpanContext, StatusCode

from kernel_ext._shared import compat
from kernel_ext.attribution import resolve
from kernel_ext.attribution._conventions import (
    CONVERSATION_ID,
    EXECUTE_TOOL,
    GEN_AI_KEYS,
    OI_KIND,
    OI_SESSION,
    OI_TOOL,
    OI_TOOL_CALL_ID,
    OI_TOOL_ID,
    OI_TOOL_NAME,
    OPENINFERENCE_KEYS,
    OPERATION,
    SPAN_NAME_PREFIX,
    TOOL_CALL_ID,
    TOOL_NAME,
    attribute_text,
    tool_name_from_span_name,
)
from kernel_ext.attribution.tap import CallSink, LiveCall, Tap, default_tap
from kernel_ext.context import current_tool_call, span_id_hex
from kernel_ext.observability._rare_log import RareLog

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import Span

__all__ = ["ToolSpanProcessor"]

_log = logging.getLogger(__name__)

_SPAN_NAME_PREFIX = SPAN_NAME_PREFIX
_ENDED_MEMORY = 256


class ToolSpanProcessor(SpanProcessor):
    """Turns live tool spans into tap entries and stream-layer notifications.

    Args:
        tap: where live calls are kept (default:
            :func:`kernel_ext.attribution.tap.default_tap`); readable as :attr:`tap`.
        sink: the stream layer (a :class:`kernel_ext.attribution.tap.CallSink`), or ``None``; the
            :attr:`sink` attribute may be set later (the plugin attaches the stream hub
            after construction).

    Add it to a ``TracerProvider`` with ``provider.add_span_processor(processor)``.
    """

    def __init__(self, tap: Tap | None = None, sink: CallSink | None = None) -> None:
        self.tap: Tap = tap if tap is not None else default_tap()
        self.sink: CallSink | None = sink
        self._rare = RareLog(_log)
        # Span ids of recently ended tool spans, to tell "ended twice" from "never started".
        self._ended: collections.deque[int] = collections.deque(maxlen=_ENDED_MEMORY)
        self._shutdown = False

    # -- SpanProcessor ----------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Add a tool span's call to the tap; report a nested call to the sink. Never raises."""
        # One flat function: this runs for every span, inside the traced code. Measured:
        # the "processor on_start+on_end" rows of docs/performance.md (benchmarks/
        # bench_attribution.py); a helper call costs a non-tool span about a sixth.
        try:
            if self._shutdown:
                return
            # The SDK span's own fields, read inline only where kernel_ext._shared.compat probed
            # them (SDK_SPAN_FIELDS; it says which and why); else the public properties. All of
            # them or none, so that a span laid out differently takes the public ones.
            inner: Any = None
            if _SDK_SPAN_FIELDS:
                try:
                    inner = span._attributes._dict  # type: ignore[union-attr, unused-ignore]
                    context = span._context
                    parent_span = span._parent
                    start_time = span._start_time
                except AttributeError:  # not an SDK span
                    inner = None
            get: _Get
            if inner.__class__ is dict:
                get = inner.get
            else:
                get = _attribute_getter(span)
                context = span.context
                parent_span = span.parent
                start_time = span.start_time
            # Is it a tool span (of which convention), and its id? Written out again in on_end
            # on purpose: a shared helper would cost every span (tool or not) a Python call on
            # this hot path. A span with a GenAI operation pays one lookup; one without pays
            # one more (the OpenInference kind) before its name is read.
            operation = get(OPERATION)
            if operation is None:
                kind = get(OI_KIND)
                if kind is None:
                    name = span.name  # tool_span_keys' name rule, inline
                    if name.__class__ is not str or not name.startswith(_SPAN_NAME_PREFIX):
                        return
                    name_key, conversation_key, call_id_key = (
                        TOOL_NAME,
                        CONVERSATION_ID,
                        TOOL_CALL_ID,
                    )
                elif kind == OI_TOOL:
                    name_key, conversation_key, call_id_key = OI_TOOL_NAME, OI_SESSION, OI_TOOL_ID
                else:
                    return
            elif operation != EXECUTE_TOOL:
                return
            else:
                name_key, conversation_key, call_id_key = TOOL_NAME, CONVERSATION_ID, TOOL_CALL_ID
            span_id = (
                context[1]  # type: ignore[index, unused-ignore]
                if context.__class__ is _INDEXED_CONTEXT
                else _span_id(context)
            )
            call_id: str | None = None
            if span_id.__class__ is int and span_id:
                try:
                    call_id = span_id.to_bytes(8, "big").hex()  # span_id_hex, inline
                except OverflowError:  # negative, or beyond 64 bits
                    call_id = None
            if call_id is None:
                call_id = _hex_span_id(span_id)
                if call_id is None:
                    self._rare("invalid_span_id", "tool span %r has no valid span id", span.name)
                    return
            tool_name = get(name_key)
            if tool_name.__class__ is not str or not tool_name:
                tool_name = self._text(tool_name, name_key) or self._name_from_span(span, name_key)
            conversation_id = get(conversation_key)
            if conversation_id.__class__ is not str or not conversation_id:
                conversation_id = (
                    None
                    if conversation_id is None
                    else self._text(conversation_id, conversation_key)
                )
            llm_call_id = get(call_id_key)
            if llm_call_id is None and call_id_key is OI_TOOL_ID:
                call_id_key = OI_TOOL_CALL_ID  # OpenInference's other name for it
                llm_call_id = get(call_id_key)
            if llm_call_id.__class__ is not str or not llm_call_id:
                llm_call_id = None if llm_call_id is None else self._text(llm_call_id, call_id_key)

            tap = self.tap
            parent: LiveCall | None = None
            if parent_span is not None and len(tap):
                parent_call_id = _hex_span_id(parent_span.span_id)
                if parent_call_id is not None:
                    parent = tap.get(parent_call_id)
            if parent is None:
                # An ancestor tool call further up (a tool that runs an agent that runs
                # tools): the contextvar holds it while its code runs.
                active = current_tool_call()
                if active is not None:
                    parent = tap.get(active.call_id)
                    if conversation_id is None:
                        conversation_id = active.conversation_id
            if conversation_id is None and parent is not None:
                conversation_id = parent.conversation_id

            call = _new_live_call(  # LiveCall(...), built the cheapest way: once per tool span
                LiveCall,
                (
                    call_id,
                    tool_name,
                    conversation_id,
                    llm_call_id,
                    parent.call_id if parent is not None else None,
                    start_time or 0,
                    compat.sampled_trace_id(context),
                ),
            )
            if not tap.add(call):
                self._rare("duplicate_start", "tool span %s started twice; ignored", call_id)
                return
            sink = self.sink
            if parent is not None and sink is not None:
                try:
                    sink.tool_call_started(parent, call)
                except Exception:
                    self._rare("sink_error", "sink.tool_call_started failed", exc_info=True)
        except Exception:
            self._rare("internal_error", "tool span start not recorded", exc_info=True)

    def on_end(self, span: ReadableSpan) -> None:
        """Remove a tool span's call from the tap; tell the sink it ended. Never raises."""
        try:
            inner: Any = None  # as in on_start
            if _SDK_SPAN_FIELDS:
                try:
                    inner = span._attributes._dict  # type: ignore[union-attr, unused-ignore]
                    context = span._context
                except AttributeError:
                    inner = None
            get: _Get
            if inner.__class__ is dict:
                get = inner.get
            else:
                get = _attribute_getter(span)
                context = span.context
            # As in on_start (kept twice on purpose: the hot path).
            operation = get(OPERATION)
            if operation is None:
                kind = get(OI_KIND)
                if kind is None:
                    name = span.name  # tool_span_keys' name rule, inline
                    if name.__class__ is not str or not name.startswith(_SPAN_NAME_PREFIX):
                        return
                elif kind != OI_TOOL:
                    return
            elif operation != EXECUTE_TOOL:
                return
            # The common case inline: a live call (started by this processor) ends.
            span_id = (
                context[1]  # type: ignore[index, unused-ignore]
                if context.__class__ is _INDEXED_CONTEXT
                else _span_id(context)
            )
            call: LiveCall | None = None
            if span_id.__class__ is int and span_id:
                try:
                    call = self.tap.discard(span_id.to_bytes(8, "big").hex())  # as on_start
                except OverflowError:  # negative, or beyond 64 bits
                    call = None
            if call is None:
                self._end_rare(span, get, span_id)
                return
            self._ended.append(span_id)  # type: ignore[arg-type]
            sink = self.sink
            if sink is not None:
                try:
                    sink.tool_call_ended(call, _error_message(span))
                except Exception:
                    self._rare("sink_error", "sink.tool_call_ended failed", exc_info=True)
        except Exception:
            self._rare("internal_error", "tool span end not recorded", exc_info=True)

    def shutdown(self) -> None:
        """Stop taking new tool spans (ends are still processed, so the tap empties) and
        flush the resolution metrics. Idempotent."""
        self._shutdown = True
        resolve.flush_metrics()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is buffered here; flushes the resolution metrics. Always ``True``."""
        resolve.flush_metrics()
        return True

    # -- introspection ------------------------------------------------------------------

    @property
    def faults(self) -> dict[str, int]:
        """How often each fault kind (see the module docstring) happened."""
        return self._rare.counts()

    def __repr__(self) -> str:
        return f"ToolSpanProcessor(tap={self.tap!r}, sink={self.sink!r})"

    # -- internals ------------------------------------------------------------------------

    def _end_rare(self, span: ReadableSpan, get: _Get, span_id: object) -> None:
        """The end of a tool span that is not a live call of the tap: an invalid span id,
        an end seen twice, or an end without start (the call is rebuilt from the span)."""
        call_id = _hex_span_id(span_id)
        if call_id is None:
            self._rare("invalid_span_id", "tool span %r has no valid span id", span.name)
            return
        call = self.tap.discard(call_id)  # an int subclass as span id: not tried inline
        if call is None:
            if span_id in self._ended:
                self._rare("ended_twice", "tool span %s ended twice; ignored", call_id)
                return
            self._rare(
                "end_without_start",
                "tool span %s ended but was not live (evicted, or started before this "
                "processor); the sink is told anyway",
                call_id,
            )
            parent_span = span.parent
            if get(OPERATION) is None and get(OI_KIND) == OI_TOOL:
                name_key, conversation_key, call_id_key = OI_TOOL_NAME, OI_SESSION, OI_TOOL_ID
            else:
                name_key, conversation_key, call_id_key = TOOL_NAME, CONVERSATION_ID, TOOL_CALL_ID
            if call_id_key is OI_TOOL_ID and get(OI_TOOL_ID) is None:
                call_id_key = OI_TOOL_CALL_ID  # OpenInference's other name for it, as on_start
            llm_call_id = self._text(get(call_id_key), call_id_key)
            call = LiveCall(
                call_id,
                self._text(get(name_key), name_key) or self._name_from_span(span, name_key),
                self._text(get(conversation_key), conversation_key),
                llm_call_id,
                _hex_span_id(parent_span.span_id) if parent_span is not None else None,
                span.start_time or 0,
                compat.sampled_trace_id(span.context),  # as on_start
            )
        self._ended.append(int(span_id))  # type: ignore[call-overload]
        sink = self.sink
        if sink is not None:
            try:
                sink.tool_call_ended(call, _error_message(span))
            except Exception:
                self._rare("sink_error", "sink.tool_call_ended failed", exc_info=True)

    def _text(self, value: object, key: str) -> str | None:
        """A string attribute as ``str``; ints as decimal strings; anything else absent
        (:func:`~kernel_ext.attribution._conventions.attribute_text`), a bad type logged."""
        text = attribute_text(value)
        if text is None and value is not None and not isinstance(value, str):
            self._rare(
                "bad_attribute",
                "tool span attribute %s is a %s; ignored",
                key,
                type(value).__name__,
            )
        return text

    def _name_from_span(self, span: ReadableSpan, name_key: str) -> str:
        """The tool name of a tool span without a usable ``name_key`` attribute, from its
        span name (:func:`~kernel_ext.attribution._conventions.tool_name_from_span_name`),
        else ``"unknown"``; logged as a fault, except for an OpenInference span whose name
        gives one (a missing ``tool.name`` is usual there: DSPy never writes it, CrewAI
        writes it after start)."""
        name = span.name
        openinference = name_key is OI_TOOL_NAME
        keys = OPENINFERENCE_KEYS if openinference else GEN_AI_KEYS
        from_name = tool_name_from_span_name(name, keys)
        if openinference and from_name is not None:
            return from_name
        tool_name = from_name or "unknown"
        self._rare(
            "no_tool_name",
            "tool span %r has no %s attribute; using %r",
            name,
            name_key,
            tool_name,
        )
        return tool_name


# LiveCall is a NamedTuple; its generated __new__ costs twice what tuple.__new__ does.
_new_live_call = tuple.__new__
_MAX_SPAN_ID = (1 << 64) - 1
# Read once: an attribute of an Enum class goes through EnumType's __getattr__ hook.
_ERROR = StatusCode.ERROR


_Get = Callable[[str], object]


def _span_id(context: SpanContext | None) -> object:
    """The span id of ``context`` (``0`` when there is none)."""
    return context.span_id if context is not None else 0


_SDK_SPAN_FIELDS = compat.SDK_SPAN_FIELDS
# SpanContext when its span id is item 1 of the tuple it is (the processor indexes it to save
# the ``span_id`` property's Python call), else a class no context is an instance of.
_INDEXED_CONTEXT: type = SpanContext if compat.SPAN_CONTEXT_INDEXED else type("_NoContext", (), {})


def _attribute_getter(span: ReadableSpan) -> _Get:
    """The ``get`` of the span's attributes, through the public ``span.attributes``.

    On the SDK's own spans, ``on_start``/``on_end`` read the span's fields directly instead
    (:mod:`kernel_ext._shared.compat` says which and why); a span that lacks them
    (another implementation, or an SDK laid out differently) comes here and to the public
    properties.
    """
    attributes = span.attributes
    return attributes.get if attributes is not None else _no_attribute


def _hex_span_id(span_id: object) -> str | None:
    """A valid span id (an int in 1 .. 2**64 - 1) as 16 lower-case hex digits, else
    ``None``."""
    if isinstance(span_id, int) and 0 < span_id <= _MAX_SPAN_ID:
        return span_id_hex(int(span_id))
    return None


def _no_attribute(key: str) -> None:
    return None


def _error_message(span: ReadableSpan) -> str | None:
    """The span's failure in one line, or ``None`` when its status is not ERROR."""
    status = span.status
    if status is None or status.status_code is not _ERROR:
        return None
    if status.description:
        return status.description
    for event in reversed(span.events):
        if event.name == "exception":
            event_attributes = event.attributes or {}
            kind = event_attributes.get("exception.type")
            message = event_attributes.get("exception.message")
            if kind or message:
                return f"{kind}: {message}" if kind and message else str(kind or message)
    return "tool call failed"
