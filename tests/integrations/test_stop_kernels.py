# ruff: noqa: E402  (the frameworks are imported after need_module() checked they are installed)
"""A stopped call gives each kernel's model a normal tool result (issue 35, point 5): in
pydantic-ai's agent loop (FunctionModel), LangGraph's ``ToolNode`` (a graph whose model node
records what it is sent) and the OpenAI Agents SDK's runner (a Model of ours), two calls in
one turn, one stopped by :func:`kernel_ext.stop_call`: the model's next request holds the
stopped call's result — which says the user stopped it, with what it had said so far — and
the other call's own result, and the run finishes. No network."""

from __future__ import annotations

from support.network import need_module

need_module("langgraph", "pip install langgraph")
need_module("agents", "pip install openai-agents")

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

import kernel_ext
from kernel_ext import current_call_id, publish, stop_call
from kernel_ext.attribution.tap import Tap
from kernel_ext.stop import record_so_far, stopped_result
from kernel_ext.testing import MemoryEmitter
from kernel_ext.worker import wiring

CONV = "conv-stop-kernels"
SO_FAR = "a: halfway through the question"


class Colleagues:
    """The tool's side of one run: question "a" says something and waits until stopped;
    "b" answers once "a" was stopped (so both calls are live when the stop comes)."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}
        self.a_live = asyncio.Event()
        self.a_stopped = asyncio.Event()

    async def ask(self, question: str) -> str:
        call_id = current_call_id()
        assert call_id is not None
        self.ids[question] = call_id
        publish(f"{question}: thinking", task_id=call_id)
        if question == "a":
            record_so_far(SO_FAR)
            self.a_live.set()
            await asyncio.Event().wait()
        await asyncio.wait_for(self.a_stopped.wait(), 10)
        return "b's answer"

    async def stop_a(self) -> None:
        await asyncio.wait_for(self.a_live.wait(), 10)
        assert stop_call(self.ids["a"]) == "stopping"
        self.a_stopped.set()


@pytest.fixture(autouse=True)
def _always_disable() -> Iterator[None]:
    yield
    wiring.disable(timeout=2)


@pytest.fixture
def provider() -> Iterator[TracerProvider]:
    provider = TracerProvider()
    yield provider
    provider.shutdown()


@pytest.fixture
async def emitter(provider: TracerProvider) -> AsyncIterator[MemoryEmitter]:
    from kernel_ext.integrations.langchain import langchain_targets

    memory = MemoryEmitter()
    kernel_ext.enable(
        emitter=memory,
        tracer_provider=provider,
        tap=Tap(),
        handle_sigterm=False,
        targets=langchain_targets(),
    )
    try:
        yield memory
    finally:
        await kernel_ext.adisable()


async def stopped_pane(emitter: MemoryEmitter, call_id: str) -> dict[str, Any]:
    """The payload of the stopped call's terminal, once it was sent (exactly one)."""
    await emitter.wait_for(
        lambda records: any(b["callId"] == call_id and b["state"] != "running" for _, b in records)
    )
    await emitter.flush(2)
    ends = [b for _, b in emitter.records if b["callId"] == call_id and b["state"] != "running"]
    assert len(ends) == 1
    payload: dict[str, Any] = ends[0]["envelope"]["payload"]
    return payload


STOPPED = {"message": "stopped by the user", "stopped": True}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="pydantic-ai needs Python 3.11+")
async def test_pydantic_ai_model_gets_the_stopped_result_and_the_other_answer(
    emitter: MemoryEmitter, provider: TracerProvider
) -> None:
    need_module("pydantic_ai", "pip install pydantic-ai-slim")
    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from kernel_ext.integrations.pydantic_ai import KernelExtCapability

    colleagues = Colleagues()
    returned: dict[str, Any] = {}

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(
                parts=[
                    ToolCallPart("ask_colleague", {"question": "a"}, tool_call_id="llm-a"),
                    ToolCallPart("ask_colleague", {"question": "b"}, tool_call_id="llm-b"),
                ]
            )
        request = messages[-1]
        assert isinstance(request, ModelRequest)
        for part in request.parts:
            if isinstance(part, ToolReturnPart):
                returned[part.tool_call_id] = part.content
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(
        FunctionModel(respond), capabilities=[KernelExtCapability(tracer_provider=provider)]
    )

    @agent.tool_plain
    async def ask_colleague(question: str) -> str:
        return await colleagues.ask(question)

    run = asyncio.create_task(agent.run("ask both"))
    await colleagues.stop_a()
    result = await asyncio.wait_for(run, 20)
    assert result.output == "done"
    assert returned == {"llm-a": stopped_result(SO_FAR), "llm-b": "b's answer"}
    assert SO_FAR in returned["llm-a"]
    assert await stopped_pane(emitter, colleagues.ids["a"]) == STOPPED


