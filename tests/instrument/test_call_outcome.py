"""A call's pane ends the way the call ended (issue 23, part 4), on a plain runtime that
kernel_ext's instrumentor wraps: the stream kernel_ext opened for the call's nested tool
calls ends ``done`` with the call's result text when the call returns, ``aborted`` with the
error when it raises or is cancelled; a stream the tool opened itself and left open keeps
``aborted`` with the default message. Every stream has exactly one terminal, and the pane
reads as the reference reducer (:mod:`kernel_ext.viewing.view`) shows it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from support.attribution_helpers import pane_reads

import kernel_ext
from kernel_ext import ToolDescription, current_call_id, publish
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import Tap
from kernel_ext.instrument import tool_call_scope
from kernel_ext.stream import StreamHub
from kernel_ext.testing import MemoryEmitter
from kernel_ext.worker import wiring

CONV = "conv-outcome"
TARGETS = [f"{__name__}:{name}" for name in ("lookup", "alookup", "research", "aresearch", "steps")]


class Boom(Exception):
    pass


def lookup(city: str, **kwargs: Any) -> str:
    """The nested tool."""
    return f"3 stations in {city}"


async def alookup(city: str, **kwargs: Any) -> str:
    """The nested tool, async."""
    await asyncio.sleep(0)
    return f"3 stations in {city}"


def research(plan: Any, **kwargs: Any) -> Any:
    """A tool that calls tools and then does what ``plan`` says."""
    seen.append(current_call_id())
    lookup("Lyon", tool_name="lookup")
    lookup("Nice", tool_name="lookup")
    return plan()


async def aresearch(plan: Any, **kwargs: Any) -> Any:
    seen.append(current_call_id())
    await alookup("Lyon", tool_name="lookup")
    await alookup("Nice", tool_name="lookup")
    result = plan()
    if asyncio.iscoroutine(result):
        result = await result
    return result


def steps(**kwargs: Any) -> Generator[str, None, str]:
    """A generator tool: its return value is the call's result."""
    seen.append(current_call_id())
    yield lookup("Lyon", tool_name="lookup")
    return "stepped through Lyon"


seen: list[str | None] = []


@pytest.fixture(autouse=True)
def _always_disable() -> Iterator[None]:
    yield
    wiring.disable(timeout=2)


@pytest.fixture
async def emitter() -> AsyncIterator[MemoryEmitter]:
    provider = TracerProvider()
    memory = MemoryEmitter()
    kernel_ext.enable(
        emitter=memory, tracer_provider=provider, targets=TARGETS, tap=Tap(), handle_sigterm=False
    )
    seen.clear()
    try:
        yield memory
    finally:
        await kernel_ext.adisable()
        provider.shutdown()


async def run(kind: str, plan: Any) -> Any:
    if kind == "sync":
        return research(plan, tool_name="research", conversation_id=CONV)
    return await aresearch(plan, tool_name="research", conversation_id=CONV)


async def pane_of(emitter: MemoryEmitter, blocks: int) -> tuple[str, list[dict[str, Any]]]:
    """The research call's id and its blocks, once ``blocks`` blocks were sent; checks that
    every stream has exactly one terminal, last, and that the hub holds nothing more."""
    await emitter.wait_for(lambda records: len(records) >= blocks)
    await emitter.flush(2)
    [call_id] = seen
    assert call_id is not None
    mine = [b for b in emitter.blocks(CONV) if b["callId"] == call_id]
    assert len(emitter.records) == blocks
    for task_id in {b["taskId"] for b in mine}:
        states = [b["state"] for b in mine if b["taskId"] == task_id]
        assert states[-1] != "running", states
        assert sum(state != "running" for state in states) == 1, states
    stats = kernel_ext.stream.get_default_hub().stats()
    assert (stats.calls, stats.streams, stats["error"]) == (0, 0, 0)
    return call_id, mine


