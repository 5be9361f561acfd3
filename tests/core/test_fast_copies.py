"""Every rule that kernel_ext also runs as a fast inline copy, held to its readable version.

Each pair: the slow, readable version is the specification; a property test drives both
with generated inputs and fails on any difference (issue 27, part 2). The pairs:

* the span processor's tool-span classification, written out in ``on_start`` and again in
  ``on_end``: :func:`kernel_ext.attribution._conventions.tool_span_keys`;
* the fields ``on_start`` reads inline: the end-without-start rebuild, which reads them
  through the processor's helpers;
* the SDK span fields the processor reads inline: the public properties it reads on
  another span;
* the first case of :func:`kernel_ext.attribution.resolve.attribute`, inlined in
  ``StreamHub.publish``: ``attribute`` itself;
* ``take()``'s inline build of small running text: :func:`kernel_ext.stream.outgoing.build`
  (also ``tests/stream/test_stream_consumer.py``), its dict and its JSON text (cut per stream
  out of the rule's own text) alike, and the bound it trusts,
  :func:`kernel_ext.protocol.text_block_fast_limit`: the one size measure;
* the loopback sender's frames, written around their blocks' JSON text: the packet
  python-socketio itself encodes from the frame's dicts, byte for byte;
* :func:`kernel_ext.protocol.fits`' quick test, and ``decode``'s use of it: the exact
  :func:`kernel_ext.protocol.block_size`, and ``check_block``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

from kernel_ext.attribution import processor as processor_module
from kernel_ext.attribution import resolve
from kernel_ext.attribution._conventions import (
    CONVERSATION_ID,
    OI_KIND,
    OI_SESSION,
    OI_TOOL_CALL_ID,
    OI_TOOL_ID,
    OI_TOOL_NAME,
    OPERATION,
    TOOL_CALL_ID,
    TOOL_NAME,
    tool_span_keys,
)
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.resolve import ResolutionPath, attribute
from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.emit.loopback import _EncodedFrame, _packet_class
from kernel_ext.errors import DecodeError
from kernel_ext.instrument import ToolDescription, tool_call_scope
from kernel_ext.protocol import (
    Block,
    Envelope,
    block_size,
    check_block,
    decode,
    fits,
    text_block,
    text_block_fast_limit,
    wire_text,
)
from kernel_ext.stream import Progress, StreamHub
from kernel_ext.stream import hub as hub_module
from kernel_ext.stream.hub import ATTR_CALL_ID_PATH
from kernel_ext.stream.outgoing import CHAT_EVENT_STATE, ToolCallItem, build, take

# -- the span processor ---------------------------------------------------------------------

_PARENT_SPAN_ID = 0x00F067AA0BA902B7
_ACTIVE_SPAN_ID = 0xAA
_START = 1_700_000_000_000_000_000


class _DrawnIds(IdGenerator):
    """The SDK's id generator extension point, giving the span ids a test drew."""

    def __init__(self, span_ids: list[int]) -> None:
        self._span_ids = deque(span_ids)

    def generate_span_id(self) -> int:
        return self._span_ids.popleft()

    def generate_trace_id(self) -> int:
        return 0x4BF92F3577B34DA6A3CE929D0E0E4736


class _Sink:
    """A CallSink that records what it is told."""

    def __init__(self) -> None:
        self.started: list[tuple[LiveCall, LiveCall]] = []
        self.ended: list[tuple[LiveCall, str | None]] = []

    def tool_call_started(self, parent: LiveCall, child: LiveCall) -> None:
        self.started.append((parent, child))

    def tool_call_ended(self, call: LiveCall, error: str | None) -> None:
        self.ended.append((call, error))


_ODD = st.sampled_from([0, 7, -1, 2.5, True, False, ("a", "b")])  # valid OTel, not str
_NAMES = st.sampled_from(
    [
        "execute_tool search",
        "execute_tool ",
        "execute_tool",
        "Execute_tool search",
        " execute_tool search",
        "search.__call__",
        "search._run",
        "search",
        ".x",
        "",
        "  ",
    ]
) | st.text(max_size=12)


def _value(texts: list[str]) -> st.SearchStrategy[object]:
    return st.sampled_from(texts) | _ODD


# Each attribute absent, a string (the rule's, its case changed, empty) or another type.
_ATTRIBUTE_VALUES: dict[str, st.SearchStrategy[object]] = {
    OPERATION: _value(
        ["execute_tool", "EXECUTE_TOOL", "Execute_Tool", "execute_tool ", "chat", ""]
    ),
    OI_KIND: _value(["TOOL", "tool", "Tool", " TOOL", "LLM", "CHAIN", ""]),
    TOOL_NAME: _value(["search", "", " "]),
    OI_TOOL_NAME: _value(["lookup", "", " "]),
    CONVERSATION_ID: _value(["conv-1", ""]),
    OI_SESSION: _value(["sess-1", ""]),
    TOOL_CALL_ID: _value(["call_g", ""]),
    OI_TOOL_ID: _value(["call_t", ""]),
    OI_TOOL_CALL_ID: _value(["call_tc", ""]),
}


