# ruff: noqa: E402  (the framework is imported after need_module() checked it is installed)
"""The LangChain / LangGraph integration, in LangGraph's real agent loop (a ``StateGraph``
whose model node is langchain-core's own fake chat model and whose tools run in
``ToolNode``) and through plain ``tool.invoke``/``ainvoke``; no network."""

from __future__ import annotations

from support.network import need_module

need_module("langchain_core", "pip install 'kernel-ext[langchain]'")
need_module("langgraph", "pip install langgraph")

import asyncio
import dataclasses
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.attribution_helpers import hex_id, trace_of

import kernel_ext
from kernel_ext import ToolCall, ToolDescription, current_tool_call, publish
from kernel_ext.integrations.langchain import (
    TARGETS,
    describe_tool_run,
    langchain_targets,
    thread_id,
)
from kernel_ext.testing import MemoryEmitter
from kernel_ext.worker import wiring

THREAD = "thread-1"


@dataclasses.dataclass
class Worker:
    """kernel_ext enabled on the LangChain targets, with a private provider and a memory
    emitter (the plugin's loopback emitter in production)."""

    provider: TracerProvider
    exporter: InMemorySpanExporter
    emitter: MemoryEmitter

    def tool_spans(self) -> list[ReadableSpan]:
        spans = self.exporter.get_finished_spans()
        return [s for s in spans if s.name.startswith("execute_tool ")]

    def span_by_llm_call_id(self) -> dict[str, ReadableSpan]:
        return {
            str((s.attributes or {})["gen_ai.tool.call.id"]): s
            for s in self.tool_spans()
            if "gen_ai.tool.call.id" in (s.attributes or {})
        }

    def blocks_of(self, call_id: str) -> list[tuple[str, str, Any]]:
        """(room, state, payload) of the blocks sent for ``call_id``, in order."""
        return [
            (room, block["state"], block["envelope"]["payload"])
            for room, block in self.emitter.records
            if block["callId"] == call_id
        ]


def start_worker(describe: Any = None) -> Worker:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    emitter = MemoryEmitter()
    kernel_ext.enable(
        emitter=emitter,
        tracer_provider=provider,
        targets=langchain_targets(describe),
        handle_sigterm=False,
    )
    return Worker(provider, exporter, emitter)


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    started = start_worker()
    try:
        yield started
    finally:
        await kernel_ext.adisable()
        started.provider.shutdown()


@pytest.fixture(autouse=True)
def _always_disable() -> Iterator[None]:
    yield
    wiring.disable(timeout=2)