def ending(blocks: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The state and payload of the last of ``blocks`` (a stream's: its terminal)."""
    return blocks[-1]["state"], blocks[-1]["envelope"]["payload"]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_call_that_only_calls_tools_and_returns_ends_done_with_its_result(
    emitter: MemoryEmitter, kind: str
) -> None:
    answer = "Lyon and Nice have 6 stations"
    assert await run(kind, lambda: answer) == answer
    call_id, blocks = await pane_of(emitter, 3)
    assert [
        (b["taskId"], b["envelope"]["kind"], b["envelope"]["seq"], b["state"]) for b in blocks
    ] == [
        (call_id, "tool_call", 1, "running"),
        (call_id, "tool_call", 2, "running"),
        (call_id, "text", 3, "done"),
    ]
    assert [b["envelope"]["payload"]["toolName"] for b in blocks[:2]] == ["lookup", "lookup"]
    assert ending(blocks) == ("done", {"text": answer})
    assert pane_reads(blocks, call_id) == ("ended", "done", answer)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_call_that_returns_no_text_ends_done_with_the_neutral_text(
    emitter: MemoryEmitter, kind: str
) -> None:
    await run(kind, lambda: {"stations": 6})
    _, blocks = await pane_of(emitter, 3)
    assert ending(blocks) == ("done", {"text": "the tool call finished"})


class UnreadableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("unreadable")


@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        ("sync", Boom("no trains today"), "Boom: no trains today"),
        ("async", Boom("no trains today"), "Boom: no trains today"),
        ("sync", KeyboardInterrupt(), "the tool call was interrupted (KeyboardInterrupt)"),
        ("sync", UnreadableError(), "UnreadableError"),  # its message cannot be read
    ],
    ids=["sync", "async", "interrupted", "unreadable"],
)
async def test_a_call_that_raises_ends_aborted_with_its_error(
    emitter: MemoryEmitter, kind: str, error: BaseException, message: str
) -> None:
    def fail() -> None:
        raise error

    with pytest.raises(type(error)) as raised:
        await run(kind, fail)
    assert raised.value is error  # unchanged
    call_id, blocks = await pane_of(emitter, 3)
    assert ending(blocks) == ("aborted", {"message": message})
    assert pane_reads(blocks, call_id) == ("ended", "aborted", message)


async def test_a_lone_surrogate_in_the_error_reaches_span_and_pane_as_u_fffd() -> None:
    # A span exporter encodes UTF-8 (OTLP: protobuf), which cannot hold a lone surrogate:
    # one in the error's message would lose the span's whole export batch.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    memory = MemoryEmitter()
    kernel_ext.enable(
        emitter=memory, tracer_provider=provider, targets=TARGETS, tap=Tap(), handle_sigterm=False
    )
    seen.clear()

    def fail() -> None:
        publish("before \ud800 after", task_id="own")  # a block may hold one
        raise Boom("no \ud800 trains")

    try:
        with pytest.raises(Boom):
            await run("sync", fail)
        _, blocks = await pane_of(memory, 5)
        assert ending(blocks) == ("aborted", {"message": "Boom: no \ufffd trains"})
        own = [b["envelope"]["payload"] for b in blocks if b["taskId"] == "own"]
        assert own[0] == {"text": "before \ud800 after"}
        [span] = [s for s in exporter.get_finished_spans() if s.name == "execute_tool research"]
        assert span.status.description == "Boom: no \ufffd trains"
        [event] = span.events
        attributes = dict(event.attributes or {})
        assert attributes["exception.message"] == "no \ufffd trains"
        assert str(attributes["exception.stacktrace"]).endswith("Boom: no \ufffd trains\n")
        for finished in exporter.get_finished_spans():  # everything a span holds encodes
            texts = [finished.name, finished.status.description or ""]
            for mapping in [finished.attributes, *(e.attributes for e in finished.events)]:
                texts += [str(value) for value in (mapping or {}).values()]
            for text in texts:
                text.encode("utf-8")
    finally:
        await kernel_ext.adisable()
        provider.shutdown()


async def test_a_cancelled_call_ends_aborted_as_cancelled(emitter: MemoryEmitter) -> None:
    never = asyncio.Event()
    task = asyncio.create_task(run("async", never.wait))
    await emitter.wait_for(lambda records: len(records) == 2)  # both nested calls reported
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _, blocks = await pane_of(emitter, 3)
    assert ending(blocks) == ("aborted", {"message": "the tool call was cancelled"})


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_stream_the_tool_published_on_and_left_open_still_ends_aborted(
    emitter: MemoryEmitter, kind: str
) -> None:
    def publish_and_return() -> str:
        publish("comparing the stations")  # the call's own stream: now the tool's
        publish("asking the railway", task_id="railway")  # a stream of its own
        return "6 stations"

    await run(kind, publish_and_return)
    call_id, blocks = await pane_of(emitter, 6)
    own = [b for b in blocks if b["taskId"] == call_id]
    assert [b["envelope"]["seq"] for b in own] == [1, 2, 3, 4]  # one counter: lines and text
    assert [b["envelope"]["kind"] for b in own[:3]] == ["tool_call", "tool_call", "text"]
    default = {"message": "the tool call ended before its stream did"}
    assert ending(own) == ("aborted", default)
    railway = [b for b in blocks if b["taskId"] == "railway"]
    assert ending(railway) == ("aborted", default)