@st.composite
def _attributes(draw: st.DrawFn) -> dict[str, object]:
    present = draw(st.sets(st.sampled_from(sorted(_ATTRIBUTE_VALUES))))
    return {key: draw(_ATTRIBUTE_VALUES[key]) for key in sorted(present)}


@st.composite
def _tool_attributes(draw: st.DrawFn) -> dict[str, object]:
    """Attributes of a tool span of either convention (or of one named as a tool)."""
    attributes = draw(_attributes())
    convention = draw(st.sampled_from(["gen_ai", "openinference", "name"]))
    if convention == "gen_ai":
        attributes[OPERATION] = "execute_tool"
    else:
        attributes.pop(OPERATION, None)
        if convention == "openinference":
            attributes[OI_KIND] = "TOOL"
        else:
            attributes.pop(OI_KIND, None)
    return attributes


_SPAN_IDS = st.integers(1, 2**64 - 1) | st.sampled_from([1, 0xFF, 2**63, 2**64 - 1])
# What encloses the span: nothing, a live tool span (its parent), a span that is not a tool
# span, or an active tool call of the contextvar (with or without a conversation; live in
# the tap or not).
_ENCLOSING = st.sampled_from(
    ["none", "tool_parent", "other_parent", "active", "active_no_conv", "active_not_live"]
)