def tool_call(name: str, llm_call_id: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": llm_call_id, "type": "tool_call"}


def agent(tools: list[BaseTool], *turns: AIMessage, handle_tool_errors: bool = False) -> Any:
    """LangGraph's agent loop: a model node (a fake chat model that answers with ``turns``
    in order) and a ``ToolNode``, joined by ``tools_condition``."""
    model = FakeMessagesListChatModel(responses=list(turns))

    def call_model(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", call_model)
    builder.add_node("tools", ToolNode(tools, handle_tool_errors=handle_tool_errors))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile()


def two_calls(name: str) -> AIMessage:
    """One model message that asks for ``name`` twice (questions a and b)."""
    return AIMessage(
        "",
        tool_calls=[
            tool_call(name, "llm-a", question="a"),
            tool_call(name, "llm-b", question="b"),
        ],
    )


RUN = {"configurable": {"thread_id": THREAD}}


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_two_concurrent_calls_of_one_tool_in_one_toolnode_step_each_get_their_own_span(
    worker: Worker, kind: str
) -> None:
    seen: dict[str, ToolCall | None] = {}
    if kind == "async":
        both_live = asyncio.Event()

        @tool
        async def ask_colleague(question: str) -> str:
            """Ask a colleague."""
            seen[question] = current_tool_call()
            publish(f"working on {question}")
            if len(seen) == 2:
                both_live.set()
            await asyncio.wait_for(both_live.wait(), 10)  # both calls are live at once
            publish(f"answer {question}", state="done")
            return question

        tools: list[BaseTool] = [ask_colleague]
    else:
        barrier = threading.Barrier(2, timeout=10)

        @tool
        def ask_colleague(question: str) -> str:  # type: ignore[no-redef]
            """Ask a colleague (sync: ToolNode runs each call in its own thread)."""
            seen[question] = current_tool_call()
            publish(f"working on {question}")
            barrier.wait()  # both calls are live at once
            publish(f"answer {question}", state="done")
            return question

        tools = [ask_colleague]

    graph = agent(tools, two_calls("ask_colleague"), AIMessage("done"))
    if kind == "async":
        result = await asyncio.wait_for(graph.ainvoke({"messages": [("user", "go")]}, RUN), 30)
    else:
        result = await asyncio.wait_for(
            asyncio.to_thread(graph.invoke, {"messages": [("user", "go")]}, RUN), 30
        )
    assert result["messages"][-1].content == "done"
    answers = sorted(m.content for m in result["messages"] if isinstance(m, ToolMessage))
    assert answers == ["a", "b"]
    await worker.emitter.wait_for(lambda records: len(records) == 4)
    spans = worker.span_by_llm_call_id()
    assert set(spans) == {"llm-a", "llm-b"}
    for question, llm_call_id in (("a", "llm-a"), ("b", "llm-b")):
        span = spans[llm_call_id]
        call_id = hex_id(span)
        assert seen[question] == ToolCall(
            call_id, "ask_colleague", THREAD, llm_call_id, None, trace_id=trace_of(span)
        )
        assert worker.blocks_of(call_id) == [
            (THREAD, "running", {"text": f"working on {question}"}),
            (THREAD, "done", {"text": f"answer {question}"}),
        ]
        attributes = span.attributes or {}
        assert attributes["gen_ai.operation.name"] == "execute_tool"
        assert attributes["gen_ai.tool.name"] == "ask_colleague"
        assert attributes["gen_ai.conversation.id"] == THREAD
        assert attributes["kernel_ext.stream.blocks_admitted"] == 2
        assert attributes["kernel_ext.call_id.path"] == "context"
    assert current_tool_call() is None


async def test_plain_tools_sync_and_async_invoke_and_ainvoke_each_see_their_call(
    worker: Worker,
) -> None:
    @tool
    def lookup(key: str) -> ToolCall | None:
        """A sync tool."""
        return current_tool_call()

    @tool
    async def fetch(key: str) -> ToolCall | None:
        """An async tool."""
        return current_tool_call()

    invoked = lookup.invoke({"key": "k"}, {"configurable": {"thread_id": "t-1"}})
    in_thread = await lookup.ainvoke({"key": "k"}, {"configurable": {"thread_id": "t-2"}})
    awaited = await fetch.ainvoke({"key": "k"}, {"configurable": {"thread_id": "t-3"}})
    spans = sorted(worker.tool_spans(), key=lambda s: s.start_time or 0)
    assert [s.name for s in spans] == [
        "execute_tool lookup",
        "execute_tool lookup",
        "execute_tool fetch",
    ]
    assert invoked == ToolCall(
        hex_id(spans[0]), "lookup", "t-1", None, None, trace_id=trace_of(spans[0])
    )
    assert in_thread == ToolCall(
        hex_id(spans[1]), "lookup", "t-2", None, None, trace_id=trace_of(spans[1])
    )
    assert awaited == ToolCall(
        hex_id(spans[2]), "fetch", "t-3", None, None, trace_id=trace_of(spans[2])
    )
    assert current_tool_call() is None


@tool(response_format="content_and_artifact")
def whoami() -> tuple[str, ToolCall | None]:
    """Returns the active call as its artifact."""
    return "ok", current_tool_call()


@tool(response_format="content_and_artifact")
async def awhoami() -> tuple[str, ToolCall | None]:
    """Returns the active call as its artifact (async)."""
    return "ok", current_tool_call()


@pytest.mark.parametrize(
    ("the_tool", "run"),
    [
        (whoami, lambda t, c: t.invoke(c)),
        (whoami, lambda t, c: t.ainvoke(c)),  # a sync tool in a worker thread
        (awhoami, lambda t, c: t.ainvoke(c)),
    ],
    ids=["sync-invoke", "sync-ainvoke", "async-ainvoke"],
)
async def test_a_tool_invoked_with_a_tool_call_has_the_models_call_id(
    worker: Worker, the_tool: BaseTool, run: Callable[[BaseTool, Any], Any]
) -> None:
    message = run(the_tool, tool_call(the_tool.name, "llm-7"))
    if asyncio.iscoroutine(message):
        message = await message
    assert isinstance(message, ToolMessage)
    [span] = worker.tool_spans()
    assert message.artifact == ToolCall(
        hex_id(span), the_tool.name, None, "llm-7", None, trace_id=trace_of(span)
    )
    assert (span.attributes or {})["gen_ai.tool.call.id"] == "llm-7"


async def test_the_execute_tool_span_another_instrumentation_opened_for_the_call_is_reused(
    worker: Worker,
) -> None:
    """An instrumentation that opens the GenAI ``execute_tool`` span around each tool call
    (here through ``ToolNode``'s ``awrap_tool_call`` hook): no second span is opened."""
    tracer = worker.provider.get_tracer("another-instrumentation")
    seen: list[ToolCall | None] = []

    async def traced(request: Any, execute: Any) -> Any:
        call = request.tool_call
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call["name"],
            "gen_ai.tool.call.id": call["id"],
        }
        with tracer.start_as_current_span("execute_tool " + call["name"], attributes=attributes):
            return await execute(request)

    @tool
    async def ask_colleague(question: str) -> str:
        """Ask a colleague."""
        seen.append(current_tool_call())
        publish("Friday.", state="done")
        return "Friday."

    model = FakeMessagesListChatModel(
        responses=[AIMessage("", tool_calls=[tool_call("ask_colleague", "llm-r", question="q")])]
    )
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([ask_colleague], awrap_tool_call=traced))
    graph.add_edge(START, "agent")
    graph.add_edge("agent", "tools")
    await asyncio.wait_for(graph.compile().ainvoke({"messages": [("user", "go")]}, RUN), 30)
    await worker.emitter.wait_for(lambda records: len(records) == 1)
    [span] = worker.tool_spans()
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.name == "another-instrumentation"
    assert seen == [
        ToolCall(hex_id(span), "ask_colleague", THREAD, "llm-r", None, trace_id=trace_of(span))
    ]
    assert worker.blocks_of(hex_id(span)) == [(THREAD, "done", {"text": "Friday."})]
    assert (span.attributes or {})["kernel_ext.stream.blocks_admitted"] == 1


