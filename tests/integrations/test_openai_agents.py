"""The OpenAI Agents SDK integration, in the SDK's real runner (a Model of ours, no network)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from support.attribution_helpers import (
    RecordingSink,
    Tracing,
    hex_id,
    make_tracing,
    pane_reads,
    trace_of,
)
from support.network import need_module

need_module("agents", "pip install openai-agents")

from agents import (  # noqa: E402
    Agent,
    FunctionTool,
    Model,
    ModelResponse,
    RunConfig,
    RunContextWrapper,
    RunHooks,
    Runner,
    Usage,
    WebSearchTool,
    function_tool,
    trace,
)
from agents.tool_context import ToolContext  # noqa: E402
from agents.tracing import Span, Trace, TracingProcessor, set_trace_processors  # noqa: E402
from openai.types.responses import (  # noqa: E402
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

import kernel_ext  # noqa: E402
from kernel_ext import ToolCall, ToolDescription, current_tool_call, publish  # noqa: E402
from kernel_ext.attribution.resolve import Resolution, ResolutionPath, resolve_call_id  # noqa: E402
from kernel_ext.attribution.tap import Tap  # noqa: E402
from kernel_ext.integrations.openai_agents import (  # noqa: E402
    attributed_tool,
    attributed_tools,
    describe_tool_call,
)
from kernel_ext.testing import MemoryEmitter  # noqa: E402

NO_SDK_TRACING = RunConfig(group_id="conv-1", tracing_disabled=True)


# -- a Model of ours: each turn answers with the next output items ----------------------------


class TurnsModel(Model):
    """Answers the runner's n-th model call with ``turns[n]`` (the last one repeats)."""

    def __init__(self, *turns: list[Any]) -> None:
        self.turns = turns
        self.calls = 0

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        output = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        return ModelResponse(output=list(output), usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("these tests run Runner.run")


def call(name: str, arguments: str, call_id: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        id=call_id, call_id=call_id, type="function_call", name=name, arguments=arguments
    )


def text(answer: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id="msg",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(text=answer, type="output_text", annotations=[])],
    )


def calls_then_text(*calls: ResponseFunctionToolCall) -> TurnsModel:
    """A model that asks for ``calls`` in one turn, then answers ``"done"``."""
    return TurnsModel(list(calls), [text("done")])


def kernel_agent(
    tool: FunctionTool, *calls: ResponseFunctionToolCall, **options: Any
) -> Agent[Any]:
    """The kernel's agent with ``tool`` attributed (``options`` go to
    :func:`attributed_tools`), whose model asks for ``calls`` in one turn, then answers."""
    return Agent(
        name="kernel", model=calls_then_text(*calls), tools=attributed_tools([tool], **options)
    )


def asked_twice(tool: FunctionTool, **options: Any) -> Agent[Any]:
    """The kernel's agent, whose model asks ``tool`` questions "a" and "b" in one turn."""
    a = call(tool.name, '{"question": "a"}', "llm-a")
    return kernel_agent(tool, a, call(tool.name, '{"question": "b"}', "llm-b"), **options)


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    tracing = make_tracing(sink=RecordingSink({"kernel_ext.blocks.sent": 2}))
    yield tracing
    tracing.close()


class RecordingTraceProcessor(TracingProcessor):
    """The SDK's own tracing, recorded in memory (in place of its exporter to OpenAI)."""

    def __init__(self) -> None:
        self.traces: list[Trace] = []
        self.spans: list[Span[Any]] = []

    def on_trace_start(self, trace: Trace) -> None:
        self.traces.append(trace)

    def on_trace_end(self, trace: Trace) -> None:
        pass

    def on_span_start(self, span: Span[Any]) -> None:
        pass

    def on_span_end(self, span: Span[Any]) -> None:
        self.spans.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


@pytest.fixture
def sdk_traces() -> Iterator[RecordingTraceProcessor]:
    recorder = RecordingTraceProcessor()
    set_trace_processors([recorder])
    yield recorder
    set_trace_processors([])  # nothing exports the SDK's traces after the test


