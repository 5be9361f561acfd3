"""The AG-UI bridge with a real AG-UI server (pydantic-ai's adapter under uvicorn), a real A2A
colleague, and the official client (``@ag-ui/client``'s ``HttpAgent``) under Node: every
event the client received is checked here."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic_ai", reason="pydantic-ai needs Python >= 3.11")
pytest.importorskip("ag_ui.core", reason="the agui extra (ag-ui-protocol) is not installed")

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import jsonpatch
from opentelemetry.sdk.trace import TracerProvider
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ToolCallPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route
from support import TESTS
from support.network import IN_CI, free_port, need_binary, serve_asgi

import kernel_ext
from kernel_ext.a2a import ask_colleague
from kernel_ext.errors import ConfigError
from kernel_ext.integrations.ag_ui import (
    ACTIVITY_TYPE,
    NO_TOOL_CALL_ID,
    SURROGATES_REPLACED,
    AGUIBridge,
    ag_ui_endpoint,
    message_id_of,
)
from kernel_ext.integrations.pydantic_ai import KernelExtCapability
from kernel_ext.testing.a2a_peer import SCRIPT_KEY, ScriptedPeer

CLIENT = TESTS / "js" / "agui"
ANSWER = "Order 42 shipped on Monday; it arrives Friday."
HOSTILE = '</script><img src=x onerror=alert(1)>"\u2028{{x}}'
LONE = "before \ud800 after"  # a lone surrogate: a block may hold one (docs/protocol.md)
SHOWN = "before \ufffd after"  # what an AG-UI client gets instead (docs/ag-ui.md)
COLLEAGUE = "colleague-task-1"
USERS = {"alice": {"thread-a"}, "bob": {"thread-b"}}


def model(calls: list[ToolCallPart], answer: str = "Here is what I found.") -> FunctionModel:
    """Asks for ``calls`` in its first turn, then answers (streamed, as AG-UI runs are)."""

    async def stream(
        messages: list[ModelMessage], info: AgentInfo
    ) -> AsyncIterator[str | DeltaToolCalls]:
        if len(messages) == 1:
            for index, call in enumerate(calls):
                yield {
                    index: DeltaToolCall(
                        call.tool_name, call.args_as_json_str(), tool_call_id=call.tool_call_id
                    )
                }
        else:
            yield answer

    return FunctionModel(stream_function=stream)


def build_agent(colleague_url: str, provider: TracerProvider) -> Agent[None, str]:
    """The application's agent: ask_colleague over A2A, and a local tool that streams."""
    agent: Agent[None, str] = Agent(
        model(
            [
                ToolCallPart("ask_colleague", {"question": "where is order 42?"}, "llm-ask"),
                ToolCallPart("check_stock", {"burst": 50}, "llm-stock"),
            ]
        ),
        capabilities=[KernelExtCapability(tracer_provider=provider)],
    )

    @agent.tool_plain(name="ask_colleague")
    async def ask(question: str) -> str:
        return await ask_colleague(colleague_url, question, metadata={SCRIPT_KEY: "work"})

    @agent.tool_plain
    async def check_stock(burst: int) -> str:
        for i in range(burst):  # one burst: the hub lets 10 through per second
            kernel_ext.publish(f"checked warehouse {i} {HOSTILE}")
        await asyncio.sleep(0)
        kernel_ext.publish("in stock " + HOSTILE, state="done")
        return "in stock"

    return agent


def authenticate(request: Request) -> str | None:
    user = request.headers.get("authorization", "").removeprefix("Bearer ")
    return user if user in USERS else None


def authorize_join(user: str, thread_id: str) -> bool:
    return thread_id in USERS.get(user, set())


@dataclass
class Served:
    url: str
    bridge: AGUIBridge


def build_lone_surrogate_agent(colleague_url: str, provider: TracerProvider) -> Agent[None, str]:
    """An agent whose tool publishes (on its own stream and a colleague's), returns and
    answers text with lone surrogates wherever a block may hold one: payload text, a
    terminal's text, a tool name."""
    agent: Agent[None, str] = Agent(
        model([ToolCallPart("relay_text", {}, "llm-text")], answer=LONE),
        capabilities=[KernelExtCapability(tracer_provider=provider)],
    )

    def envelope(kind: str, key: str, seq: int, payload: dict[str, Any]) -> dict[str, Any]:
        head = {"v": 1, "kind": kind, "streamKey": key, "seq": seq, "status": "running"}
        return {**head, "payload": payload}

    @agent.tool_plain
    async def relay_text() -> str:
        tool_call = {"name": "look\udfffup", "args": {"query": [LONE]}}
        kernel_ext.publish(envelope("tool_call", "own", 1, tool_call))
        kernel_ext.publish(envelope("text", "own", 2, {"text": LONE}))
        kernel_ext.publish(envelope("text", COLLEAGUE, 1, {"text": LONE}), task_id=COLLEAGUE)
        kernel_ext.publish(LONE, task_id=COLLEAGUE, state="done")
        kernel_ext.publish(LONE, state="done")
        return LONE

    return agent