async def test_a_describe_hook_overrides_the_conversation() -> None:
    def by_user(tool: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ToolDescription:
        described = describe_tool_run(tool, args, kwargs)
        user = kwargs["config"]["configurable"]["user"]
        return dataclasses.replace(described, conversation_id=f"chat-{user}")

    @tool
    async def ask_colleague(question: str) -> str:
        """Ask a colleague."""
        call = current_tool_call()
        assert call is not None
        return call.conversation_id or ""

    started = start_worker(describe=by_user)
    try:
        graph = agent([ask_colleague], two_calls("ask_colleague"), AIMessage("done"))
        run = {"configurable": {"thread_id": THREAD, "user": "ann"}}
        result = await asyncio.wait_for(graph.ainvoke({"messages": [("user", "go")]}, run), 30)
    finally:
        await kernel_ext.adisable()
        started.provider.shutdown()
    answers = [m.content for m in result["messages"] if isinstance(m, ToolMessage)]
    assert answers == ["chat-ann", "chat-ann"]
    conversations = {(s.attributes or {})["gen_ai.conversation.id"] for s in started.tool_spans()}
    assert conversations == {"chat-ann"}


class Boom(Exception):
    pass


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_failing_tool_raises_unchanged_and_its_open_stream_is_aborted(
    worker: Worker, kind: str
) -> None:
    if kind == "async":

        @tool
        async def explode(question: str) -> str:
            """Fails after a running block."""
            publish("trying")
            raise Boom("tool failed")

        with pytest.raises(Boom, match="tool failed"):
            await explode.ainvoke({"question": "q"}, RUN)
    else:

        @tool
        def explode(question: str) -> str:  # type: ignore[no-redef]
            """Fails after a running block."""
            publish("trying")
            raise Boom("tool failed")

        with pytest.raises(Boom, match="tool failed"):
            explode.invoke({"question": "q"}, RUN)
    await worker.emitter.wait_for(lambda records: len(records) == 2)
    [span] = worker.tool_spans()
    assert worker.blocks_of(hex_id(span)) == [
        (THREAD, "running", {"text": "trying"}),
        (THREAD, "aborted", {"message": "Boom: tool failed"}),
    ]
    assert span.status.status_code is trace.StatusCode.ERROR
    assert current_tool_call() is None


async def test_toolnode_turns_the_error_into_a_message_and_the_stream_is_still_aborted(
    worker: Worker,
) -> None:
    @tool
    async def explode(question: str) -> str:
        """Fails after a running block."""
        publish("trying")
        raise Boom("tool failed")

    graph = agent(
        [explode],
        AIMessage("", tool_calls=[tool_call("explode", "llm-x", question="q")]),
        AIMessage("sorry"),
        handle_tool_errors=True,
    )
    result = await asyncio.wait_for(graph.ainvoke({"messages": [("user", "go")]}, RUN), 30)
    [message] = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    assert message.status == "error"
    await worker.emitter.wait_for(lambda records: len(records) == 2)
    [span] = worker.tool_spans()
    assert [state for _, state, _ in worker.blocks_of(hex_id(span))] == ["running", "aborted"]


async def test_a_tool_that_invokes_a_tool_is_the_parent_of_that_call(worker: Worker) -> None:
    @tool
    async def search(q: str) -> ToolCall | None:
        """The inner tool."""
        return current_tool_call()

    @tool
    async def ask_colleague(question: str) -> list[ToolCall | None]:
        """The outer tool: calls search."""
        return [current_tool_call(), await search.ainvoke({"q": question})]

    outer, inner = await ask_colleague.ainvoke({"question": "q"}, RUN)
    spans = {s.name: s for s in worker.tool_spans()}
    assert outer == ToolCall(
        hex_id(spans["execute_tool ask_colleague"]),
        "ask_colleague",
        THREAD,
        trace_id=trace_of(spans["execute_tool ask_colleague"]),
    )
    # search.ainvoke got no config: its own run inherits the thread from the outer tool's.
    assert inner == ToolCall(
        hex_id(spans["execute_tool search"]),
        "search",
        THREAD,
        None,
        outer,
        trace_id=trace_of(spans["execute_tool search"]),
    )


def researcher(kind: str, fail: bool) -> BaseTool:
    """A tool that only calls another tool (``search``, twice), then answers or raises."""
    if kind == "async":

        @tool
        async def search(q: str) -> str:
            """The inner tool."""
            return f"results for {q}"

        @tool
        async def research(question: str) -> str:
            """The outer tool: calls search twice."""
            found = await search.ainvoke({"q": question})
            found = await search.ainvoke({"q": found})
            if fail:
                raise Boom("the search went nowhere")
            return f"summary of {found}"

        return research

    @tool
    def search_sync(q: str) -> str:
        """The inner tool."""
        return f"results for {q}"

    @tool
    def research_sync(question: str) -> str:
        """The outer tool: calls search twice."""
        found = search_sync.invoke({"q": question})
        found = search_sync.invoke({"q": found})
        if fail:
            raise Boom("the search went nowhere")
        return f"summary of {found}"

    return research_sync


async def research_in_a_graph(
    worker: Worker, kind: str, fail: bool
) -> tuple[ToolMessage, list[tuple[str, str, Any]]]:
    """LangGraph's agent loop runs ``researcher(kind, fail)`` once (``ToolNode`` turns an
    error into a message); returns the model's tool message and the research call's blocks,
    whose two ``tool_call`` lines name the two search calls."""
    research = researcher(kind, fail)
    graph = agent(
        [research],
        AIMessage("", tool_calls=[tool_call(research.name, "llm-r", question="trains")]),
        AIMessage("ok"),
        handle_tool_errors=True,
    )
    state = {"messages": [("user", "go")]}
    if kind == "async":
        result = await asyncio.wait_for(graph.ainvoke(state, RUN), 30)
    else:
        result = await asyncio.wait_for(asyncio.to_thread(graph.invoke, state, RUN), 30)
    await worker.emitter.wait_for(lambda records: len(records) == 3)
    spans = worker.tool_spans()
    [outer] = [s for s in spans if s.name == f"execute_tool {research.name}"]
    blocks = worker.blocks_of(hex_id(outer))
    assert [state for _, state, _ in blocks[:2]] == ["running", "running"]
    inner = sorted(hex_id(s) for s in spans if s is not outer)
    assert sorted(payload["callId"] for _, _, payload in blocks[:2]) == inner
    [message] = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    return message, blocks


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_tool_that_only_calls_tools_ends_its_pane_done_with_its_answer(
    worker: Worker, kind: str
) -> None:
    message, blocks = await research_in_a_graph(worker, kind, fail=False)
    answer = "summary of results for results for trains"
    assert message.content == answer
    # The pane reads as the call ended: done, with the text the model got.
    assert blocks[-1] == (THREAD, "done", {"text": answer})


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_tool_that_only_calls_tools_and_raises_ends_its_pane_aborted_with_the_error(
    worker: Worker, kind: str
) -> None:
    message, blocks = await research_in_a_graph(worker, kind, fail=True)
    assert message.status == "error"
    assert blocks[-1] == (THREAD, "aborted", {"message": "Boom: the search went nowhere"})


@pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="LangGraph hands its config on through the context only from Python 3.11",
)
async def test_a_node_that_runs_a_tool_itself_gets_the_graphs_thread(worker: Worker) -> None:
    @tool
    def lookup(key: str) -> ToolCall | None:
        """A sync tool."""
        return current_tool_call()

    def node(state: MessagesState) -> dict[str, list[BaseMessage]]:
        call = lookup.run({"key": "k"})  # no config passed: LangGraph's is in the context
        assert call is not None
        return {"messages": [AIMessage(call.conversation_id or "")]}

    graph = StateGraph(MessagesState)
    graph.add_node("node", node)
    graph.add_edge(START, "node")
    result = await asyncio.wait_for(graph.compile().ainvoke({"messages": []}, RUN), 30)
    assert result["messages"][-1].content == THREAD


