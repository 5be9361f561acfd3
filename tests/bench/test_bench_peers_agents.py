"""The OpenAI Agents SDK contenders of benchmarks/bench_peers.py (peer_openai_agents.py).

No timing is asserted: what is checked is that the SDK still has no streaming path for a
function tool (the reason the benchmark reports no ratio against it), and that each trial
counts what really arrived, so the benchmark's own "n of n events arrived" check can fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import typing

import pytest
from support.network import need_module  # (support puts benchmarks/ on sys.path)

need_module("agents", "pip install openai-agents")

import peer_openai_agents  # noqa: E402
from agents import RunContextWrapper, stream_events  # noqa: E402
from agents.tool_context import ToolContext  # noqa: E402
from bench_peers import PAYLOAD, KernelExtContender  # noqa: E402


def test_the_sdk_stream_carries_no_event_a_tool_could_emit() -> None:
    # Runner.run_streamed(...).stream_events() yields StreamEvent: the model's raw stream,
    # items the runner makes, agent updates. A new member may be a tool progress path: then
    # the benchmark needs a like-for-like contender and a ratio (peer_openai_agents.py).
    members = set(typing.get_args(stream_events.StreamEvent))
    assert members == {
        stream_events.RawResponsesStreamEvent,
        stream_events.RunItemStreamEvent,
        stream_events.AgentUpdatedStreamEvent,
    }
    run_item_names = set(
        typing.get_args(typing.get_type_hints(stream_events.RunItemStreamEvent)["name"])
    )
    assert not {name for name in run_item_names if "progress" in name or "delta" in name}


def test_a_tool_context_has_no_emit_and_no_handle_on_the_run_stream() -> None:
    fields = {f.name for f in dataclasses.fields(ToolContext)}
    fields |= {f.name for f in dataclasses.fields(RunContextWrapper)}
    names = fields | {name for name in dir(ToolContext) if not name.startswith("__")}
    assert not {n for n in names if any(w in n for w in ("emit", "stream", "queue", "event"))}


@pytest.mark.parametrize("n", [0, 3])
def test_the_per_event_trial_counts_the_blocks_the_sender_got(n: int) -> None:
    async def go() -> tuple[int, int, int]:
        async with KernelExtContender() as ours:
            trials = peer_openai_agents.agents_trials(ours, PAYLOAD)
            assert not isinstance(trials, str)
            _, _, seen = await trials.per_event(n)
            return seen, ours.sender.blocks, ours.sender.terminals

    seen, blocks, terminals = asyncio.run(go())
    assert (seen, blocks, terminals) == (n, n + 1, 1)


@pytest.mark.parametrize("n", [0, 2])
def test_the_per_call_trial_counts_the_calls_beyond_the_baselines_one(n: int) -> None:
    async def go() -> int:
        async with KernelExtContender() as ours:
            trials = peer_openai_agents.agents_trials(ours, PAYLOAD)
            assert not isinstance(trials, str)
            _, _, seen = await trials.per_call(n)
            return seen

    assert asyncio.run(go()) == n