AgentFactory = Callable[[str, TracerProvider], Agent[None, str]]


@pytest.fixture
def agent_factory() -> AgentFactory:
    """The agent the ``served`` fixture serves (a test may override it)."""
    return build_agent


@pytest.fixture
async def served(agent_factory: AgentFactory) -> AsyncIterator[Served]:
    provider = TracerProvider()
    bridge = AGUIBridge()
    kernel_ext.enable(emitter=bridge, tracer_provider=provider, handle_sigterm=False)
    peer_port = free_port()
    peer = ScriptedPeer(f"http://127.0.0.1:{peer_port}/", flood_count=10)
    agent = agent_factory(f"http://127.0.0.1:{peer_port}", provider)
    endpoint = ag_ui_endpoint(
        agent, bridge, authenticate=authenticate, authorize_join=authorize_join
    )
    app = Starlette(routes=[Route("/agent", endpoint, methods=["POST"])])
    try:
        async with serve_asgi(peer.app, peer_port), serve_asgi(app) as port:
            yield Served(f"http://127.0.0.1:{port}/agent", bridge)
    finally:
        await peer.aclose()
        await kernel_ext.adisable()


async def run_client(url: str, thread_id: str, user: str) -> dict[str, Any]:
    """One run with the official client under Node: what it received."""
    node = need_binary("node", "NODE")
    if not (CLIENT / "node_modules" / "@ag-ui" / "client").is_dir():
        message = "npm ci --prefix tests/js/agui has not run (.ci/run runs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    process = await asyncio.create_subprocess_exec(
        node,
        "run.mjs",
        url,
        thread_id,
        "run-" + uuid.uuid4().hex,
        f"authorization=Bearer {user}",
        cwd=CLIENT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    received: dict[str, Any] = json.loads(out)
    return received


def pane_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kinds = ("ACTIVITY_", "SUBAGENT_")
    return [e for e in events if e["type"].startswith(kinds)]