def test_thread_id_reads_configurable_then_metadata() -> None:
    assert thread_id(None) is None
    assert thread_id({}) is None
    assert thread_id({"configurable": {"thread_id": "a"}, "metadata": {"thread_id": "b"}}) == "a"
    assert thread_id({"configurable": {}, "metadata": {"thread_id": "b"}}) == "b"
    assert thread_id({"configurable": {"thread_id": 7}}) == "7"
    assert thread_id({"configurable": {"thread_id": ""}, "metadata": {"thread_id": None}}) is None
    assert thread_id({"configurable": {"thread_id": True}}) is None


def test_describe_names_the_tool_and_the_models_call() -> None:
    @tool
    def lookup(key: str) -> str:
        """A tool."""
        return key

    config = {"configurable": {"thread_id": "t"}}
    assert describe_tool_run(lookup, ({"key": "k"},), {"config": config}) == ToolDescription(
        "lookup", "t", None
    )
    assert describe_tool_run(
        lookup, ({"key": "k"},), {"config": config, "tool_call_id": "llm-1"}
    ) == ToolDescription("lookup", "t", "llm-1")
    # Outside any run and without a config: no conversation (the enclosing call's, if any).
    assert describe_tool_run(lookup, ({"key": "k"},), {}) == ToolDescription("lookup")


def test_the_targets_are_the_methods_every_tool_call_runs_through() -> None:
    assert TARGETS == ("langchain_core.tools:BaseTool.run", "langchain_core.tools:BaseTool.arun")
    assert [t.target for t in langchain_targets()] == list(TARGETS)
    assert {t.describe for t in langchain_targets()} == {describe_tool_run}


def test_importing_kernel_ext_and_its_integrations_package_loads_no_langchain() -> None:
    code = (
        "import sys, kernel_ext, kernel_ext.integrations, kernel_ext.instrument\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('langchain_core', 'langgraph', 'langsmith')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
