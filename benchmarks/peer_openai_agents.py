"""The OpenAI Agents SDK contenders of ``bench_peers.py`` (its docstring is the method).

The SDK has no path for a function tool to stream progress (openai-agents 0.24):
``Runner.run_streamed(...).stream_events()`` yields only ``RawResponsesStreamEvent`` (the
model's own stream), ``RunItemStreamEvent`` (items the runner makes: ``tool_called``,
``tool_output`` once the tool has returned, messages, handoffs) and
``AgentUpdatedStreamEvent``; the ``ToolContext`` a tool gets has no emit and no handle on the
run's event queue. ``Agent.as_tool(on_stream=...)`` forwards a nested *agent's* run events to
a callback, not events from tool code. So there is no like-for-like peer path, and no ratio:
kernel_ext's per-event cost from a function tool that the SDK's ``Runner`` runs is reported
as information next to the SDK's own cost of one function tool call.

Both run in the real ``Runner.run`` (SDK tracing off, so nothing leaves the process) on a
``Model`` of ours that answers without a network: turn one asks for the tool calls, turn two
answers with text.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol


class Measured(Protocol):
    """What ``bench_peers.Measured`` gives this module (kept as a protocol: importing
    bench_peers here would make the two modules import each other)."""

    per_event_us: float
    cpu_us: float
    spread_us: tuple[float, float]


PER_EVENT = "kernel_ext publish() in an Agents SDK function tool (Runner.run)"
PER_CALL = "Agents SDK function tool call (Runner.run)"
CALLS = 200
QUICK_CALLS = 100

Trial = Callable[[int], Awaitable[tuple[float, float, int]]]


class AgentsTrials(NamedTuple):
    per_event: Trial
    """``trial(n)``: one call of an attributed tool that publishes ``n`` events."""
    per_call: Trial
    """``trial(n)``: one turn of ``n + 1`` calls of a no-op tool (one is the baseline's)."""


def agents_trials(ours: Any, payload: str) -> AgentsTrials | str:
    """The SDK contenders, publishing into ``ours``' hub (a ``bench_peers.KernelExtContender``),
    or why they cannot run."""
    try:
        from agents import Agent, Model, ModelResponse, RunConfig, Runner, Usage, function_tool
        from openai.types.responses import (
            ResponseFunctionToolCall,
            ResponseOutputMessage,
            ResponseOutputText,
        )
    except ImportError as exc:
        return f"openai-agents not installed ({exc.name}); install the `bench` extra"

    from kernel_ext import publish
    from kernel_ext.integrations.openai_agents import attributed_tools

    answer = ResponseOutputMessage(
        id="msg",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(text="done", type="output_text", annotations=[])],
    )

    class TwoTurns(Model):
        """Turn one: the calls the trial asks for; turn two: a text answer."""

        def __init__(self) -> None:
            self.calls: list[ResponseFunctionToolCall] = []
            self.turn = 0

        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            self.turn += 1
            output: list[Any] = list(self.calls) if self.turn == 1 else [answer]
            return ModelResponse(output=output, usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the benchmark runs Runner.run")

    ids = itertools.count()

    def tool_call(name: str, arguments: dict[str, int]) -> ResponseFunctionToolCall:
        call_id = f"call_{next(ids)}"
        return ResponseFunctionToolCall(
            id=call_id,
            call_id=call_id,
            type="function_call",
            name=name,
            arguments=json.dumps(arguments),
        )

    box: dict[str, float] = {}

    async def ask_colleague(n: int) -> str:
        """Publish n progress events, then the final answer."""
        start = time.perf_counter()
        for _ in range(n):
            publish(payload)
        box["in_tool"] = time.perf_counter() - start
        publish("final answer", state="done")
        return "final answer"

    async def noop(n: int) -> str:
        """Do nothing."""
        return "ok"

    publishing = Agent(
        name="kernel",
        tools=attributed_tools(
            [function_tool(ask_colleague)], sink=ours.hub, tracer_provider=ours.provider
        ),
    )
    plain = Agent(name="kernel", tools=[function_tool(noop)])
    sender = ours.sender

    async def per_event(n: int) -> tuple[float, float, int]:
        model = TwoTurns()
        model.calls = [tool_call("ask_colleague", {"n": n})]
        config = RunConfig(model=model, group_id=f"conv-{next(ids)}", tracing_disabled=True)
        sender.terminal_seen.clear()
        before = sender.blocks
        start = time.perf_counter()
        await Runner.run(publishing, "go", run_config=config)
        await asyncio.wait_for(sender.terminal_seen.wait(), 10.0)
        total = time.perf_counter() - start
        return total, box.pop("in_tool", 0.0), sender.blocks - before - 1

    async def per_call(n: int) -> tuple[float, float, int]:
        model = TwoTurns()
        model.calls = [tool_call("noop", {"n": 0}) for _ in range(n + 1)]
        config = RunConfig(model=model, tracing_disabled=True)
        start = time.perf_counter()
        result = await Runner.run(plain, "go", run_config=config)
        total = time.perf_counter() - start
        outputs = sum(item.type == "tool_call_output_item" for item in result.new_items)
        return total, 0.0, outputs - 1

    return AgentsTrials(per_event, per_call)


def agents_figure(
    agents: AgentsTrials | str,
    calls: dict[str, Measured],
    in_agents: Measured | None,
    n_calls: int,
    repeats: int,
) -> dict[str, Any]:
    """The SDK's cost of one function tool call, with kernel_ext's per-event cost inside such
    a call beside it (information: there is no like-for-like peer path to hold it against)."""
    figure: dict[str, Any] = {
        "name": f"{PER_CALL}: wall per call, no streaming path for tools (info)",
        "value": None,
        "unit": "µs",
        "target": None,
        "ok": None,
    }
    if isinstance(agents, str):
        return {**figure, "detail": f"not measured: {agents}"}
    call = calls[PER_CALL]
    if in_agents is None:
        raise RuntimeError(f"{PER_EVENT} was not measured")
    share = in_agents.per_event_us / call.per_event_us * 100
    detail = (
        f"CPU {call.cpu_us:.2f} µs/call ({n_calls} calls in one turn, median of {repeats} "
        f"rounds; rounds ranged {call.spread_us[0]:.2f}–{call.spread_us[1]:.2f} µs); "
        f"kernel_ext publish() inside such a call: {in_agents.per_event_us:.2f} µs wall, "
        f"{in_agents.cpu_us:.2f} µs CPU per event ({share:.1f}% of one SDK tool call)"
    )
    return {**figure, "value": round(call.per_event_us, 2), "detail": detail}