@contextlib.contextmanager
def _provider(processor: ToolSpanProcessor, span_ids: list[int]) -> Iterator[trace.Tracer]:
    provider = TracerProvider(id_generator=_DrawnIds(span_ids), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    try:
        yield provider.get_tracer("test_fast_copies")
    finally:
        provider.shutdown()


def _run_span(
    processor: ToolSpanProcessor,
    name: str,
    at_start: dict[str, object],
    later: dict[str, object],
    span_id: int,
    enclosing: str,
) -> tuple[tuple[LiveCall, ...], tuple[LiveCall, ...]]:
    """Start a real SDK span (``at_start`` attributes), set ``later`` on it, end it: the
    tap's calls while it runs and after it ended."""
    tap = processor.tap
    assume(span_id not in (_PARENT_SPAN_ID, _ACTIVE_SPAN_ID))
    ids = [_PARENT_SPAN_ID, span_id] if enclosing.endswith("_parent") else [span_id]
    with contextlib.ExitStack() as stack, _provider(processor, ids) as tracer:
        parent_context = None
        if enclosing in ("tool_parent", "other_parent"):
            attributes = (
                {OPERATION: "execute_tool", TOOL_NAME: "outer", CONVERSATION_ID: "conv-p"}
                if enclosing == "tool_parent"
                else {OPERATION: "chat"}
            )
            parent = tracer.start_span("parent", attributes=attributes, start_time=_START)  # type: ignore[arg-type]
            stack.callback(parent.end)
            parent_context = trace.set_span_in_context(parent)
        elif enclosing.startswith("active"):
            conversation = None if enclosing == "active_no_conv" else "conv-a"
            active = LiveCall("00000000000000aa", "outer", conversation)
            if enclosing != "active_not_live":
                tap.add(active)
                stack.callback(tap.discard, active.call_id)
            stack.enter_context(use_tool_call(ToolCall(active.call_id, "outer", conversation)))
        span = tracer.start_span(
            name,
            context=parent_context,
            attributes=at_start,  # type: ignore[arg-type]
            start_time=_START,
        )
        during = tap.snapshot()
        span.set_attributes(later)  # type: ignore[arg-type]
        span.end()
        return during, tap.snapshot()


@settings(max_examples=400, deadline=None)
@given(_NAMES, _attributes(), _attributes(), _SPAN_IDS, _ENCLOSING)
@example("execute_tool search", {}, {}, 1, "none")
@example("x", {OI_KIND: "tool"}, {}, 2**64 - 1, "none")  # OpenInference's kind, but lower case
@example("execute_tool x", {OPERATION: "chat"}, {}, 5, "none")  # the operation decides
@example("execute_tool x", {OI_KIND: "LLM"}, {}, 5, "none")  # so does the kind
@example("x", {}, {OPERATION: "execute_tool"}, 5, "none")  # a tool span only at its end
@example("x", {OPERATION: "execute_tool"}, {OPERATION: "chat"}, 5, "none")  # only at start
def test_the_processors_inline_span_classification_is_the_readable_rule_for_every_span(
    name: str, at_start: dict[str, object], later: dict[str, object], span_id: int, enclosing: str
) -> None:
    # on_start and on_end each write out tool_span_keys, inline: a span enters the tap at its
    # start exactly when the rule says so of its start, and its end is told to the sink
    # exactly when the rule says so of its end.
    sink = _Sink()
    processor = ToolSpanProcessor(tap=Tap(), sink=sink)
    during, after = _run_span(processor, name, at_start, later, span_id, enclosing)
    call_id = f"{span_id:016x}"
    at_end = {**at_start, **later}
    tool_at_start = tool_span_keys(at_start, name) is not None
    tool_at_end = tool_span_keys(at_end, name) is not None

    assert (call_id in [c.call_id for c in during]) is tool_at_start
    ended = [c.call_id for c, _ in sink.ended if c.call_id == call_id]
    assert ended == ([call_id] if tool_at_end else [])
    assert (call_id in [c.call_id for c in after]) is (tool_at_start and not tool_at_end)
    faults = processor.faults
    assert faults.get("end_without_start", 0) == (tool_at_end and not tool_at_start)
    assert "internal_error" not in faults
    assert "invalid_span_id" not in faults


@settings(max_examples=300, deadline=None)
@given(_NAMES, _tool_attributes(), _SPAN_IDS)
@example("search.__call__", {OI_KIND: "TOOL", OI_TOOL_ID: "", OI_TOOL_CALL_ID: "c"}, 3)
@example("search.__call__", {OI_KIND: "TOOL", OI_TOOL_ID: 2.5, OI_TOOL_CALL_ID: "c"}, 3)
@example("execute_tool  x ", {OPERATION: "execute_tool", TOOL_NAME: 0}, 3)
def test_the_fields_on_start_reads_inline_are_those_its_readable_rebuild_reads(
    name: str, attributes: dict[str, object], span_id: int
) -> None:
    # on_start reads the call's fields inline; a tool span that ends without having started
    # (here: on a processor that did not see its start) is rebuilt from the span through the
    # processor's readable helpers. The same span gives the same call either way.
    if tool_span_keys(attributes, name) is None:
        return
    started = ToolSpanProcessor(tap=Tap())
    rebuilt_sink = _Sink()
    rebuilder = ToolSpanProcessor(tap=Tap(), sink=rebuilt_sink)
    with _provider(started, [span_id]) as tracer:
        span = tracer.start_span(name, attributes=attributes)  # type: ignore[arg-type]
        [inline] = started.tap.snapshot()
        span.end()
    rebuilder.on_end(span)  # type: ignore[arg-type]
    [(rebuilt, _)] = rebuilt_sink.ended
    assert rebuilt == inline
    # and the faults each counted on the way
    assert {k: v for k, v in rebuilder.faults.items() if k != "end_without_start"} == (
        started.faults
    )


# What a describe hook may say: the tool names and model call ids the spans above may carry
# (ints as the processor reads them: decimal text), and others. Not "unknown": the
# processor's placeholder for a tool span without any usable name, which names no tool.
_DESCRIPTIONS = st.builds(
    ToolDescription,
    st.sampled_from(["search", "lookup", "x", "Search", " search", "search "]),
    st.none(),
    st.sampled_from([None, "call_g", "call_t", "call_tc", "0", "7", "-1", "other"]),
)


@settings(max_examples=500, deadline=None)
@given(_NAMES, _attributes(), _DESCRIPTIONS)
@example("execute_tool search", {}, ToolDescription("search"))  # named as a tool only
@example(
    "s", {OI_KIND: "TOOL", OI_TOOL_ID: "", OI_TOOL_CALL_ID: "c"}, ToolDescription("s", None, "c")
)
@example(
    "s", {OI_KIND: "TOOL", OI_TOOL_ID: "", OI_TOOL_CALL_ID: "c"}, ToolDescription("s", None, "d")
)
@example("x", {OI_KIND: "TOOL", OI_TOOL_NAME: ""}, ToolDescription("x"))  # name from the span
@example("x", {OPERATION: "execute_tool", TOOL_CALL_ID: 7}, ToolDescription("y", None, "7"))
@example("x", {OPERATION: "execute_tool", TOOL_NAME: True}, ToolDescription("x"))
def test_a_tool_call_scope_reuses_a_span_exactly_when_the_processor_reads_it_as_that_call(
    name: str, attributes: dict[str, object], description: ToolDescription
) -> None:
    # The tool-call scope (and the instrumentor) reuses the current span as the call's own
    # when it is this call's tool span. Its test reads the span as the span processor does:
    # a tool span by the processor's classification; the same call when both model call ids
    # are known and equal, else when the tool name the processor reads equals the call's.
    processor = ToolSpanProcessor(tap=Tap())
    provider = TracerProvider(id_generator=_DrawnIds([5, 6]), shutdown_on_exit=False)
    provider.add_span_processor(processor)
    try:
        span = provider.get_tracer("test_fast_copies").start_span(name, attributes=attributes)  # type: ignore[arg-type]
        read = processor.tap.snapshot()
        with (
            trace.use_span(span, end_on_exit=True),
            tool_call_scope(description, tracer_provider=provider) as call,
        ):
            pass
    finally:
        provider.shutdown()
    if read:
        [live] = read
        if live.llm_call_id is not None and description.llm_call_id is not None:
            expected = live.llm_call_id == description.llm_call_id
        else:
            expected = live.tool_name == description.tool_name
    else:
        expected = False  # not a tool span
    assert call is not None
    assert (call.call_id == f"{5:016x}") is expected


def _outcome(sink: _Sink, processor: ToolSpanProcessor, during: Any, after: Any) -> Any:
    return sink.started, sink.ended, during, after, processor.faults


@settings(max_examples=200, deadline=None)
@given(_NAMES, _attributes(), _attributes(), _SPAN_IDS, _ENCLOSING)
def test_the_sdk_span_fields_read_inline_give_what_the_public_properties_give(
    name: str, at_start: dict[str, object], later: dict[str, object], span_id: int, enclosing: str
) -> None:
    # On the SDK's own spans the processor reads their private fields (kernel_ext._shared.compat
    # probed them); on any other span the public properties. Forced to the public ones, the
    # same spans give the same tap, the same sink calls and the same faults.
    def run() -> Any:
        sink = _Sink()
        processor = ToolSpanProcessor(tap=Tap(), sink=sink)
        during, after = _run_span(processor, name, at_start, later, span_id, enclosing)
        return _outcome(sink, processor, during, after)

    inline = run()
    with (
        mock.patch.object(processor_module, "_SDK_SPAN_FIELDS", False),
        mock.patch.object(processor_module, "_INDEXED_CONTEXT", type("_None", (), {})),
    ):
        public = run()
    assert inline == public


@settings(max_examples=200, deadline=None)
@given(_NAMES, _tool_attributes(), _SPAN_IDS, _ENCLOSING)
@example("execute_tool x", {}, 5, "active_not_live")
def test_a_tool_span_is_linked_to_its_enclosing_call_as_the_docs_say(
    name: str, attributes: dict[str, object], span_id: int, enclosing: str
) -> None:
    # The enclosing call: the parent span when it is a live tool span, else the contextvar's
    # active call when it is live; the conversation not given is the active call's, else
    # the enclosing call's.
    keys = tool_span_keys(attributes, name)
    if keys is None:
        return
    sink = _Sink()
    processor = ToolSpanProcessor(tap=Tap(), sink=sink)
    during, _ = _run_span(processor, name, attributes, {}, span_id, enclosing)
    [call] = [c for c in during if c.call_id == f"{span_id:016x}"]
    own = attributes.get(keys.conversation_id)
    own_text = (
        own
        if isinstance(own, str) and own
        else str(own)
        if isinstance(own, int) and not isinstance(own, bool)
        else None
    )
    parent = {
        "tool_parent": f"{_PARENT_SPAN_ID:016x}",
        "active": "00000000000000aa",
        "active_no_conv": "00000000000000aa",
    }.get(enclosing)
    inherited = {"tool_parent": "conv-p", "active": "conv-a", "active_not_live": "conv-a"}
    assert call.parent_call_id == parent
    assert call.conversation_id == (own_text or inherited.get(enclosing))
    assert [(p.call_id, c.call_id) for p, c in sink.started] == (
        [(parent, call.call_id)] if parent is not None else []
    )


# -- attribution: publish's inline first case and resolve.attribute ------------------------

_CALLS = ["00000000000000a1", "00000000000000a2", "00000000000000a3"]
_CONVERSATIONS = st.sampled_from([None, "conv-1", "conv-2"])
_TOOLS = st.sampled_from(["ask_colleague", "search"])


@st.composite
def _attribution_case(draw: st.DrawFn) -> dict[str, Any]:
    """The live calls of the tap (0, 1, 2 or more candidates), an active call or none
    (with or without a conversation), and what publish is asked."""
    live = [
        LiveCall(call_id, draw(_TOOLS), draw(_CONVERSATIONS))
        for call_id in draw(st.lists(st.sampled_from(_CALLS), unique=True, max_size=3))
    ]
    active = draw(
        st.none() | st.builds(ToolCall, st.just("00000000000000c1"), _TOOLS, _CONVERSATIONS)
    )
    return {
        "live": live,
        "evicted": draw(st.booleans()),  # a candidate evicted while live: ambiguous
        "active": active,
        "conversation_id": draw(_CONVERSATIONS),
        "tool_name": draw(_TOOLS),
        "state": draw(st.sampled_from(["running", "running", "done", "aborted"])),
        "task_id": draw(st.sampled_from([None, "t"])),
    }


class _Recorder:
    """A counter's ``add``, recorded (stands in for the OpenTelemetry counter behind each
    path's batched count, so a test reads the resolutions one publish counted)."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, amount: int, attributes: Any = None) -> None:
        self.total += amount


@contextlib.contextmanager
def _resolutions() -> Iterator[dict[str, _Recorder]]:
    resolve.flush_metrics()
    recorders = {path.value: _Recorder() for path in ResolutionPath}
    with contextlib.ExitStack() as stack:
        for path, count in resolve._COUNTS.items():
            stack.enter_context(mock.patch.object(count, "_counter", recorders[path.value]))
        yield recorders
        resolve.flush_metrics()


def _tap_of(case: dict[str, Any]) -> Tap:
    tap = Tap(max_calls=4)
    if case["evicted"]:
        for n in range(5):  # the first is evicted while live: its name is unsure
            tap.add(LiveCall(f"00000000000000e{n}", case["tool_name"], case["conversation_id"]))
        for n in range(5):
            tap.discard(f"00000000000000e{n}")
    for call in case["live"]:
        tap.add(call)
    return tap


def _publish(case: dict[str, Any], loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """One publish of ``case``: what became of it, as far as anyone can see."""
    hub = StreamHub(max_running_per_second=None, tap=_tap_of(case))
    consumer = hub.attach_sender(loop)
    with contextlib.ExitStack() as stack:
        if case["active"] is not None:
            stack.enter_context(use_tool_call(case["active"]))
        with _resolutions() as recorders:
            hub.publish(
                "text",
                case["task_id"],
                case["state"],
                case["conversation_id"],
                case["tool_name"],
            )
    taken = consumer.take_nowait()
    blocks = [(b.room, b.call_id, b.block["state"]) for b in taken]  # type: ignore[union-attr]
    counts = {k: v for k, v in hub.stats().counts.items() if v}
    paths = {c: hub.call_attributes(c).get(ATTR_CALL_ID_PATH) for _, c, _ in blocks if c}
    resolutions = {path: r.total for path, r in recorders.items() if r.total}
    return {"blocks": blocks, "counts": counts, "paths": paths, "resolutions": resolutions}


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop that never runs: the consumer only needs one to be attached."""
    new = asyncio.new_event_loop()
    yield new
    new.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_attribution_case())