def activities(received: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The activity messages the client built, by message id."""
    return {m["id"]: m for m in received["messages"] if m["role"] == "activity"}


def check_run(received: dict[str, Any], thread_id: str) -> None:
    """Every event of one run, in the order and shape the bridge promises."""
    assert received["error"] is None
    events = received["events"]
    types = [e["type"] for e in events]
    assert types[0] == "RUN_STARTED"
    assert types[-1] == "RUN_FINISHED"
    assert events[0]["threadId"] == thread_id
    tool_calls = {e["toolCallId"] for e in events if e["type"] == "TOOL_CALL_START"}
    assert tool_calls == {"llm-ask", "llm-stock"}
    panes: dict[str, dict[str, Any]] = {}
    subagents: dict[str, str] = {}
    for event in pane_events(events):
        if event["type"] == "ACTIVITY_SNAPSHOT":
            assert event["activityType"] == ACTIVITY_TYPE
            assert event["messageId"] not in panes  # one snapshot per pane, then deltas
            panes[event["messageId"]] = event["content"]
        elif event["type"] == "ACTIVITY_DELTA":
            assert event["activityType"] == ACTIVITY_TYPE
            assert event["messageId"] in panes
            assert event["patch"]  # only what changed, never empty
            assert "" not in {op["path"] for op in event["patch"]}  # not a whole new content
            content = panes[event["messageId"]]
            assert content["status"] != "ended"  # nothing changes after the pane ended
            panes[event["messageId"]] = jsonpatch.apply_patch(content, event["patch"])
        elif event["type"] == "SUBAGENT_STARTED":
            assert event["subagentRunId"] not in subagents
            assert event["parentToolCallId"] == "llm-ask"
            subagents[event["subagentRunId"]] = "open"
        else:
            assert subagents[event["subagentRunId"]] == "open"  # ends exactly once
            subagents[event["subagentRunId"]] = event["type"]
    assert set(subagents.values()) == {"SUBAGENT_FINISHED"}
    finished = [e for e in events if e["type"] == "SUBAGENT_FINISHED"]
    assert [e["result"] for e in finished] == [ANSWER]
    built = activities(received)
    assert set(built) == set(panes)
    by_tool = {m["content"]["toolCallId"]: m["content"] for m in built.values()}
    assert set(by_tool) == {"llm-ask", "llm-stock"}
    ask = by_tool["llm-ask"]
    assert ask["status"] == "ended"
    assert ask["final"] == {"from": "done", "taskId": ask["tasks"][0]["taskId"], "text": ANSWER}
    [task] = ask["tasks"]
    kinds = [item["kind"] for item in task["items"]]
    assert kinds[0] == "thinking"
    assert task["items"][0]["folded"] is True
    assert "tool_call" in kinds
    assert kinds[-1] == "text"
    stock = by_tool["llm-stock"]
    assert stock["status"] == "ended"
    assert stock["final"]["text"] == "in stock " + HOSTILE  # hostile text carried as data
    [local] = stock["tasks"]
    assert local["taskId"] == stock["callId"]  # a local stream: no subagent
    assert len(local["items"]) == 10  # the hub's throttle: 10 running blocks in one second
    assert local["items"][0]["text"] == "checked warehouse 0 " + HOSTILE
    # What the client built is what the snapshot and the deltas make.
    for message_id, content in panes.items():
        assert message_id == message_id_of(content["callId"])
        assert built[message_id]["content"] == content


@pytest.mark.network
@pytest.mark.timeout(120)
async def test_the_official_client_gets_each_tool_calls_pane_live_attributed_and_ended_once(
    served: Served,
) -> None:
    received = await run_client(served.url, "thread-a", "alice")
    check_run(received, "thread-a")
    # Deltas, not snapshots per block: the colleague's pane took one snapshot and deltas.
    ask_id = next(
        i for i, m in activities(received).items() if m["content"]["toolCallId"] == "llm-ask"
    )
    mine = [e for e in received["events"] if e.get("messageId") == ask_id]
    assert mine[0]["type"] == "ACTIVITY_SNAPSHOT"
    assert {e["type"] for e in mine[1:]} == {"ACTIVITY_DELTA"}
    assert served.bridge.counts[NO_TOOL_CALL_ID] == 0
    assert served.bridge.runs == 0


@pytest.mark.network
@pytest.mark.timeout(120)
async def test_two_threads_at_once_each_see_only_their_own_panes_and_a_refused_run_gets_none(
    served: Served,
) -> None:
    a, b, refused = await asyncio.gather(
        run_client(served.url, "thread-a", "alice"),
        run_client(served.url, "thread-b", "bob"),
        run_client(served.url, "thread-b", "alice"),  # alice may not see thread-b
    )
    check_run(a, "thread-a")
    check_run(b, "thread-b")
    calls_a = {m["content"]["callId"] for m in activities(a).values()}
    calls_b = {m["content"]["callId"] for m in activities(b).values()}
    assert len(calls_a) == len(calls_b) == 2
    assert not calls_a & calls_b
    assert refused["error"] is not None
    assert "403" in refused["error"]
    assert refused["events"] == []
    assert activities(refused) == {}


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_an_unknown_user_is_refused_before_anything_runs(served: Served) -> None:
    received = await run_client(served.url, "thread-a", "mallory")
    assert received["error"] is not None
    assert "401" in received["error"]
    assert received["events"] == []


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("agent_factory", [build_lone_surrogate_agent])
async def test_a_lone_surrogate_reaches_the_official_client_replaced_and_the_run_finishes(
    served: Served,
) -> None:
    received = await run_client(served.url, "thread-a", "alice")
    assert received["error"] is None
    events = received["events"]
    types = [e["type"] for e in events]
    assert types[0] == "RUN_STARTED"
    assert types[-1] == "RUN_FINISHED"
    # The run's own events: the tool's result and the model's answer.
    [result] = [e for e in events if e["type"] == "TOOL_CALL_RESULT"]
    assert result["toolCallId"] == "llm-text"
    assert result["content"] == SHOWN
    answer = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
    assert answer == SHOWN
    # The pane: every string the blocks held, each lone surrogate replaced.
    [pane] = [m["content"] for m in activities(received).values()]
    assert pane["toolCallId"] == "llm-text"
    assert pane["status"] == "ended"
    assert pane["final"]["text"] == SHOWN
    items = {task["taskId"]: task["items"] for task in pane["tasks"]}
    assert items == {
        pane["callId"]: [
            {"kind": "tool_call", "seq": 1, "tool": "look\ufffdup"},
            {"kind": "text", "seq": 2, "text": SHOWN},
        ],
        COLLEAGUE: [{"kind": "text", "seq": 1, "text": SHOWN}],
    }
    [finished] = [e for e in events if e["type"] == "SUBAGENT_FINISHED"]
    assert finished["result"] == SHOWN
    assert served.bridge.counts[SURROGATES_REPLACED] >= 7  # 5 blocks, the result, the answer
    assert served.bridge.runs == 0


async def test_a_thread_id_that_is_not_a_string_is_a_config_error() -> None:
    bridge = AGUIBridge()

    async def nothing() -> AsyncIterator[Any]:
        return
        yield

    with pytest.raises(ConfigError, match="thread_id"):
        async for _ in bridge.stream("", nothing()):
            pass


def test_bad_bounds_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="max_runs"):
        AGUIBridge(max_runs=0)
    with pytest.raises(ConfigError, match="run_end_timeout"):
        AGUIBridge(run_end_timeout=0)
