"""Tool spans of the OpenInference conventions feed the tap (issue 16, item 4).

The spans are built exactly as the Arize/Phoenix instrumentations build them: through
openinference-instrumentation's own ``OITracer`` (which every one of them wraps its tracer
in), with the attributes, span names and order of each instrumentation's tool wrapper, and
the session from ``using_session`` as those instrumentations read it
(``get_attributes_from_context``). The attribute names come from
openinference-semantic-conventions, so a renamed attribute fails here; kernel_ext itself
holds them as strings.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from support.attribution_helpers import RecordingSink, Tracing, hex_id, make_tracing, trace_of
from support.network import need_module

need_module("openinference.instrumentation", "pip install openinference-instrumentation")

from openinference.instrumentation import (  # noqa: E402
    OITracer,
    TraceConfig,
    get_attributes_from_context,
    using_session,
)
from openinference.semconv.trace import (  # noqa: E402
    OpenInferenceMimeTypeValues,
    OpenInferenceSpanKindValues,
    SpanAttributes,
    ToolCallAttributes,
)
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.trace import Span  # noqa: E402

import kernel_ext  # noqa: E402
from kernel_ext import ToolCall, ToolDescription  # noqa: E402
from kernel_ext.attribution import _conventions  # noqa: E402
from kernel_ext.attribution.resolve import Resolution, ResolutionPath, resolve_call_id  # noqa: E402
from kernel_ext.attribution.tap import LiveCall, Tap  # noqa: E402
from kernel_ext.instrument import tool_call_scope  # noqa: E402
from kernel_ext.testing import MemoryEmitter  # noqa: E402

KIND = SpanAttributes.OPENINFERENCE_SPAN_KIND
TOOL = OpenInferenceSpanKindValues.TOOL.value


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    tracing = make_tracing(sink=RecordingSink())
    yield tracing
    tracing.close()


def oi_tracer(provider: TracerProvider) -> OITracer:
    """The tracer an OpenInference instrumentor builds in ``_instrument``."""
    return OITracer(provider.get_tracer(__name__), config=TraceConfig())


def live_call(tracing: Tracing, span: Span) -> LiveCall | None:
    return tracing.tap.get(hex_id(span))  # type: ignore[arg-type]


# -- how each instrumentation opens its tool span ------------------------------------------


def smolagents_tool_span(tracer: OITracer, tool_name: str, arguments: dict[str, Any]) -> Any:
    """``_ToolCallWrapper``: the span is named after the tool's class; kind, input and the
    tool's name, description and parameters, plus the context's attributes, at start."""
    return tracer.start_as_current_span(
        "SearchTool",
        attributes={
            KIND: TOOL,
            SpanAttributes.INPUT_VALUE: json.dumps({"args": [], "kwargs": arguments}),
            SpanAttributes.TOOL_NAME: tool_name,
            SpanAttributes.TOOL_DESCRIPTION: "Searches the web.",
            SpanAttributes.TOOL_PARAMETERS: json.dumps({"query": {"type": "string"}}),
            **dict(get_attributes_from_context()),
        },
    )


def dspy_tool_span(tracer: OITracer, tool_name: str, arguments: dict[str, Any]) -> Any:
    """``_ToolCallWrapper`` (DSPy): ``"<name>.__call__"``; kind, input and context at
    start; no ``tool.name`` ever."""
    return tracer.start_as_current_span(
        tool_name + ".__call__",
        attributes={
            KIND: TOOL,
            SpanAttributes.INPUT_VALUE: json.dumps(arguments),
            SpanAttributes.INPUT_MIME_TYPE: OpenInferenceMimeTypeValues.JSON.value,
            **dict(get_attributes_from_context()),
        },
    )


def crewai_event_tool_span(tracer: OITracer, tool_name: str, tool_call_id: str) -> Span:
    """CrewAI's event listener (``ToolUsageStartedEvent``): ``"<tool>.run"``, started with
    ``start_span`` (never current: the tool's code runs outside it); kind and tool name at
    start; the context's attributes added by ``OITracer``."""
    span: Span = tracer.start_span(
        name=f"{tool_name}.run",
        attributes={
            KIND: TOOL,
            SpanAttributes.TOOL_NAME: tool_name,
            SpanAttributes.TOOL_ID: tool_call_id,
            SpanAttributes.INPUT_VALUE: json.dumps({"query": "x"}),
        },
        record_exception=False,
        set_status_on_exception=False,
    )
    return span


# -- the tap sees them while they run --------------------------------------------------------


def test_a_smolagents_tool_span_is_live_with_its_session_as_conversation(
    tracing: Tracing,
) -> None:
    tracer = oi_tracer(tracing.provider)
    with using_session("sess-1"), smolagents_tool_span(tracer, "search", {"q": "x"}) as span:
        live = live_call(tracing, span)
        assert live == LiveCall(
            hex_id(span), "search", "sess-1", None, None, live.started_ns, trace_of(span)
        )  # type: ignore[arg-type,union-attr]
        assert resolve_call_id("sess-1", "search", tap=tracing.tap) == Resolution(
            hex_id(span),  # type: ignore[arg-type]
            ResolutionPath.NEAR_MATCH,
            "sess-1",
        )
    assert len(tracing.tap) == 0
    assert tracing.sink.ended == [(live, None)]
    assert tracing.processor.faults == {}


def test_a_dspy_tool_span_without_tool_name_is_named_from_its_span_name(
    tracing: Tracing,
) -> None:
    tracer = oi_tracer(tracing.provider)
    with using_session("sess-1"), dspy_tool_span(tracer, "web.search", {"q": "x"}) as span:
        live = live_call(tracing, span)
        assert live is not None
        assert (live.tool_name, live.conversation_id) == ("web.search", "sess-1")
    assert tracing.processor.faults == {}  # a missing tool.name is usual there, not a fault


def test_a_crewai_wrapper_span_named_at_start_and_given_tool_name_later_is_named_from_its_span(
    tracing: Tracing,
) -> None:
    # CrewAI's ``_ToolUseWrapper``: kind at start, tool.name set inside the span.
    tracer = oi_tracer(tracing.provider)
    with tracer.start_as_current_span(
        "search._run",
        attributes={KIND: TOOL},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        span.set_attribute(SpanAttributes.TOOL_NAME, "search")
        live = live_call(tracing, span)
        assert live is not None
        assert (live.tool_name, live.conversation_id, live.llm_call_id) == ("search", None, None)
    assert tracing.sink.ended == [(live, None)]


@pytest.mark.parametrize(
    "attributes",
    [
        {SpanAttributes.TOOL_ID: "call-1"},
        {ToolCallAttributes.TOOL_CALL_ID: "call-1"},
        {SpanAttributes.TOOL_ID: "call-1", ToolCallAttributes.TOOL_CALL_ID: "other"},
    ],
    ids=["tool.id", "tool_call.id", "tool.id-first"],
)
def test_the_models_call_id_is_tool_id_else_tool_call_id(
    tracing: Tracing, attributes: dict[str, str]
) -> None:
    tracer = oi_tracer(tracing.provider)
    with tracer.start_as_current_span(
        "SearchTool", attributes={KIND: TOOL, SpanAttributes.TOOL_NAME: "search", **attributes}
    ) as span:
        live = live_call(tracing, span)
        assert live is not None
        assert live.llm_call_id == "call-1"


@pytest.mark.parametrize(
    "kind",
    [v.value for v in OpenInferenceSpanKindValues if v is not OpenInferenceSpanKindValues.TOOL],
)
def test_openinference_spans_of_other_kinds_are_ignored(tracing: Tracing, kind: str) -> None:
    tracer = oi_tracer(tracing.provider)
    with (
        using_session("sess-1"),
        tracer.start_as_current_span(
            "search.__call__", attributes={KIND: kind, SpanAttributes.TOOL_NAME: "search"}
        ),
    ):
        assert len(tracing.tap) == 0
    assert tracing.sink.ended == []
    assert tracing.processor.faults == {}


def test_a_genai_operation_wins_over_the_openinference_kind(tracing: Tracing) -> None:
    tracer = tracing.provider.get_tracer("test")
    with tracer.start_as_current_span(
        "chat", attributes={"gen_ai.operation.name": "chat", KIND: TOOL, "tool.name": "search"}
    ):
        assert len(tracing.tap) == 0
    assert tracing.sink.ended == []


def test_two_live_calls_of_one_tool_in_one_session_are_ambiguous_and_sessions_apart_are_not(
    tracing: Tracing,
) -> None:
    tracer = oi_tracer(tracing.provider)
    with using_session("sess-1"):
        first = crewai_event_tool_span(tracer, "search", "call-1")
        second = crewai_event_tool_span(tracer, "search", "call-2")
    with using_session("sess-2"):
        other = crewai_event_tool_span(tracer, "search", "call-3")
    try:
        assert resolve_call_id("sess-1", "search", tap=tracing.tap) == Resolution(
            None, ResolutionPath.AMBIGUOUS, "sess-1"
        )
        assert resolve_call_id("sess-2", "search", tap=tracing.tap).call_id == hex_id(other)  # type: ignore[arg-type]
        first.end()
        assert resolve_call_id("sess-1", "search", tap=tracing.tap).call_id == hex_id(second)  # type: ignore[arg-type]
    finally:
        second.end()
        other.end()
    assert len(tracing.tap) == 0
    assert [call.llm_call_id for call, _ in tracing.sink.ended] == ["call-1", "call-2", "call-3"]


def test_a_tool_span_without_session_under_a_live_tool_call_is_nested_in_its_conversation(
    tracing: Tracing,
) -> None:
    genai = tracing.provider.get_tracer("test")
    tracer = oi_tracer(tracing.provider)
    with (
        genai.start_as_current_span(
            "execute_tool ask_colleague",
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "ask_colleague",
                "gen_ai.conversation.id": "conv-1",
            },
        ) as outer,
        smolagents_tool_span(tracer, "search", {"q": "x"}) as inner,
    ):
        live = live_call(tracing, inner)
        assert live is not None
        assert (live.conversation_id, live.parent_call_id) == ("conv-1", hex_id(outer))  # type: ignore[arg-type]
        [(parent, child)] = tracing.sink.started
        assert (parent.call_id, child) == (hex_id(outer), live)  # type: ignore[arg-type]


def test_a_failing_openinference_tool_span_ends_its_call_with_the_error(tracing: Tracing) -> None:
    tracer = oi_tracer(tracing.provider)

    class Boom(Exception):
        pass

    spans: list[Span] = []

    def search() -> None:
        with smolagents_tool_span(tracer, "search", {}) as span:
            spans.append(span)
            raise Boom("no network")

    with pytest.raises(Boom):
        search()
    [(call, error)] = tracing.sink.ended
    assert call.call_id == hex_id(spans[0])  # type: ignore[arg-type]
    assert error is not None
    assert "no network" in error


def test_a_llamaindex_tool_span_gets_its_kind_only_at_its_end_so_it_is_never_live(
    tracing: Tracing,
) -> None:
    # LlamaIndex's span handler starts the span with the context's attributes only and
    # writes the kind, the tool name and the rest when the span ends (documented).
    tracer = oi_tracer(tracing.provider)
    with using_session("sess-1"):
        span = tracer.start_span(
            name="FunctionTool.acall", attributes=dict(get_attributes_from_context())
        )
    assert len(tracing.tap) == 0
    assert resolve_call_id("sess-1", "search", tap=tracing.tap).path is ResolutionPath.NONE
    span.set_attributes({SpanAttributes.TOOL_NAME: "search", KIND: TOOL})
    span.end()
    [(call, error)] = tracing.sink.ended  # its streams, if any, would still get a terminal
    assert (call.call_id, call.tool_name, call.conversation_id, error) == (
        hex_id(span),  # type: ignore[arg-type]
        "search",
        "sess-1",
        None,
    )
    assert tracing.processor.faults == {"end_without_start": 1}


# -- end to end: a block published outside the call goes to the OpenInference span's call ----


async def test_a_block_published_while_a_crewai_tool_span_runs_carries_its_span_id() -> None:
    provider = TracerProvider()
    emitter = MemoryEmitter()
    kernel_ext.enable(emitter=emitter, tracer_provider=provider, tap=Tap())
    try:
        tracer = oi_tracer(provider)
        with using_session("sess-1"):
            span = crewai_event_tool_span(tracer, "search", "call-1")
        # The tool's code: CrewAI runs it outside the span, here on a plain thread.
        worker = threading.Thread(
            target=kernel_ext.publish,
            args=("searching",),
            kwargs={"conversation_id": "sess-1", "tool_name": "search"},
        )
        worker.start()
        await asyncio.to_thread(worker.join, 10)
        span.end()
        await asyncio.wait_for(emitter.wait_for(lambda records: len(records) == 2), 10)
    finally:
        await kernel_ext.adisable()
        provider.shutdown()
    (room, running), (_, terminal) = emitter.records
    assert room == "sess-1"
    assert running["callId"] == hex_id(span) == terminal["callId"]  # type: ignore[arg-type]
    assert (running["state"], terminal["state"]) == ("running", "aborted")


# -- a tool call attributed inside an OpenInference tool span reuses it ------------------------


def test_a_tool_call_scope_inside_this_calls_openinference_span_reuses_it(
    tracing: Tracing,
) -> None:
    tracer = oi_tracer(tracing.provider)
    with (
        using_session("sess-1"),
        tracer.start_as_current_span(
            "SearchTool",
            attributes={
                KIND: TOOL,
                SpanAttributes.TOOL_NAME: "search",
                SpanAttributes.TOOL_ID: "c1",
            },
        ) as span,
        tool_call_scope(
            ToolDescription("search"), tracer_provider=tracing.provider, sink=tracing.sink
        ) as call,
    ):
        assert call == ToolCall(
            hex_id(span), "search", "sess-1", "c1", None, trace_id=trace_of(span)
        )  # type: ignore[arg-type]
    assert [s.name for s in tracing.spans()] == ["SearchTool"]  # no span of its own
    assert tracing.sink.started == []


def test_an_openinference_span_named_after_its_tool_is_reused_without_tool_name(
    tracing: Tracing,
) -> None:
    # The OpenAI Agents SDK instrumentation's function span: kind only, named after the tool.
    tracer = oi_tracer(tracing.provider)
    with (
        tracer.start_as_current_span("search", attributes={KIND: TOOL}) as span,
        tool_call_scope(
            ToolDescription("search", "conv-1", "c1"), tracer_provider=tracing.provider
        ) as call,
    ):
        assert call == ToolCall(
            hex_id(span), "search", "conv-1", "c1", None, trace_id=trace_of(span)
        )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "description",
    [ToolDescription("fetch"), ToolDescription("search", llm_call_id="other")],
    ids=["other-tool", "other-model-call"],
)
def test_an_openinference_span_of_another_call_is_not_reused(
    tracing: Tracing, description: ToolDescription
) -> None:
    tracer = oi_tracer(tracing.provider)
    with (
        tracer.start_as_current_span(
            "SearchTool",
            attributes={
                KIND: TOOL,
                SpanAttributes.TOOL_NAME: "search",
                SpanAttributes.TOOL_ID: "c1",
            },
        ) as span,
        tool_call_scope(description, tracer_provider=tracing.provider, sink=tracing.sink) as call,
    ):
        assert call is not None
        assert call.call_id != hex_id(span)  # type: ignore[arg-type]
    [(parent, child)] = tracing.sink.started  # its own span, nested in the other call
    assert (parent.call_id, child.call_id) == (hex_id(span), call.call_id)  # type: ignore[arg-type]


def test_kernel_exts_names_are_the_conventions_own() -> None:
    assert (
        SpanAttributes.OPENINFERENCE_SPAN_KIND,
        OpenInferenceSpanKindValues.TOOL.value,
        SpanAttributes.TOOL_NAME,
        SpanAttributes.SESSION_ID,
        SpanAttributes.TOOL_ID,
        ToolCallAttributes.TOOL_CALL_ID,
    ) == (
        _conventions.OI_KIND,
        _conventions.OI_TOOL,
        _conventions.OI_TOOL_NAME,
        _conventions.OI_SESSION,
        _conventions.OI_TOOL_ID,
        _conventions.OI_TOOL_CALL_ID,
    )
