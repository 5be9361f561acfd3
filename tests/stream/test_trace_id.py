"""The optional ``traceId`` of a block: the trace of the call's span, carried from the
worker to the browser; a relay refuses a block whose ``traceId`` is not one.

Through the public API: an SDK tracer provider with the span processor, the instrumentor on
a kernel's tool runtime (``support.sampling_helpers``), the stream hub and an in-process
sender; the relay over a real Socket.IO connection on 127.0.0.1.
"""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanContext, TraceFlags
from support.relay_helpers import NS, barrier, block, browsers, frame, relay_server, worker
from support.sampling_helpers import CONV, SAMPLERS, Kernel, setup

from kernel_ext._shared.compat import sampled_trace_id
from kernel_ext.protocol import decode, trace_id_hex
from kernel_ext.stream import Progress

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
# A tool span another instrumentation opened (not the instrumentor's: no active call).
TOOL_SPAN = {
    "gen_ai.operation.name": "execute_tool",
    "gen_ai.tool.name": "ask_colleague",
    "gen_ai.conversation.id": CONV,
}


def trace_hex() -> str:
    """The trace id of the current span, as a block carries it."""
    return format(trace.get_current_span().get_span_context().trace_id, "032x")


async def test_every_block_of_a_sampled_call_carries_its_spans_trace_id() -> None:
    async with setup(ALWAYS_ON) as s:
        seen: dict[str, str] = {}

        def body() -> str:
            seen["trace"] = trace_hex()
            seen["call"] = format(trace.get_current_span().get_span_context().span_id, "016x")
            s.hub.publish("a small text", task_id="t1")  # the consumer's inline build
            s.hub.publish("x" * 100_000, task_id="t2")  # cut to the bound
            s.hub.publish(Progress(1, 3, "one of three"), task_id="t3")
            s.hub.publish(
                {"v": 1, "kind": "thinking", "streamKey": "t4", "seq": 1, "status": "running"},
                task_id="t4",
            )
            s.hub.publish("the answer", task_id="t4", state="done")
            # a nested call: a tool_call line on the caller's own stream, ended by the hub
            Kernel().run_tool("search", lambda: "found")
            return "ok"  # t1, t2, t3 are left open: the hub ends them

        Kernel().run_tool("ask_colleague", body)
        await s.emitter.flush(5)
        blocks = s.emitter.blocks(CONV)
        mine = [b for b in blocks if b["callId"] == seen["call"]]
        streams = {b["taskId"] for b in mine}
        assert streams == {"t1", "t2", "t3", "t4", seen["call"]}
        assert len([b for b in mine if b["state"] != "running"]) == len(streams)
        assert [b.get("traceId") for b in mine] == [seen["trace"]] * len(mine)
        nested = [b for b in blocks if b["callId"] != seen["call"]]
        assert nested == []  # the nested call published nothing of its own
        for wire in mine:
            assert decode(wire).trace_id == seen["trace"]


async def test_near_match_blocks_carry_the_trace_id_of_the_span_they_were_matched_to() -> None:
    async with setup(ALWAYS_ON) as s:
        tracer = s.provider.get_tracer("kernel")
        with tracer.start_as_current_span("execute_tool ask_colleague", attributes=TOOL_SPAN):
            expected = trace_hex()
            s.hub.publish("matched, not active", conversation_id=CONV)
        await s.emitter.flush(5)
        [running, ended] = s.emitter.blocks(CONV)
        assert running["envelope"]["payload"] == {"text": "matched, not active"}
        assert (running["traceId"], ended["traceId"]) == (expected, expected)


@pytest.mark.parametrize("name", list(SAMPLERS))
async def test_a_call_whose_span_is_not_sampled_carries_no_trace_id(name: str) -> None:
    # Its span id still exists (the callId), but the backend never gets the span: a link
    # to it would lead nowhere.
    sampler, around = SAMPLERS[name]
    async with setup(sampler) as s:

        def body() -> str:
            s.hub.publish("step", task_id="t1")
            s.hub.publish("answer", task_id="t2", state="done")
            return "ok"

        with around():
            for _ in range(20):  # the ratio sampler keeps about one in ten
                Kernel().run_tool("ask_colleague", body)
        await s.emitter.flush(5)
        blocks = s.emitter.blocks(CONV)
        assert len(blocks) == 60
        assert all(b["callId"] for b in blocks)
        unsampled = [b for b in blocks if "traceId" not in b]
        if name != "ratio_0.1":
            assert unsampled == blocks
        else:  # a sampled call's blocks all carry it, an unsampled one's none
            for call_id in {b["callId"] for b in blocks}:
                mine = [b for b in blocks if b["callId"] == call_id]
                assert len({b.get("traceId") for b in mine}) == 1