def test_publish_attributes_every_block_as_resolve_attribute_decides(
    case: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> None:
    # publish takes attribute's first case (the active call) inline. What it does with a
    # block — its callId, its room, the path on the call's span, the one resolution counted
    # — is what attribute's answer says, in every case.
    with contextlib.ExitStack() as stack:
        if case["active"] is not None:
            stack.enter_context(use_tool_call(case["active"]))
        with _resolutions():
            call_id, room, path, _ = attribute(
                case["conversation_id"], case["tool_name"], _tap_of(case)
            )
    seen = _publish(case, loop)
    assert seen["resolutions"] == {path: 1}
    if case["state"] == "running":
        dropped = "unattributed" if call_id is None else "no_room" if room is None else None
    else:  # a terminal's stream is its task id, else the callId
        no_task = case["task_id"] is None and call_id is None
        dropped = "no_task_id" if no_task else "no_room" if room is None else None
    if dropped is not None:
        assert seen["blocks"] == []
        assert seen["counts"] == {dropped: 1}
        return
    assert seen["blocks"] == [(room, call_id, case["state"])]
    if call_id is not None:
        assert seen["paths"] == {call_id: path}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_attribution_case())
def test_publish_through_its_inline_first_case_is_publish_through_attribute(
    case: dict[str, Any], loop: asyncio.AbstractEventLoop
) -> None:
    # The same publish with the inline first case taken out of the way (publish then asks
    # attribute for every block, the active call included): the same everything.
    inline = _publish(case, loop)
    with mock.patch.object(hub_module, "_current_tool_call", return_value=None):
        general = _publish(case, loop)
    assert inline == general