async def test_langgraph_toolnode_model_gets_the_stopped_result_and_the_other_answer(
    emitter: MemoryEmitter,
) -> None:
    from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    colleagues = Colleagues()
    sent: list[list[BaseMessage]] = []

    @tool
    async def ask_colleague(question: str) -> str:
        """Ask a colleague."""
        return await colleagues.ask(question)

    def call_model(state: MessagesState) -> dict[str, list[BaseMessage]]:
        sent.append(list(state["messages"]))
        if len(sent) == 1:
            calls = [
                {"name": "ask_colleague", "args": {"question": q}, "id": f"llm-{q}"}
                for q in ("a", "b")
            ]
            return {"messages": [AIMessage("", tool_calls=calls)]}
        return {"messages": [AIMessage("done")]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", call_model)
    builder.add_node("tools", ToolNode([ask_colleague]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile()

    run = asyncio.create_task(
        graph.ainvoke({"messages": [("user", "ask both")]}, {"configurable": {"thread_id": CONV}})
    )
    await colleagues.stop_a()
    final = await asyncio.wait_for(run, 20)
    assert final["messages"][-1].content == "done"
    assert len(sent) == 2
    results = {m.tool_call_id: m.content for m in sent[1] if isinstance(m, ToolMessage)}
    assert results == {"llm-a": stopped_result(SO_FAR), "llm-b": "b's answer"}
    assert await stopped_pane(emitter, colleagues.ids["a"]) == STOPPED


async def test_openai_agents_model_gets_the_stopped_result_and_the_other_answer(
    emitter: MemoryEmitter, provider: TracerProvider
) -> None:
    from agents import Agent, Model, ModelResponse, RunConfig, Runner, Usage, function_tool
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    from kernel_ext.integrations.openai_agents import attributed_tools

    colleagues = Colleagues()
    inputs: list[Any] = []

    class TurnsModel(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            inputs.append(kwargs.get("input", args[1] if len(args) > 1 else None))
            if len(inputs) == 1:
                output: list[Any] = [
                    ResponseFunctionToolCall(
                        id=f"llm-{q}",
                        call_id=f"llm-{q}",
                        type="function_call",
                        name="ask_colleague",
                        arguments=json.dumps({"question": q}),
                    )
                    for q in ("a", "b")
                ]
            else:
                output = [
                    ResponseOutputMessage(
                        id="msg",
                        type="message",
                        role="assistant",
                        status="completed",
                        content=[
                            ResponseOutputText(text="done", type="output_text", annotations=[])
                        ],
                    )
                ]
            return ModelResponse(output=output, usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            raise NotImplementedError

    @function_tool
    async def ask_colleague(question: str) -> str:
        """Ask a colleague."""
        return await colleagues.ask(question)

    agent: Agent[Any] = Agent(
        name="kernel",
        model=TurnsModel(),
        tools=attributed_tools([ask_colleague], tracer_provider=provider),
    )
    run = asyncio.create_task(
        Runner.run(agent, "ask both", run_config=RunConfig(group_id=CONV, tracing_disabled=True))
    )
    await colleagues.stop_a()
    result = await asyncio.wait_for(run, 20)
    assert result.final_output == "done"
    assert len(inputs) == 2
    outputs = {
        item["call_id"]: item["output"]
        for item in inputs[1]
        if isinstance(item, dict) and item.get("type") == "function_call_output"
    }
    assert outputs == {"llm-a": stopped_result(SO_FAR), "llm-b": "b's answer"}
    assert await stopped_pane(emitter, colleagues.ids["a"]) == STOPPED


async def test_a_langchain_tool_invoked_without_a_tool_call_returns_the_stopped_text(
    emitter: MemoryEmitter,
) -> None:
    from langchain_core.tools import tool

    colleagues = Colleagues()

    @tool
    async def ask_colleague(question: str) -> str:
        """Ask a colleague."""
        return await colleagues.ask(question)

    run = asyncio.create_task(ask_colleague.ainvoke({"question": "a"}))
    await colleagues.stop_a()
    assert await asyncio.wait_for(run, 20) == stopped_result(SO_FAR)