@contextlib.asynccontextmanager
async def enabled() -> AsyncIterator[tuple[TracerProvider, MemoryEmitter]]:
    """kernel_ext enabled with a private provider and a memory emitter (the plugin's
    loopback emitter in production); disabled afterwards."""
    provider = TracerProvider()
    emitter = MemoryEmitter()
    kernel_ext.enable(emitter=emitter, tracer_provider=provider, tap=Tap())
    try:
        yield provider, emitter
    finally:
        await kernel_ext.adisable()
        provider.shutdown()


# -- attribution -----------------------------------------------------------------------------


async def test_two_concurrent_calls_of_one_tool_each_see_their_own_span(tracing: Tracing) -> None:
    both_live = asyncio.Event()
    both_resolved = asyncio.Event()
    started: list[str] = []
    seen: dict[str, tuple[ToolCall | None, Resolution, Resolution]] = {}
    unattributed = contextvars.Context()

    @function_tool
    async def ask_colleague(question: str) -> str:
        """Ask a colleague."""
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

    agent = asked_twice(ask_colleague, sink=tracing.sink, tracer_provider=tracing.provider)
    result = await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
    assert result.final_output == "done"
    spans = {
        span.attributes["gen_ai.tool.call.id"]: span  # type: ignore[index]
        for span in tracing.tool_spans()
    }
    assert set(spans) == {"llm-a", "llm-b"}
    for question, llm_call_id in (("a", "llm-a"), ("b", "llm-b")):
        tool_call, by_context, by_near_match = seen[question]
        span = spans[llm_call_id]
        assert tool_call == ToolCall(
            hex_id(span), "ask_colleague", "conv-1", llm_call_id, None, trace_id=trace_of(span)
        )
        assert by_context.call_id == tool_call.call_id
        assert by_near_match == Resolution(None, ResolutionPath.AMBIGUOUS, "conv-1")
        assert spans[llm_call_id].attributes["kernel_ext.blocks.sent"] == 2  # type: ignore[index]
        assert spans[llm_call_id].attributes["gen_ai.conversation.id"] == "conv-1"  # type: ignore[index]
    assert len(tracing.tap) == 0
    assert current_tool_call() is None


async def test_the_blocks_two_concurrent_calls_publish_carry_each_its_own_call_id() -> None:
    async with enabled() as (provider, emitter):
        both_live = asyncio.Event()
        started: list[str] = []
        call_ids: dict[str, str | None] = {}

        @function_tool
        async def ask_colleague(question: str) -> str:
            """Ask a colleague."""
            started.append(question)
            if len(started) == 2:
                both_live.set()
            await asyncio.wait_for(both_live.wait(), 10)
            call_ids[question] = kernel_ext.current_call_id()
            publish(f"thinking about {question}", conversation_id="conv-1")
            publish(f"answer {question}", state="done", conversation_id="conv-1")
            return question

        agent = asked_twice(ask_colleague, tracer_provider=provider)
        await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
        records = await emitter.wait_for(lambda records: len(records) == 4, 10)
    assert set(call_ids) == {"a", "b"}
    assert call_ids["a"] != call_ids["b"]
    for question in ("a", "b"):
        blocks = [block for room, block in records if block["callId"] == call_ids[question]]
        assert [block["state"] for block in blocks] == ["running", "done"]
        assert all(room == "conv-1" for room, block in records)


