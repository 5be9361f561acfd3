"""The pydantic-ai integration, in pydantic-ai's real agent loop (FunctionModel, no network)."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic_ai")

import asyncio
import contextvars
from collections.abc import Iterator

from opentelemetry.sdk.trace import TracerProvider
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability, Instrumentation
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturn
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings
from support.attribution_helpers import RecordingSink, Tracing, hex_id, make_tracing, trace_of

import kernel_ext
from kernel_ext import ToolCall, current_tool_call
from kernel_ext.attribution.resolve import Resolution, ResolutionPath, resolve_call_id
from kernel_ext.attribution.tap import Tap
from kernel_ext.integrations.pydantic_ai import KernelExtCapability
from kernel_ext.testing import MemoryEmitter


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    tracing = make_tracing(sink=RecordingSink({"kernel_ext.blocks.sent": 2}))
    yield tracing
    tracing.close()


def two_calls_then_text(*calls: ToolCallPart) -> FunctionModel:
    """A model that asks for ``calls`` in one turn, then answers with text."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=list(calls))
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(respond)


def capabilities(tracing: Tracing, instrumented: bool) -> list[AbstractCapability[None]]:
    ours: KernelExtCapability = KernelExtCapability(
        sink=tracing.sink, tracer_provider=tracing.provider
    )
    if not instrumented:
        return [ours]
    return [ours, Instrumentation(InstrumentationSettings(tracer_provider=tracing.provider))]


@pytest.mark.parametrize("instrumented", [True, False], ids=["pydantic-span", "own-span"])
async def test_two_concurrent_calls_of_one_tool_each_see_their_own_span(
    tracing: Tracing, instrumented: bool
) -> None:
    both_live = asyncio.Event()
    both_resolved = asyncio.Event()
    started: list[str] = []
    seen: dict[str, tuple[ToolCall | None, Resolution, Resolution]] = {}
    unattributed = contextvars.Context()
    agent = Agent(
        two_calls_then_text(
            ToolCallPart("ask_colleague", {"question": "a"}, tool_call_id="llm-a"),
            ToolCallPart("ask_colleague", {"question": "b"}, tool_call_id="llm-b"),
        ),
        capabilities=capabilities(tracing, instrumented),
    )

    @agent.tool_plain
    async def ask_colleague(question: str) -> str:
        started.append(question)
        if len(started) == 2:
            both_live.set()
        await asyncio.wait_for(both_live.wait(), 10)  # both calls are live at once
        seen[question] = (
            current_tool_call(),
            resolve_call_id("conv-1", tap=tracing.tap),
            unattributed.run(resolve_call_id, "conv-1", tap=tracing.tap),
        )
        if len(seen) == 2:
            both_resolved.set()
        await asyncio.wait_for(both_resolved.wait(), 10)  # neither ends before both resolved
        return question

    result = await asyncio.wait_for(agent.run("go", conversation_id="conv-1"), 30)
    assert result.output == "done"
    spans = {
        span.attributes["gen_ai.tool.call.id"]: span  # type: ignore[index]
        for span in tracing.tool_spans()
    }
    assert set(spans) == {"llm-a", "llm-b"}
    for question, llm_call_id in (("a", "llm-a"), ("b", "llm-b")):
        call, by_context, by_near_match = seen[question]
        span = spans[llm_call_id]
        assert call == ToolCall(
            hex_id(span), "ask_colleague", "conv-1", llm_call_id, None, trace_id=trace_of(span)
        )
        assert by_context.call_id == call.call_id
        assert by_near_match == Resolution(None, ResolutionPath.AMBIGUOUS, "conv-1")
        assert spans[llm_call_id].attributes["kernel_ext.blocks.sent"] == 2  # type: ignore[index]
    assert len(tracing.tap) == 0
    assert current_tool_call() is None


async def test_a_sync_tool_in_a_worker_thread_sees_its_call(tracing: Tracing) -> None:
    seen: list[ToolCall | None] = []
    agent = Agent(
        two_calls_then_text(ToolCallPart("lookup", {"key": "k"}, tool_call_id="llm-s")),
        capabilities=capabilities(tracing, instrumented=True),
    )

    @agent.tool_plain
    def lookup(key: str) -> str:
        seen.append(current_tool_call())
        return key

    await asyncio.wait_for(agent.run("go", conversation_id="conv-1"), 30)
    [span] = tracing.tool_spans()
    assert seen == [
        ToolCall(hex_id(span), "lookup", "conv-1", "llm-s", None, trace_id=trace_of(span))
    ]


