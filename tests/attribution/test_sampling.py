"""Sampled-out calls still end (issue: terminal edges, item 3).

A sampler that drops the trace makes the SDK create non-recording spans, which still have
span ids but get no span processor hook. The wrapped tool runtime owns its call's end: its
blocks are attributed to the span id, each stream it left open gets exactly one terminal,
and the hub and the tap are empty again afterwards — under ``ALWAYS_OFF``,
``TraceIdRatioBased(0.1)`` and ``ParentBased`` under an unsampled parent, for calls that
return and calls that raise, sync and async. Everything through the public API: an SDK
tracer provider with the span processor, the instrumentor on a kernel's tool runtime, the
stream hub and an in-process sender.
"""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
)
from support.reliability_helpers import RUNS, report
from support.sampling_helpers import CONV, SAMPLERS, Kernel, setup

from kernel_ext import current_call_id


class ToolFailed(Exception):
    pass


@pytest.mark.parametrize("name", list(SAMPLERS))
async def test_sampled_out_calls_are_attributed_end_once_and_leave_nothing(name: str) -> None:
    sampler, around = SAMPLERS[name]
    async with setup(sampler) as s:
        kernel = Kernel()
        seen: list[tuple[str, str]] = []  # (call id, how the call ended)
        calls = 20 * RUNS
        for i in range(calls):

            def returns(i: int = i) -> str:
                s.hub.publish(f"sync step of call {i}", task_id="t1")
                s.hub.publish(f"another stream of call {i}", task_id="t2")
                s.hub.publish("t2's own answer", task_id="t2", state="done")
                seen.append((current_call_id() or "", "returned"))
                return "ok"

            def raises(i: int = i) -> str:
                s.hub.publish(f"sync step of failing call {i}", task_id="t1")
                seen.append((current_call_id() or "", "raised"))
                raise ToolFailed(f"call {i} broke")

            async def areturns(i: int = i) -> str:
                s.hub.publish(f"async step of call {i}", task_id="t1")
                await asyncio.sleep(0)
                seen.append((current_call_id() or "", "returned"))
                return "ok"

            async def araises(i: int = i) -> str:
                s.hub.publish(f"async step of failing call {i}", task_id="t1")
                await asyncio.sleep(0)
                seen.append((current_call_id() or "", "raised"))
                raise ToolFailed(f"call {i} broke")

            with around():
                kernel.run_tool("ask_colleague", returns)
                with pytest.raises(ToolFailed):
                    kernel.run_tool("ask_colleague", raises)
                await kernel.arun_tool("ask_colleague", areturns)
                with pytest.raises(ToolFailed):
                    await kernel.arun_tool("ask_colleague", araises)

        await s.emitter.flush(5)
        assert all(call_id for call_id, _ in seen)
        assert len({call_id for call_id, _ in seen}) == len(seen) == 4 * calls
        for call_id, ended in seen:
            blocks = s.emitter.blocks(CONV)
            mine = [b for b in blocks if b["callId"] == call_id]
            t1 = [b for b in mine if b["taskId"] == "t1"]
            assert [b["state"] for b in t1] == ["running", "aborted"], t1
            message = t1[-1]["envelope"]["payload"]["message"]
            if ended == "raised":
                assert message.startswith("ToolFailed: call ")
                assert message.endswith(" broke")
            else:
                assert message == "the tool call ended before its stream did"
            t2 = [b for b in mine if b["taskId"] == "t2"]
            if t2:  # the sync returning body opened a second stream and ended it itself
                assert [b["state"] for b in t2] == ["running", "done"]
        stats = s.hub.stats()
        assert (stats.streams, stats.calls, stats.closed, stats.queue) == (0, 0, 0, 0)
        assert len(s.tap) == 0
        assert stats["error"] == 0
        finals = s.emitter.terminals(CONV)
    report(
        f"sampled-out tool calls ({name})",
        calls=4 * calls,
        open_streams_expected=4 * calls,
        terminals_delivered=sum(1 for b in finals if b["taskId"] == "t1"),
        left_in_hub_and_tap=stats.streams + stats.calls + len(s.tap),
    )


async def test_a_recorded_call_also_ends_exactly_once() -> None:
    """With every span recorded, the runtime and the span processor both see the call's
    end: its open stream still gets one terminal, not two."""
    async with setup(ALWAYS_ON) as s:

        def body() -> str:
            s.hub.publish("working", task_id="t1")
            return "ok"

        for _ in range(50):
            Kernel().run_tool("ask_colleague", body)
        await s.emitter.flush(5)
        finals = s.emitter.terminals(CONV)
        assert len(finals) == 50
        assert len({(b["callId"], b["taskId"]) for b in finals}) == 50
        stats = s.hub.stats()
        assert (stats.streams, stats.calls, stats.closed) == (0, 0, 0)
        assert len(s.tap) == 0