async def test_a_sync_tool_runs_in_a_worker_thread_and_sees_its_call(tracing: Tracing) -> None:
    seen: list[tuple[ToolCall | None, int]] = []

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up."""
        seen.append((current_tool_call(), threading.get_ident()))
        return key

    agent = Agent(
        name="kernel",
        model=calls_then_text(call("lookup", '{"key": "k"}', "llm-s")),
        tools=attributed_tools([lookup], sink=tracing.sink, tracer_provider=tracing.provider),
    )
    await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
    [span] = tracing.tool_spans()
    [(tool_call, thread)] = seen
    assert tool_call == ToolCall(
        hex_id(span), "lookup", "conv-1", "llm-s", None, trace_id=trace_of(span)
    )
    assert thread != threading.get_ident()  # not the event loop's thread


async def test_a_tool_that_fails_ends_its_call_failed_though_the_model_gets_the_sdks_error_text(
    tracing: Tracing,
) -> None:
    @function_tool
    async def explode() -> str:
        """Fail."""
        raise RuntimeError("tool failed")

    model = calls_then_text(call("explode", "{}", "llm-x"))
    agent = Agent(
        name="kernel",
        model=model,
        tools=attributed_tools([explode], sink=tracing.sink, tracer_provider=tracing.provider),
    )
    result = await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
    assert result.final_output == "done"  # the SDK turned the error into the tool's output
    [span] = tracing.tool_spans()
    # The SDK's invoker catches the error and returns its text, yet the call failed: the
    # integration's end and the span's end both report the tool's exception.
    assert [(ended.call_id, error) for ended, error in tracing.sink.ended] == [
        (hex_id(span), "RuntimeError: tool failed"),
        (hex_id(span), "RuntimeError: tool failed"),
    ]
    assert span.status.status_code is StatusCode.ERROR
    assert current_tool_call() is None
    assert len(tracing.tap) == 0


async def test_a_tool_that_times_out_ends_its_call_cancelled(tracing: Tracing) -> None:
    never = asyncio.Event()

    @function_tool(timeout=0.2)
    async def hang() -> str:
        """Never answer."""
        await never.wait()
        return "unreachable"

    agent = Agent(
        name="kernel",
        model=calls_then_text(call("hang", "{}", "llm-h")),
        tools=attributed_tools([hang], sink=tracing.sink, tracer_provider=tracing.provider),
    )
    await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
    [span] = tracing.tool_spans()
    (ended, error), *_ = tracing.sink.ended  # the integration's end, then the span's
    assert (ended.call_id, ended.tool_name) == (hex_id(span), "hang")
    assert error == "the tool call was cancelled"
    assert {call.call_id for call, _ in tracing.sink.ended} == {hex_id(span)}


# -- the conversation -------------------------------------------------------------------------


async def run_one_call(
    tracing: Tracing, run_config: RunConfig, **options: Any
) -> list[ToolCall | None]:
    seen: list[ToolCall | None] = []

    @function_tool
    async def search(q: str) -> str:
        """Search."""
        seen.append(current_tool_call())
        return q

    agent = Agent(
        name="kernel",
        model=calls_then_text(call("search", '{"q": "x"}', "llm-1")),
        tools=attributed_tools(
            [search], sink=tracing.sink, tracer_provider=tracing.provider, **options
        ),
    )
    await asyncio.wait_for(
        Runner.run(agent, "go", run_config=run_config, context={"chat": "chat-9"}), 30
    )
    return seen


async def test_the_conversation_is_the_run_configs_group_id(tracing: Tracing) -> None:
    [seen] = await run_one_call(tracing, RunConfig(group_id="g-1", tracing_disabled=True))
    assert seen is not None
    assert seen.conversation_id == "g-1"


async def test_without_a_run_group_the_conversation_is_the_sdk_traces_group(
    tracing: Tracing, sdk_traces: RecordingTraceProcessor
) -> None:
    with trace("kernel turn", group_id="g-2"):
        [seen] = await run_one_call(tracing, RunConfig())
    assert seen is not None
    assert seen.conversation_id == "g-2"


async def test_without_any_group_there_is_no_conversation(tracing: Tracing) -> None:
    [seen] = await run_one_call(tracing, RunConfig(tracing_disabled=True))
    assert seen is not None
    assert seen.conversation_id is None


async def test_a_describe_hook_overrides_the_conversation(tracing: Tracing) -> None:
    def describe(context: Any, tool: FunctionTool) -> ToolDescription:
        return dataclasses.replace(
            describe_tool_call(context, tool), conversation_id=context.context["chat"]
        )

    [seen] = await run_one_call(tracing, NO_SDK_TRACING, describe=describe)
    assert seen is not None
    assert (seen.tool_name, seen.conversation_id, seen.llm_call_id) == (
        "search",
        "chat-9",
        "llm-1",
    )


async def test_a_describe_hook_that_says_none_leaves_the_call_alone(tracing: Tracing) -> None:
    assert await run_one_call(tracing, NO_SDK_TRACING, describe=lambda context, tool: None) == [
        None
    ]
    assert tracing.tool_spans() == []


@pytest.mark.parametrize(
    "describe",
    [lambda context, tool: 1 / 0, lambda context, tool: "search"],
    ids=["raises", "not-a-description"],
)
async def test_a_broken_describe_hook_leaves_the_call_unattributed_and_is_logged(
    tracing: Tracing, describe: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "kernel_ext.integrations.openai_agents"):
        assert await run_one_call(tracing, NO_SDK_TRACING, describe=describe) == [None]
    assert tracing.tool_spans() == []
    assert any(r.name == "kernel_ext.integrations.openai_agents" for r in caplog.records)


# -- the SDK's own tracing, beside ----------------------------------------------------------


async def test_the_sdks_own_trace_is_recorded_beside_the_otel_span(
    tracing: Tracing, sdk_traces: RecordingTraceProcessor
) -> None:
    app = tracing.provider.get_tracer("app")
    with app.start_as_current_span("request") as request:
        [seen] = await run_one_call(tracing, RunConfig(group_id="g-1"))
    [span] = tracing.tool_spans()
    assert seen is not None
    assert seen.call_id == hex_id(span)
    assert span.parent is not None
    assert span.parent.span_id == request.get_span_context().span_id  # the current OTel span
    [sdk_trace] = sdk_traces.traces
    assert sdk_trace.export()["group_id"] == "g-1"  # type: ignore[index]
    function_spans = [s for s in sdk_traces.spans if s.span_data.type == "function"]
    assert [s.span_data.name for s in function_spans] == ["search"]  # type: ignore[attr-defined]


# -- why the tool's invoker and not the SDK's hooks --------------------------------------------


async def test_a_contextvar_set_in_on_tool_start_never_reaches_the_tool() -> None:
    # What docs/contracts.md says of RunHooks: the runner awaits on_tool_start in a task
    # of its own, so what it sets stays there.
    marker: contextvars.ContextVar[str | None] = contextvars.ContextVar("marker", default=None)
    seen: list[str | None] = []

    class Hooks(RunHooks[Any]):
        async def on_tool_start(
            self, context: RunContextWrapper[Any], agent: Any, tool: Any
        ) -> None:
            marker.set("set by the hook")
            seen.append(marker.get())

    @function_tool
    async def search(q: str) -> str:
        """Search."""
        seen.append(marker.get())
        return q

    agent = Agent(
        name="kernel", model=calls_then_text(call("search", '{"q": "x"}', "llm-1")), tools=[search]
    )
    await asyncio.wait_for(Runner.run(agent, "go", hooks=Hooks(), run_config=NO_SDK_TRACING), 30)
    assert seen == ["set by the hook", None]


# -- the tools ---------------------------------------------------------------------------------


async def test_attributed_tools_copies_function_tools_and_passes_the_others_through(
    tracing: Tracing,
) -> None:
    @function_tool
    async def search(q: str) -> str:
        """Search."""
        return q

    hosted = WebSearchTool()
    original_invoker = search.on_invoke_tool
    attributed, passed = attributed_tools([search, hosted])
    assert passed is hosted
    assert isinstance(attributed, FunctionTool)
    assert attributed is not search
    assert search.on_invoke_tool is original_invoker  # the original is left as it was
    assert attributed.name == search.name
    with pytest.raises(TypeError, match="FunctionTool"):
        attributed_tool(hosted)  # type: ignore[arg-type]


async def test_attributing_twice_wraps_once_and_a_plain_tool_stays_unattributed(
    tracing: Tracing,
) -> None:
    seen: list[ToolCall | None] = []

    @function_tool
    async def search(q: str) -> str:
        """Search."""
        seen.append(current_tool_call())
        return q

    once = attributed_tool(search, sink=RecordingSink(), tracer_provider=TracerProvider())
    twice = attributed_tool(once, sink=tracing.sink, tracer_provider=tracing.provider)
    for tool in (twice, search):
        agent = Agent(
            name="kernel",
            model=calls_then_text(call("search", '{"q": "x"}', "llm-1")),
            tools=[tool],
        )
        await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
    [span] = tracing.tool_spans()  # one span, from the second attribution's provider
    assert seen == [
        ToolCall(hex_id(span), "search", "conv-1", "llm-1", None, trace_id=trace_of(span)),
        None,
    ]


async def test_a_custom_function_tool_taking_a_run_context_wrapper_is_named_after_the_tool(
    tracing: Tracing,
) -> None:
    seen: list[tuple[ToolCall | None, type]] = []

    async def invoke(context: RunContextWrapper[Any], arguments: str) -> str:
        seen.append((current_tool_call(), type(context)))
        return arguments

    tool = FunctionTool(
        name="raw_tool",
        description="A hand-made tool.",
        params_json_schema={"type": "object", "properties": {}, "additionalProperties": False},
        on_invoke_tool=invoke,
    )
    agent = Agent(
        name="kernel",
        model=calls_then_text(call("raw_tool", "{}", "llm-r")),
        tools=attributed_tools([tool], sink=tracing.sink, tracer_provider=tracing.provider),
    )
    await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
    [span] = tracing.tool_spans()
    [(tool_call, context_type)] = seen
    # The SDK passes a plain RunContextWrapper to a tool declared to take one: neither the
    # model's call id nor the run config (its group) reaches the describe hook.
    assert context_type is RunContextWrapper
    assert not issubclass(context_type, ToolContext)
    assert tool_call == ToolCall(
        hex_id(span), "raw_tool", None, None, None, trace_id=trace_of(span)
    )


async def test_an_agent_as_tool_is_the_parent_of_its_agents_tool_calls(tracing: Tracing) -> None:
    inner_seen: list[ToolCall | None] = []

    @function_tool
    async def search(q: str) -> str:
        """Search."""
        inner_seen.append(current_tool_call())
        return q

    colleague = Agent(
        name="colleague",
        model=calls_then_text(call("search", '{"q": "x"}', "llm-in")),
        tools=attributed_tools([search], sink=tracing.sink, tracer_provider=tracing.provider),
    )
    ask = colleague.as_tool(tool_name="ask_colleague", tool_description="Ask a colleague.")
    agent = Agent(
        name="kernel",
        model=calls_then_text(call("ask_colleague", '{"input": "q"}', "llm-out")),
        tools=attributed_tools([ask], sink=tracing.sink, tracer_provider=tracing.provider),
    )
    await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
    spans = {span.name: span for span in tracing.tool_spans()}
    [inner] = inner_seen
    assert inner is not None
    assert inner.call_id == hex_id(spans["execute_tool search"])
    assert inner.parent is not None
    assert inner.parent.call_id == hex_id(spans["execute_tool ask_colleague"])
    [(parent, child)] = tracing.sink.started
    assert (parent.call_id, child.tool_name) == (inner.parent.call_id, "search")


class BrokenModel(TurnsModel):
    """Answers its first turns like a :class:`TurnsModel`, then fails."""

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        if self.calls >= len(self.turns):
            raise RuntimeError("the colleague's model is down")
        return await super().get_response(*args, **kwargs)


async def run_agent_as_tool(colleague_model: TurnsModel) -> tuple[str, list[dict[str, Any]]]:
    """The kernel's agent calls a colleague agent as a tool (``as_tool``); the colleague's
    model asks for two searches. Returns the as_tool call's id and its blocks."""
    async with enabled() as (provider, emitter):
        seen: list[str | None] = []

        @function_tool
        async def search(q: str) -> str:
            """Search."""
            seen.append(kernel_ext.current_tool_call().parent.call_id)  # type: ignore[union-attr]
            return f"results for {q}"

        colleague = Agent(
            name="colleague",
            model=colleague_model,
            tools=attributed_tools([search], tracer_provider=provider),
        )
        ask = colleague.as_tool(tool_name="ask_colleague", tool_description="Ask a colleague.")
        asked = call("ask_colleague", '{"input": "trains?"}', "llm-out")
        agent = kernel_agent(ask, asked, tracer_provider=provider)
        await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
        records = await emitter.wait_for(lambda records: len(records) == 3, 10)
        await emitter.flush(2)
        hub = kernel_ext.stream.get_default_hub()
        assert (hub.stats().calls, hub.stats().streams) == (0, 0)
    assert len(records) == 3
    [call_id, also] = seen
    assert call_id == also is not None
    blocks = [block for room, block in records if room == "conv-1" and block["callId"] == call_id]
    assert [(b["taskId"], b["envelope"]["kind"]) for b in blocks[:2]] == [
        (call_id, "tool_call"),
        (call_id, "tool_call"),
    ]
    return call_id, blocks