# -- take()'s inline build, and the bound it trusts ---------------------------------------

_CHARACTERS = st.sampled_from(["x", "\x01", '"', "\\", "中", "😀", "\ud800", "\u2028"])
_BOUNDS = st.sampled_from([300, 600, 2048, 65536])


def _text_of(size: int) -> st.SearchStrategy[str]:
    """A text of ``size`` characters, of one character or a mix (every width of JSON)."""
    return _CHARACTERS.map(lambda c: c * size) | st.tuples(
        st.text(_CHARACTERS, max_size=min(size, 40)), _CHARACTERS
    ).map(lambda mix: (mix[0] + mix[1] * size)[:size])


@st.composite
def _item(draw: st.DrawFn, fast: int, stream: tuple[str | None, str]) -> tuple[Any, ...]:
    """A queue item of every shape the hub queues, its text sized around the inline limit."""
    call_id, task_id = stream
    state = draw(st.sampled_from(["running"] * 5 + ["done", "aborted", CHAT_EVENT_STATE]))
    room = "conv-1"
    if state == CHAT_EVENT_STATE:
        return (room, None, "", state, 0, {"type": "snapshot", "n": draw(st.integers())}, 0, None)
    size = draw(
        st.integers(0, 3)
        | st.integers(max(0, fast - 2 * len(task_id) - 3), max(0, fast - 2 * len(task_id) + 3))
        | st.integers(0, fast + 50)
    )
    item = draw(
        _text_of(size)
        | st.builds(ToolCallItem, st.sampled_from(["search", "x" * 600]), st.just(_CALLS[0]))
        | st.builds(
            Progress,
            st.floats(allow_nan=True, allow_infinity=True) | st.integers(0, 10),
            st.none() | st.floats(0, 100),
            st.none() | _text_of(size),
        )
        | st.builds(
            lambda text, kind: Envelope(
                kind=kind, stream_key="s", seq=1, status=state, payload={"text": text}
            ),
            _text_of(size),
            st.sampled_from(["text", "future_kind"]),
        )
        | st.builds(
            lambda text, seq: {
                "v": 1,
                "kind": "text",
                "streamKey": task_id[:512] or "t",
                "seq": seq,
                "status": state,
                "payload": {"text": text},
            },
            _text_of(size),
            st.integers(0, 3) | st.just(-1) | st.just("x"),
        )
        | st.sampled_from([42, None, b"bytes"])
    )
    at = draw(st.floats(0, 1e7, allow_nan=False))
    seq = draw(st.integers(0, 2**31))
    return (room, call_id, task_id, state, at, item, seq, _TRACES[call_id])