async def test_a_tool_that_runs_an_agent_is_the_parent_of_that_agents_tool_calls(
    tracing: Tracing,
) -> None:
    inner_seen: list[ToolCall | None] = []
    colleague = Agent(
        two_calls_then_text(ToolCallPart("search", {"q": "x"}, tool_call_id="llm-in")),
        capabilities=capabilities(tracing, instrumented=True),
    )

    @colleague.tool_plain
    async def search(q: str) -> str:
        inner_seen.append(current_tool_call())
        return q

    agent = Agent(
        two_calls_then_text(
            ToolCallPart("ask_colleague", {"question": "q"}, tool_call_id="llm-out")
        ),
        capabilities=capabilities(tracing, instrumented=True),
    )

    @agent.tool_plain
    async def ask_colleague(question: str) -> str:
        return (await colleague.run(question)).output

    await asyncio.wait_for(agent.run("go", conversation_id="conv-1"), 30)
    spans = {span.name: span for span in tracing.tool_spans()}
    [inner] = inner_seen
    assert inner is not None
    assert inner.call_id == hex_id(spans["execute_tool search"])
    assert inner.parent is not None
    assert inner.parent.call_id == hex_id(spans["execute_tool ask_colleague"])
    [(parent, child)] = tracing.sink.started
    assert (parent.call_id, child.tool_name) == (inner.parent.call_id, "search")


async def test_a_failing_tool_raises_unchanged_and_restores_the_context(
    tracing: Tracing,
) -> None:
    agent = Agent(
        two_calls_then_text(ToolCallPart("explode", {}, tool_call_id="llm-x")),
        capabilities=capabilities(tracing, instrumented=True),
    )

    class Boom(Exception):
        pass

    @agent.tool_plain
    async def explode() -> str:
        raise Boom("tool failed")

    with pytest.raises(Boom, match="tool failed"):
        await asyncio.wait_for(agent.run("go", conversation_id="conv-1"), 30)
    assert current_tool_call() is None
    assert len(tracing.tap) == 0


@pytest.mark.parametrize("instrumented", [True, False], ids=["pydantic-span", "own-span"])
@pytest.mark.parametrize("tool_return", [False, True], ids=["str", "ToolReturn"])
async def test_a_tool_that_runs_an_agent_ends_its_pane_done_with_what_it_returned(
    instrumented: bool, tool_return: bool
) -> None:
    provider = TracerProvider()
    emitter = MemoryEmitter()
    kernel_ext.enable(emitter=emitter, tracer_provider=provider, tap=Tap())
    ours = KernelExtCapability(tracer_provider=provider)  # the sink enable() attached
    extra = [Instrumentation(InstrumentationSettings(tracer_provider=provider))]
    caps: list[AbstractCapability[None]] = [ours, *extra] if instrumented else [ours]
    colleague = Agent(
        FunctionModel(
            lambda messages, info: ModelResponse(
                parts=[ToolCallPart("search", {"q": "x"}, tool_call_id="llm-in")]
                if len(messages) == 1
                else [TextPart("Lyon has 3 stations")]
            )
        ),
        capabilities=caps,
    )

    @colleague.tool_plain
    async def search(q: str) -> str:
        return q

    agent = Agent(
        two_calls_then_text(
            ToolCallPart("ask_colleague", {"question": "q"}, tool_call_id="llm-out")
        ),
        capabilities=caps,
    )
    call_ids: list[str | None] = []

    @agent.tool_plain
    async def ask_colleague(question: str) -> str | ToolReturn:
        call_ids.append(kernel_ext.current_call_id())
        answer = (await colleague.run(question)).output
        return (
            ToolReturn(return_value=answer, content="for the model only") if tool_return else answer
        )

    try:
        await asyncio.wait_for(agent.run("go", conversation_id="conv-1"), 30)
        records = await emitter.wait_for(lambda records: len(records) == 2, 10)
        await emitter.flush(2)
    finally:
        await kernel_ext.adisable()
        provider.shutdown()
    [call_id] = call_ids
    assert [(b["callId"], b["taskId"], b["state"]) for _, b in records] == [
        (call_id, call_id, "running"),
        (call_id, call_id, "done"),
    ]
    assert records[0][1]["envelope"]["payload"]["toolName"] == "search"
    assert records[1][1]["envelope"]["payload"] == {"text": "Lyon has 3 stations"}