def two_searches() -> list[ResponseFunctionToolCall]:
    return [call("search", '{"q": "Lyon"}', "llm-a"), call("search", '{"q": "Nice"}', "llm-b")]


async def test_an_agent_as_tool_that_succeeds_ends_its_pane_done_with_the_agents_answer() -> None:
    model = TurnsModel(two_searches(), [text("Lyon and Nice have 6 stations")])
    call_id, blocks = await run_agent_as_tool(model)
    terminal = blocks[-1]
    assert (terminal["taskId"], terminal["state"]) == (call_id, "done")
    assert terminal["envelope"]["payload"] == {"text": "Lyon and Nice have 6 stations"}
    assert pane_reads(blocks, call_id) == ("ended", "done", "Lyon and Nice have 6 stations")


async def test_an_agent_as_tool_whose_agent_fails_ends_its_pane_aborted_with_the_error() -> None:
    call_id, blocks = await run_agent_as_tool(BrokenModel(two_searches()))
    terminal = blocks[-1]
    assert (terminal["taskId"], terminal["state"]) == (call_id, "aborted")
    assert terminal["envelope"]["payload"] == {
        "message": "RuntimeError: the colleague's model is down"
    }


async def test_a_copy_of_an_attributed_tool_is_attributed_and_reads_through_to_the_sdk(
    tracing: Tracing,
) -> None:
    seen: list[ToolCall | None] = []

    async def search(q: str) -> str:
        """Search."""
        seen.append(current_tool_call())
        return q

    tool = function_tool(search)
    attributed = attributed_tool(tool, sink=tracing.sink, tracer_provider=tracing.provider)
    copied = copy.copy(attributed)  # what tool_namespace() does, too
    assert copied.__wrapped__ is search  # the SDK's view of its invoker, through ours
    agent = Agent(
        name="kernel",
        model=calls_then_text(call("search", '{"q": "x"}', "llm-1")),
        tools=[copied],
    )
    await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
    [span] = tracing.tool_spans()
    assert seen == [
        ToolCall(hex_id(span), "search", "conv-1", "llm-1", None, trace_id=trace_of(span))
    ]