# The traceId the hub queues with a call's items: the call's own (one with, one without).
_TRACES = {None: None, _CALLS[0]: "4bf92f3577b34da6a3ce929d0e0e4736", _CALLS[1]: None}
_TASK_IDS = st.sampled_from(["t", "中", "\x01" * 40, "t" * 512, "t" * 513, ""]) | st.text(
    _CHARACTERS, min_size=1, max_size=20
)


@st.composite
def _batch(draw: st.DrawFn) -> tuple[int, list[tuple[Any, ...]]]:
    bound = draw(_BOUNDS)
    fast = text_block_fast_limit(bound)
    streams = draw(
        st.lists(st.tuples(st.sampled_from([None, *_CALLS[:2]]), _TASK_IDS), min_size=1, max_size=3)
    )
    items = draw(st.lists(st.sampled_from(streams).flatmap(lambda s: _item(fast, s)), max_size=12))
    return bound, items


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batch(), st.integers(1, 5), st.floats(1.6e9, 1.9e9, allow_nan=False))
@example(  # a stream the inline build cannot take (its task id is too long), empty text
    (300, [("conv-1", None, "t" * 513, "running", 0.0, "", 0, None)]), 1, 1.6e9
)
@example(  # a task id one over the bound, on a bound whose inline limit holds it
    (65536, [("conv-1", _CALLS[0], "t" * 513, "running", 0.0, "a", 1, "4bf9" * 8)]), 1, 1.7e9
)
def test_take_builds_every_block_shape_and_size_as_the_general_build_does(
    batch: tuple[int, list[tuple[Any, ...]]], max_items: int, wall_offset: float
) -> None:
    # take() builds small running text inline, trusting text_block_fast_limit; build() is the
    # specification: the same items, drops and wire text for every shape (text, a nested
    # call, progress, an envelope object or mapping, a terminal, a chat event), any
    # alphabet, any size around the inline limit, any size bound; and every block it makes
    # is one the relay's exact check accepts within the bound.
    bound, items = batch
    fast = text_block_fast_limit(bound)
    taken_drops: list[Any] = []
    built_drops: list[Any] = []
    queue: deque[Any] = deque(items)
    taken: list[Any] = []
    while queue:
        taken += take(
            queue, max_items, bound, fast, lambda *a, **k: taken_drops.append((a, k)), wall_offset
        )
    expected = [
        build(raw, bound, fast, lambda *a, **k: built_drops.append((a, k)), wall_offset)  # type: ignore[arg-type]
        for raw in items
    ]
    expected = [out for out in expected if out is not None]
    assert taken == expected
    assert taken_drops == built_drops
    assert [json.dumps(getattr(o, "block", None)) for o in taken] == [
        json.dumps(getattr(o, "block", None)) for o in expected
    ]
    for raw in items:  # the ones take() builds inline: what the relay's exact check accepts
        _, _, task_id, state, _, item, _, _ = raw
        inline = state == "running" and item.__class__ is str and task_id.__class__ is str
        small = inline and 0 < len(task_id) <= 512 and len(item) + 2 * len(task_id) <= fast
        if small and not _has_lone_surrogate(task_id):  # lone surrogates: dropped, below
            [out] = take(deque([raw]), 1, bound, fast, lambda *a, **k: None, wall_offset)
            check_block(out.block, max_bytes=bound)  # type: ignore[union-attr]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batch(), st.floats(1.6e9, 1.9e9, allow_nan=False))