async def test_a_block_without_a_call_id_carries_no_trace_id() -> None:
    async with setup(ALWAYS_ON) as s:
        tracer = s.provider.get_tracer("kernel")
        # Two live candidates (siblings): near-match gives no callId (T2), only a terminal
        # goes out.
        first = tracer.start_span("execute_tool ask_colleague", attributes=TOOL_SPAN)
        second = tracer.start_span("execute_tool ask_colleague", attributes=TOOL_SPAN)
        s.hub.publish("the answer", task_id="t9", state="done", conversation_id=CONV)
        second.end()
        first.end()
        await s.emitter.flush(5)
        [orphan] = s.emitter.blocks(CONV)
        assert orphan["callId"] is None
        assert "traceId" not in orphan


C1 = "conv-trace"


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_the_relay_passes_a_trace_id_on_and_refuses_one_that_is_not() -> None:
    def traced(seq: int, trace_id: Any, **kw: Any) -> dict[str, Any]:
        return {**block(seq, **kw), "traceId": trace_id}

    hostile = [
        traced(2, '"><img src=x onerror=alert(1)>'),
        traced(3, TRACE.upper()),
        traced(4, "0" * 32),
        traced(5, TRACE[:-1]),
        traced(6, int(TRACE, 16)),
        traced(7, TRACE, call_id=None, state="done"),  # no callId, no traceId
    ]
    good = [traced(1, TRACE), block(8), traced(9, None)]
    async with relay_server() as (port, relay), browsers(port, C1) as (b,):
        async with worker(port) as w:
            ack = await w.call("kx_blocks", frame(C1, [good[0], *hostile, *good[1:]]), namespace=NS)
        assert ack["accepted"] == 3
        assert ack["refused"] == [{"index": i, "reason": "invalid"} for i in range(1, 7)]
        await barrier(b, port)
        assert b.blocks == good  # passed on as they came
        assert relay.stats()["rejected_invalid"] == 6


class _PublicContext:
    """A span context that is not the SDK's tuple: read through its properties."""

    def __init__(self, trace_id: object, flags: int) -> None:
        self.trace_id = trace_id
        self.trace_flags = TraceFlags(flags)


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        (SpanContext(0xABC, 0x1, False, TraceFlags(1)), 0xABC),
        (SpanContext(0xABC, 0x1, False, TraceFlags(0)), 0),  # not sampled
        (SpanContext(0xABC, 0x1, False, TraceFlags(3)), 0xABC),  # other flags set too
        (_PublicContext(0xABC, 1), 0xABC),
        (_PublicContext(0xABC, 0), 0),
        (_PublicContext("0xabc", 1), 0),  # not an int
        (_PublicContext(0, 1), 0),
        (None, 0),
        (object(), 0),
    ],
    ids=[
        "sdk-sampled",
        "sdk-unsampled",
        "sdk-flags",
        "public-sampled",
        "public-unsampled",
        "public-str",
        "public-zero",
        "none",
        "no-context",
    ],
)
def test_the_trace_id_of_a_span_context_is_its_id_when_sampled_else_0(
    context: object, expected: int
) -> None:
    assert sampled_trace_id(context) == expected


@pytest.mark.parametrize(
    ("trace_id", "expected"),
    [
        (1, "0" * 31 + "1"),
        (2**128 - 1, "f" * 32),
        (int(TRACE, 16), TRACE),
        (0, None),
        (-1, None),
        (2**128, None),
    ],
)
def test_trace_id_hex_is_32_lower_case_digits_of_a_valid_trace_id(
    trace_id: int, expected: str | None
) -> None:
    assert trace_id_hex(trace_id) == expected