async def test_a_stream_a_failing_tool_left_open_ends_aborted_with_its_error() -> None:
    async with enabled() as (provider, emitter):

        @function_tool
        async def explode() -> str:
            """Fail."""
            publish("working on it", conversation_id="conv-1")
            raise RuntimeError("tool failed")

        agent = kernel_agent(explode, call("explode", "{}", "llm-x"), tracer_provider=provider)
        await asyncio.wait_for(Runner.run(agent, "go", run_config=NO_SDK_TRACING), 30)
        records = await emitter.wait_for(lambda records: len(records) == 2, 10)
    (_, running), (_, terminal) = records
    assert (running["state"], terminal["state"]) == ("running", "aborted")
    assert running["callId"] == terminal["callId"]
    assert terminal["envelope"]["payload"] == {"message": "RuntimeError: tool failed"}


async def test_with_openinferences_agents_instrumentation_its_tool_span_is_the_calls_span(
    tracing: Tracing,
) -> None:
    # openinference-instrumentation-openai-agents turns the SDK's function span into an
    # OpenTelemetry TOOL span, current while the tool runs: the call reuses it (one span,
    # no spurious nested call).
    instrumentation = need_module(
        "openinference.instrumentation.openai_agents",
        "pip install openinference-instrumentation-openai-agents",
    )
    instrumentor = instrumentation.OpenAIAgentsInstrumentor()
    instrumentor.instrument(tracer_provider=tracing.provider)
    try:
        [seen] = await run_one_call(tracing, RunConfig(group_id="g-1"))
    finally:
        instrumentor.uninstrument()
        set_trace_processors([])
    [tool_span] = [
        span
        for span in tracing.spans()
        if (span.attributes or {}).get("openinference.span.kind") == "TOOL"
    ]
    assert tool_span.name == "search"
    assert seen == ToolCall(
        hex_id(tool_span), "search", "g-1", "llm-1", None, trace_id=trace_of(tool_span)
    )
    assert tracing.tool_spans() == []  # no execute_tool span of its own
    assert tracing.sink.started == []
    assert {call.call_id for call, _ in tracing.sink.ended} == {hex_id(tool_span)}