def test_an_inline_blocks_text_and_dict_are_the_rules_whatever_it_holds(
    batch: tuple[int, list[tuple[Any, ...]]], wall_offset: float
) -> None:
    # The inline build keeps a running text block's parts and makes its dict and its JSON
    # text when a sender reads them: the dict is text_block's, the text python-socketio's
    # encoding of that dict (json.dumps, compact), in either order of reading.
    bound, items = batch
    fast = text_block_fast_limit(bound)
    for raw in items:
        for text_first in (False, True):
            taken = take(deque([raw]), 1, bound, fast, lambda *a, **k: None, wall_offset)
            if not taken or not hasattr(taken[0], "text"):
                continue
            out: Any = taken[0]
            text = out.text if text_first else None
            block = out.block
            assert (text or out.text) == json.dumps(block, separators=(",", ":"))
            _, call_id, task_id, state, at, item, seq, trace_id = raw
            if (
                state == "running"
                and isinstance(item, str)
                and len(item) + 2 * len(task_id) <= fast
            ):
                ts = int((at + wall_offset) * 1000 // 1)
                assert block == text_block(call_id, task_id, state, ts, seq, item, trace_id)


_ROOMS = st.sampled_from(["conv-1", 'c"2', "会话\3", "\u0041", "\ud800"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batch(), st.lists(_ROOMS, min_size=1, max_size=3, unique=True), st.data())
def test_a_frame_sent_as_its_blocks_text_is_the_packet_python_socketio_would_send(
    batch: tuple[int, list[tuple[Any, ...]]], rooms: list[str], data: st.DataObject
) -> None:
    # The loopback sender writes a kx_blocks frame around its blocks' text; python-socketio
    # encoding the same frame's dicts is the specification: the same packet, byte for byte,
    # for one room and for several, any block shape, any alphabet.
    bound, items = batch
    fast = text_block_fast_limit(bound)
    blocks = [
        b
        for b in take(deque(items), 64, bound, fast, lambda *a, **k: None, 1.7e9)
        if hasattr(b, "text")
    ]
    assume(blocks)
    sections = [
        (room, [b for i, b in enumerate(blocks) if i % len(rooms) == n])
        for n, room in enumerate(rooms)
    ]
    sections = [section for section in sections if section[1]]
    import socketio

    if len(sections) == 1:
        as_dicts: Any = {"v": 1, "room": sections[0][0], "blocks": [b.block for b in blocks]}
    else:
        as_dicts = {
            "v": 1,
            "rooms": [{"room": r, "blocks": [b.block for b in bs]} for r, bs in sections],
        }
    ack_id = data.draw(st.none() | st.integers(1, 10**6))
    theirs = socketio.packet.Packet(
        socketio.packet.EVENT, data=["kx_blocks", as_dicts], namespace="/chat", id=ack_id
    ).encode()
    ours = _packet_class()(
        socketio.packet.EVENT,
        data=["kx_blocks", _EncodedFrame.of(sections)],
        namespace="/chat",
        id=ack_id,
    ).encode()
    assert ours == theirs
    # and every other packet of the sender's client is python-socketio's own
    other = ["kx_hello", {"worker": "w-1", "text": "中\ud800"}]
    assert _packet_class()(socketio.packet.EVENT, data=other, namespace="/chat").encode() == (
        socketio.packet.Packet(socketio.packet.EVENT, data=other, namespace="/chat").encode()
    )
    assert wire_text(as_dicts) == json.dumps(as_dicts, separators=(",", ":"))


def _has_lone_surrogate(text: object) -> bool:
    return isinstance(text, str) and any("\ud800" <= c <= "\udfff" for c in text)


@pytest.mark.parametrize("task_id", ["t\ud800", "\udfff", "ok\udc80ok"])
def test_a_running_text_block_on_a_task_id_with_a_lone_surrogate_is_dropped_as_invalid(
    task_id: str,
) -> None:
    # The block model (hence the relay) refuses a lone surrogate: the sender must not build
    # such a block inline, but drop it, counted, as the general path does.
    raw = ("conv-1", _CALLS[0], task_id, "running", 1.0, "text", 1, None)
    drops: list[tuple[Any, ...]] = []
    taken = take(
        deque([raw]), 1, 2048, text_block_fast_limit(2048), lambda *a, **k: drops.append(a), 0.0
    )
    assert taken == []
    assert drops == [("invalid",)]


@settings(max_examples=500, deadline=None)
@given(
    st.integers(0, 70_000),
    st.data(),
    st.sampled_from([None, "00f067aa0ba902b7"]),
    st.sampled_from(["running", "done", "aborted"]),
)
@example(300, None, None, "aborted")  # the smallest bound with room for one character
def test_a_text_block_within_the_inline_limit_is_within_the_bound_whatever_it_holds(
    bound: int, data: st.DataObject | None, call_id: str | None, state: str
) -> None:
    # text_block_fast_limit is the bound the senders trust instead of measuring: any text
    # and task id within it, of any characters, make a valid block within max_bytes by the
    # one measure (block_size), with the largest ts and seq a block can carry and a traceId.
    limit = text_block_fast_limit(bound)
    if data is None:
        task_id, text = "\x01" * (limit // 2) or "t", "\x01" * (limit - 2 * (limit // 2))
    else:
        task_chars = data.draw(st.integers(1, max(1, min(512, limit // 2))))
        char = data.draw(_CHARACTERS.filter(lambda c: not _has_lone_surrogate(c)))
        task_id = char * task_chars
        text = data.draw(_CHARACTERS) * max(0, limit - 2 * task_chars)
    if len(text) + 2 * len(task_id) > limit:
        return
    wire = text_block(call_id, task_id, state, 2**53, 2**63, text, "f" * 32)
    Block.model_validate(wire)
    assert block_size(wire) <= bound


# -- the quick size test and the one measure -------------------------------------------------

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(0, 300).flatmap(_text_of),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(_CHARACTERS, max_size=4), children, max_size=4)
    ),
    max_leaves=25,
)


@settings(max_examples=500, deadline=None)
@given(_JSON, st.data())
@example("😀" * 60, None)  # every character 4 bytes: the quick test's ratio
def test_fits_is_the_one_size_measure_for_any_json_and_bound(
    value: Any, data: st.DataObject | None
) -> None:
    # fits skips measuring a block whose repr is small enough; it must answer what
    # block_size <= max_bytes answers, at every bound (exactly at the size, one under, and
    # around the quick test's threshold).
    wire = {"payload": value}
    size = block_size(wire)
    quick = len(repr(wire)) * 4
    bounds = {size, size - 1, quick, quick - 1, (quick * 3) // 4, size + 1}
    if data is not None:
        bounds.add(data.draw(st.integers(0, quick + 10)))
    for bound in bounds:
        assert fits(wire, bound) is (size <= bound), bound


def _wire_block(
    text: Any, task_id: Any, state: str, call_id: Any, extra: dict[str, Any]
) -> dict[str, Any]:
    return {**text_block(call_id, task_id, state, 1, 1, text), **extra}


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 700).flatmap(_text_of) | st.integers(0, 3) | st.none(),
    _TASK_IDS | st.just(7),
    st.sampled_from(["running", "done", "aborted", "bogus"]),
    st.sampled_from([None, "00f067aa0ba902b7", "00F067AA0BA902B7", 5]),
    st.sampled_from([{}, {"extra": 1}]),
    st.integers(150, 3000) | st.integers(-2, 2).map(lambda off: ("off the size by", off)),
)
@example("x", "t", "running", None, {}, ("off the size by", 0))  # exactly at the bound
@example("x", "t", "running", None, {}, ("off the size by", -1))  # one byte over it
def test_decode_with_the_quick_size_test_accepts_exactly_what_the_exact_check_accepts(
    text: Any,
    task_id: Any,
    state: str,
    call_id: Any,
    extra: dict[str, Any],
    bound: int | tuple[str, int],
) -> None:
    # decode() measures a block only when fits' quick test cannot tell; check_block (the
    # relay's) always measures. Same block, same bound (any, or the block's own size give
    # or take two bytes): the same answer and the same error.
    wire = _wire_block(text, task_id, state, call_id, extra)
    if isinstance(bound, tuple):
        bound = block_size(wire) + bound[1]

    def outcome(check: Any) -> Any:
        try:
            check(wire, max_bytes=bound)
        except DecodeError as exc:
            return type(exc), str(exc), exc.field
        return "ok"

    assert outcome(decode) == outcome(check_block)
    if outcome(check_block) == "ok":
        assert block_size(wire) <= bound