async def test_a_generator_tool_ends_done_with_its_return_value(emitter: MemoryEmitter) -> None:
    assert list(steps(tool_name="steps", conversation_id=CONV)) == ["3 stations in Lyon"]
    _, blocks = await pane_of(emitter, 2)
    assert ending(blocks) == ("done", {"text": "stepped through Lyon"})


# -- without a result: tool_call_scope, and a runtime seen only through its spans ------------


@pytest.fixture
async def spans_to_hub() -> AsyncIterator[tuple[TracerProvider, StreamHub, MemoryEmitter]]:
    """A tracer provider whose tool spans reach a hub (through a ToolSpanProcessor), and the
    memory sender of that hub."""
    hub = StreamHub()
    provider = TracerProvider()
    provider.add_span_processor(ToolSpanProcessor(tap=Tap(), sink=hub))
    memory = MemoryEmitter(hub=hub)
    await memory.start()
    try:
        yield provider, hub, memory
    finally:
        await memory.stop(timeout=2)
        provider.shutdown()


async def terminal_of(memory: MemoryEmitter, call_id: str) -> tuple[str, Any]:
    """The state and payload of the one terminal of ``call_id``'s own stream."""
    await memory.wait_for(lambda records: any(b["state"] != "running" for _, b in records))
    await memory.flush(2)
    blocks = [b for b in memory.blocks(CONV) if (b["callId"], b["taskId"]) == (call_id,) * 2]
    assert [b["envelope"]["kind"] for b in blocks[:-1]] == ["tool_call"]
    return ending(blocks)


@pytest.mark.parametrize("fail", [False, True], ids=["returned", "raised"])
async def test_a_tool_call_scope_ends_done_with_the_neutral_text_or_aborted_with_the_error(
    spans_to_hub: tuple[TracerProvider, StreamHub, MemoryEmitter], fail: bool
) -> None:
    provider, hub, memory = spans_to_hub
    with (
        contextlib.suppress(Boom),
        tool_call_scope(
            ToolDescription("research", CONV), tracer_provider=provider, sink=hub
        ) as call,
    ):
        assert call is not None
        with tool_call_scope(ToolDescription("lookup"), tracer_provider=provider, sink=hub):
            pass
        if fail:
            raise Boom("no trains today")
    expected = (
        ("aborted", {"message": "Boom: no trains today"})
        if fail
        else ("done", {"text": "the tool call finished"})
    )
    assert await terminal_of(memory, call.call_id) == expected


@pytest.mark.parametrize("fail", [False, True], ids=["returned", "error-status"])
async def test_a_call_seen_only_through_its_span_ends_by_the_spans_status(
    spans_to_hub: tuple[TracerProvider, StreamHub, MemoryEmitter], fail: bool
) -> None:
    # A runtime kernel_ext does not wrap: only its execute_tool spans are seen. A span that
    # ends without an error status reads as returned (a cancelled call's too, when the
    # runtime records no error for it); there is no result text.
    provider, _, memory = spans_to_hub
    tracer = provider.get_tracer("a runtime")
    tool = {"gen_ai.operation.name": "execute_tool", "gen_ai.conversation.id": CONV}
    with tracer.start_as_current_span(
        "execute_tool research", attributes={**tool, "gen_ai.tool.name": "research"}
    ) as outer:
        with tracer.start_as_current_span(
            "execute_tool lookup", attributes={**tool, "gen_ai.tool.name": "lookup"}
        ):
            pass
        if fail:
            outer.set_status(StatusCode.ERROR, "Boom: no trains today")
    expected = (
        ("aborted", {"message": "Boom: no trains today"})
        if fail
        else ("done", {"text": "the tool call finished"})
    )
    call_id = format(outer.get_span_context().span_id, "016x")
    assert await terminal_of(memory, call_id) == expected
