"""ToolSpanProcessor: tool spans feed the tap and the sink; bad input never escapes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, Status, StatusCode
from support.attribution_helpers import RecordingSink, Tracing, hex_id, make_tracing

from kernel_ext import ToolCall, use_tool_call
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import LiveCall, Tap, default_tap

TOOL = {
    "gen_ai.operation.name": "execute_tool",
    "gen_ai.tool.name": "ask_colleague",
    "gen_ai.tool.call.id": "llm-1",
    "gen_ai.conversation.id": "conv-1",
}
LOGGER = "kernel_ext.attribution.processor"


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    tracing = make_tracing()
    yield tracing
    tracing.close()


def test_a_tool_span_is_live_in_the_tap_while_it_runs(tracing: Tracing) -> None:
    tracer = tracing.provider.get_tracer("test")
    with tracer.start_as_current_span("execute_tool ask_colleague", attributes=TOOL) as span:
        call_id = format(span.get_span_context().span_id, "016x")
        live = tracing.tap.get(call_id)
        started = live.started_ns if live else 0
        trace_id = span.get_span_context().trace_id  # sampled: the trace id of its blocks
        assert live == LiveCall(
            call_id, "ask_colleague", "conv-1", "llm-1", None, started, trace_id
        )
        assert live is not None
        assert live.started_ns > 0
    assert len(tracing.tap) == 0
    assert tracing.sink.ended == [(live, None)]


def test_non_tool_spans_are_ignored(tracing: Tracing) -> None:
    tracer = tracing.provider.get_tracer("test")
    with tracer.start_as_current_span("chat model", attributes={"gen_ai.operation.name": "chat"}):
        assert len(tracing.tap) == 0
    with tracer.start_as_current_span("plain"):
        assert len(tracing.tap) == 0
    assert tracing.sink.ended == []
    assert tracing.processor.faults == {}


def test_a_nested_tool_span_is_reported_to_the_sink_and_inherits_the_conversation(
    tracing: Tracing,
) -> None:
    tracer = tracing.provider.get_tracer("test")
    inner_attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search"}
    with (
        tracer.start_as_current_span("execute_tool ask_colleague", attributes=TOOL) as outer,
        tracer.start_as_current_span("execute_tool search", attributes=inner_attributes),
    ):
        pass
    (parent, child), *rest = tracing.sink.started
    assert rest == []
    outer_id = format(outer.get_span_context().span_id, "016x")
    assert parent.call_id == outer_id
    assert (child.tool_name, child.conversation_id, child.parent_call_id) == (
        "search",
        "conv-1",
        outer_id,
    )
    assert [call.tool_name for call, _ in tracing.sink.ended] == ["search", "ask_colleague"]


def test_a_tool_span_under_a_non_tool_span_finds_its_ancestor_call_through_the_contextvar(
    tracing: Tracing,
) -> None:
    tracer = tracing.provider.get_tracer("test")
    with tracer.start_as_current_span("execute_tool ask_colleague", attributes=TOOL) as outer:
        outer_id = format(outer.get_span_context().span_id, "016x")
        inner_attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search"}
        with (
            use_tool_call(ToolCall(outer_id, "ask_colleague", "conv-1")),
            tracer.start_as_current_span("invoke_agent colleague"),
            tracer.start_as_current_span("execute_tool search", attributes=inner_attributes),
        ):
            pass
    assert [(p.call_id, c.tool_name, c.conversation_id) for p, c in tracing.sink.started] == [
        (outer_id, "search", "conv-1")
    ]


def test_a_failed_tool_span_ends_with_its_status_description(tracing: Tracing) -> None:
    tracer = tracing.provider.get_tracer("test")
    with pytest.raises(ValueError, match="no colleague"):  # noqa: SIM117
        with tracer.start_as_current_span("execute_tool ask_colleague", attributes=TOOL):
            raise ValueError("no colleague")
    [(_, error)] = tracing.sink.ended
    assert error == "ValueError: no colleague"


def test_an_error_status_without_description_takes_the_exception_event(
    tracing: Tracing,
) -> None:
    tracer = tracing.provider.get_tracer("test")
    with tracer.start_as_current_span("execute_tool ask_colleague", attributes=TOOL) as span:
        span.record_exception(TimeoutError("peer silent"))
        span.set_status(Status(StatusCode.ERROR))
    [(_, error)] = tracing.sink.ended
    assert error == "TimeoutError: peer silent"


def test_the_tap_is_reachable_from_the_processor_and_defaults_to_the_process_tap() -> None:
    assert ToolSpanProcessor().tap is default_tap()
    tap = Tap()
    assert ToolSpanProcessor(tap=tap).tap is tap


def test_a_sink_attached_after_construction_is_used() -> None:
    tracing = make_tracing()
    tracing.processor.sink = None
    tracer = tracing.provider.get_tracer("test")
    with tracer.start_as_current_span("execute_tool ask_colleague", attributes=TOOL):
        late = RecordingSink()
        tracing.processor.sink = late
    assert len(late.ended) == 1
    assert tracing.sink.ended == []
    tracing.close()


def test_after_shutdown_new_tool_spans_are_ignored_but_live_ones_still_end(
    tracing: Tracing,
) -> None:
    tracer = tracing.provider.get_tracer("test")
    live = tracer.start_span("execute_tool ask_colleague", attributes=TOOL)
    tracing.processor.shutdown()
    tracing.processor.shutdown()  # idempotent
    with tracer.start_as_current_span("execute_tool search", attributes=TOOL):
        assert len(tracing.tap) == 1
    live.end()
    assert len(tracing.tap) == 0
    assert tracing.processor.force_flush() is True


# -- bad input: defined outcome, a log line, never an exception ---------------------------


def test_a_tool_span_without_attributes_takes_its_tool_name_from_the_span_name(
    tracing: Tracing, caplog: pytest.LogCaptureFixture
) -> None:
    tracer = tracing.provider.get_tracer("test")
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        tracer.start_as_current_span("execute_tool lookup") as span,
    ):
        live = tracing.tap.get(format(span.get_span_context().span_id, "016x"))
    assert live is not None
    assert (live.tool_name, live.conversation_id, live.llm_call_id) == ("lookup", None, None)
    assert "no gen_ai.tool.name attribute" in caplog.text
    assert tracing.processor.faults["no_tool_name"] >= 1


def test_non_string_ids_become_strings_when_integers_and_are_dropped_otherwise(
    tracing: Tracing, caplog: pytest.LogCaptureFixture
) -> None:
    tracer = tracing.provider.get_tracer("test")
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": ["not", "a", "name"],
        "gen_ai.conversation.id": 42,
        "gen_ai.tool.call.id": 1.5,
    }
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        tracer.start_as_current_span("execute_tool odd", attributes=attributes) as span,
    ):
        live = tracing.tap.get(format(span.get_span_context().span_id, "016x"))
    assert live is not None
    assert (live.tool_name, live.conversation_id, live.llm_call_id) == ("odd", "42", None)
    assert "gen_ai.tool.call.id is a float; ignored" in caplog.text


def test_a_tool_span_ending_twice_is_ignored_the_second_time(
    tracing: Tracing, caplog: pytest.LogCaptureFixture
) -> None:
    tracer = tracing.provider.get_tracer("test")
    span = tracer.start_span("execute_tool ask_colleague", attributes=TOOL)
    span.end()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tracing.processor.on_end(span)  # type: ignore[arg-type]
    assert len(tracing.sink.ended) == 1
    assert "ended twice; ignored" in caplog.text


def test_an_end_without_start_still_tells_the_sink(caplog: pytest.LogCaptureFixture) -> None:
    source = make_tracing()
    span = source.provider.get_tracer("test").start_span(
        "execute_tool ask_colleague", attributes=TOOL
    )
    span.end()
    sink = RecordingSink()
    processor = ToolSpanProcessor(tap=Tap(), sink=sink)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        processor.on_end(span)  # type: ignore[arg-type]
    [(call, error)] = sink.ended
    assert (call.call_id, call.tool_name, call.conversation_id, error) == (
        hex_id(span),  # type: ignore[arg-type]
        "ask_colleague",
        "conv-1",
        None,
    )
    assert "ended but was not live" in caplog.text
    source.close()


def test_a_tool_span_started_twice_is_recorded_once(
    tracing: Tracing, caplog: pytest.LogCaptureFixture
) -> None:
    span = tracing.provider.get_tracer("test").start_span(
        "execute_tool ask_colleague", attributes=TOOL
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tracing.processor.on_start(span)  # type: ignore[arg-type]
    assert len(tracing.tap) == 1
    assert "started twice; ignored" in caplog.text
    span.end()
    assert len(tracing.tap) == 0


@pytest.mark.parametrize("junk", [None, object(), 42, "execute_tool"])
def test_junk_instead_of_a_span_never_raises(junk: Any, caplog: pytest.LogCaptureFixture) -> None:
    processor = ToolSpanProcessor(tap=Tap(), sink=RecordingSink())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        processor.on_start(junk)
        processor.on_end(junk)
    assert "not recorded" in caplog.text
    assert len(processor.tap) == 0


class _FailingSink(RecordingSink):
    def tool_call_started(self, parent: LiveCall, child: LiveCall) -> None:
        raise RuntimeError("sink down")

    def tool_call_ended(self, call: LiveCall, error: str | None) -> None:
        raise RuntimeError("sink down")


def test_a_failing_sink_never_reaches_the_traced_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracing = make_tracing(sink=_FailingSink())
    tracer = tracing.provider.get_tracer("test")
    ran = []
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        tracer.start_as_current_span("execute_tool ask_colleague", attributes=TOOL),
        tracer.start_as_current_span("execute_tool search", attributes=TOOL),
    ):
        ran.append(True)
    assert ran == [True]
    assert len(tracing.tap) == 0
    assert "sink.tool_call_started failed" in caplog.text
    assert "sink.tool_call_ended failed" in caplog.text
    tracing.close()


def test_repeated_faults_are_counted_each_time_but_logged_rarely(
    tracing: Tracing, caplog: pytest.LogCaptureFixture
) -> None:
    tracer = tracing.provider.get_tracer("test")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(16):
            tracer.start_span("execute_tool lookup").end()
    assert tracing.processor.faults["no_tool_name"] == 16
    assert len([r for r in caplog.records if "no gen_ai.tool.name" in r.getMessage()]) == 5


def test_tool_spans_from_many_threads_at_once_all_start_and_end(tracing: Tracing) -> None:
    tracer = tracing.provider.get_tracer("test")
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            barrier.wait(10)
            for n in range(250):
                attributes = {**TOOL, "gen_ai.conversation.id": f"conv-{(t + n) % 4}"}
                with (
                    tracer.start_as_current_span(
                        "execute_tool ask_colleague", attributes=attributes
                    ),
                    tracer.start_as_current_span("execute_tool search", attributes=TOOL),
                ):
                    pass
        except BaseException as exc:  # collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(tracing.tap) == 0
    assert tracing.tap.conversations() == 0
    assert len(tracing.sink.ended) == 8 * 250 * 2
    assert len(tracing.sink.started) == 8 * 250
    assert tracing.processor.faults == {}


def _readable(
    span_id: int,
    attributes: Any,
    name: str = "execute_tool ask_colleague",
    context: SpanContext | None = None,
) -> Any:
    """A span that is not the SDK's live span: its attributes are whatever was passed (its
    context too, else trace 1, not sampled)."""
    return ReadableSpan(
        name=name,
        context=context or SpanContext(trace_id=1, span_id=span_id, is_remote=False),
        attributes=attributes,
        start_time=5,
    )


@pytest.mark.parametrize("attributes", [TOOL, dict(TOOL), None])
def test_spans_without_the_sdk_attribute_layout_are_read_through_the_public_mapping(
    attributes: Any,
) -> None:
    # on_start/on_end read the SDK's attribute dict directly; any other span must take
    # the public ``span.attributes`` and give the same result.

    sink = RecordingSink()
    processor = ToolSpanProcessor(tap=Tap(), sink=sink)
    wrapped = MappingProxyType(attributes) if attributes is not None else None
    span = _readable(0xABC, wrapped)
    processor.on_start(span)
    live = processor.tap.get("0000000000000abc")
    assert live is not None
    if attributes is None:  # a tool by its name only
        assert (live.tool_name, live.conversation_id, live.llm_call_id) == (
            "ask_colleague",
            None,
            None,
        )
    else:
        assert (live.tool_name, live.conversation_id, live.llm_call_id) == (
            "ask_colleague",
            "conv-1",
            "llm-1",
        )
    assert live.started_ns == 5
    processor.on_end(span)
    assert sink.ended == [(live, None)]
    assert len(processor.tap) == 0
    processor.on_end(_readable(0xABC, {"gen_ai.operation.name": "chat"}))  # not a tool
    assert len(sink.ended) == 1


def test_the_sdk_span_and_the_public_mapping_give_the_same_call(tracing: Tracing) -> None:
    span = tracing.provider.get_tracer("test").start_span(
        "execute_tool ask_colleague", attributes=TOOL
    )
    fast = tracing.tap.get(hex_id(span))  # type: ignore[arg-type]
    other = ToolSpanProcessor(tap=Tap(), sink=None)

    context = span.get_span_context()
    public = _readable(context.span_id, MappingProxyType(TOOL), context=context)
    public._start_time = fast.started_ns if fast else 0
    other.on_start(public)
    assert fast is not None
    assert other.tap.get(fast.call_id) == fast
    span.end()


@pytest.mark.parametrize("span_id", [0, -1, 1 << 64, (1 << 64) + 5])
def test_a_tool_span_with_an_invalid_span_id_is_ignored(
    span_id: int, caplog: pytest.LogCaptureFixture
) -> None:
    sink = RecordingSink()
    processor = ToolSpanProcessor(tap=Tap(), sink=sink)
    span = _readable(1, TOOL)
    span._context = SimpleNamespace(span_id=span_id)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        processor.on_start(span)
        processor.on_end(span)
    assert len(processor.tap) == 0
    assert sink.ended == []
    assert processor.faults == {"invalid_span_id": 2}


def test_the_largest_span_id_is_valid() -> None:
    processor = ToolSpanProcessor(tap=Tap(), sink=None)
    span = _readable((1 << 64) - 1, TOOL)
    processor.on_start(span)
    assert "ffffffffffffffff" in processor.tap
    processor.on_end(span)
    assert len(processor.tap) == 0
    assert processor.faults == {}


def test_the_calls_the_processor_builds_are_plain_immutable_live_calls(tracing: Tracing) -> None:
    span = tracing.provider.get_tracer("test").start_span(
        "execute_tool ask_colleague", attributes=TOOL
    )
    live = tracing.tap.get(hex_id(span))  # type: ignore[arg-type]
    assert live is not None
    assert type(live) is LiveCall
    same = LiveCall(*(getattr(live, name) for name in LiveCall._fields))
    assert live == same
    assert hash(live) == hash(same)
    assert repr(live) == repr(same)
    with pytest.raises(AttributeError):
        live.tool_name = "other"  # type: ignore[misc]
    span.end()


class _PartlySdkLikeSpan:
    """A span with the SDK's attribute layout (``_attributes._dict``) but none of its other
    private fields: the processor must take the public properties for all of them."""

    def __init__(self, span_id: int, attributes: dict[str, Any]) -> None:
        self._attributes = SimpleNamespace(_dict=dict(attributes))
        self.attributes = MappingProxyType(dict(attributes))
        self.name = "execute_tool ask_colleague"
        self.context = SimpleNamespace(span_id=span_id)
        self.parent = None
        self.start_time = 7
        self.status = Status(StatusCode.UNSET)
        self.events = ()


def test_a_span_with_only_part_of_the_sdk_layout_takes_the_public_properties() -> None:
    sink = RecordingSink()
    processor = ToolSpanProcessor(tap=Tap(), sink=sink)
    span: Any = _PartlySdkLikeSpan(0x1234, TOOL)
    processor.on_start(span)
    live = processor.tap.get("0000000000001234")
    assert live == LiveCall("0000000000001234", "ask_colleague", "conv-1", "llm-1", None, 7)
    processor.on_end(span)
    assert sink.ended == [(live, None)]
    assert processor.faults == {}
