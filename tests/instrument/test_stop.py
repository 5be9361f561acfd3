"""Stopping one running tool call by its callId (issue 35, the worker's side):
:func:`kernel_ext.stop_call` on calls the instrumentor wraps — an async call's own execution
is cancelled and the wrapped call returns the stopped result, the turn and the other calls
go on; sync code sees ``stop_requested``; the pane ends with one ``aborted`` block that says
*stopped*; the span records the cancellation; a stop that crosses the call's end gives one
terminal and an answer that says which came first; bad input is refused and counted."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from support.attribution_helpers import pane_reads

import kernel_ext
from kernel_ext import ToolDescription, current_call_id, current_tool_call, publish, stop_call
from kernel_ext.attribution.tap import Tap
from kernel_ext.instrument import ToolRuntimeInstrumentor, ToolTarget, tool_call_scope
from kernel_ext.stop import (
    SO_FAR_MAX,
    STOPPED_MESSAGE,
    STOPPED_RESULT_LEAD,
    record_so_far,
    stop_counts,
    stopped_result,
)
from kernel_ext.testing import MemoryEmitter
from kernel_ext.worker import wiring

CONV = "conv-stop"
TARGETS = [
    f"{__name__}:{name}"
    for name in ("slow", "quick", "spin", "outer", "self_stopping", "steps", "shaped", "racing")
]

started: dict[str, asyncio.Event] = {}
ids: dict[str, str] = {}


async def slow(name: str, **kwargs: Any) -> str:
    """An async tool that says something, then waits until it is stopped."""
    call_id = current_call_id()
    assert call_id is not None
    ids[name] = call_id
    publish(f"{name} is thinking", task_id=call_id)
    started[name].set()
    await asyncio.Event().wait()
    return "never"


async def quick(name: str, gate: asyncio.Event, **kwargs: Any) -> str:
    """An async tool that answers once ``gate`` opens."""
    call_id = current_call_id()
    assert call_id is not None
    ids[name] = call_id
    publish(f"{name} is thinking", task_id=call_id)
    await gate.wait()
    return f"{name} answered"


def spin(name: str, ready: threading.Event, **kwargs: Any) -> str:
    """A sync tool that works in small steps and checks for a stop between them."""
    call = current_tool_call()
    assert call is not None
    ids[name] = call.call_id
    publish("step 1 of many", task_id=call.call_id)
    ready.set()
    for _ in range(60_000):
        if call.stop_requested:
            return "got through step 1"
        threading.Event().wait(0.001)
    return "never stopped"


async def outer(**kwargs: Any) -> str:
    """A tool whose call runs a nested one."""
    call_id = current_call_id()
    assert call_id is not None
    ids["outer"] = call_id
    return await slow("inner", tool_name="slow")


def self_stopping(answer: str, **kwargs: Any) -> str:
    """A sync tool that publishes, then is stopped just before it returns (the race)."""
    call_id = current_call_id()
    assert call_id is not None
    ids["self"] = call_id
    publish("working", task_id=call_id)
    answers.append(stop_call(call_id))
    return answer


answers: list[str] = []


def racing(gate: threading.Barrier, pause: float, **kwargs: Any) -> str:
    """A sync tool that says something, then returns ``pause`` seconds after the stopper is
    let go (varied so that across runs either side may come first; nothing waits on it)."""
    call_id = current_call_id()
    assert call_id is not None
    ids["race"] = call_id
    publish("racing", task_id=call_id)
    gate.wait(10)
    if pause:
        threading.Event().wait(pause)
    return "finished first"


def steps(**kwargs: Any) -> Iterator[str]:
    """A generator tool, stopped between two of its values."""
    call_id = current_call_id()
    assert call_id is not None
    ids["steps"] = call_id
    publish("stepping", task_id=call_id)
    yield "one"
    yield "two"


async def shaped(name: str, **kwargs: Any) -> str:
    """An async tool whose runtime shapes a stopped result (the describe hook's stopped_as)."""
    return await slow(name, tool_name="slow")


@pytest.fixture(autouse=True)
def _always_disable() -> Iterator[None]:
    yield
    wiring.disable(timeout=2)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def emitter(exporter: InMemorySpanExporter) -> AsyncIterator[MemoryEmitter]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    memory = MemoryEmitter()
    kernel_ext.enable(
        emitter=memory, tracer_provider=provider, targets=TARGETS, tap=Tap(), handle_sigterm=False
    )
    started.clear()
    ids.clear()
    answers.clear()
    try:
        yield memory
    finally:
        await kernel_ext.adisable()
        provider.shutdown()


async def terminals(emitter: MemoryEmitter, call_id: str, count: int) -> list[dict[str, Any]]:
    """The blocks of ``call_id`` once ``count`` of them were sent; exactly one terminal."""
    await emitter.wait_for(
        lambda records: sum(b["callId"] == call_id for b in emitter.blocks(CONV)) >= count
    )
    await emitter.flush(2)
    mine = [b for b in emitter.blocks(CONV) if b["callId"] == call_id]
    assert sum(b["state"] != "running" for b in mine) == 1, mine
    assert mine[-1]["state"] != "running"
    return mine


async def test_an_async_call_is_stopped_and_the_turn_and_the_other_call_go_on(
    emitter: MemoryEmitter, exporter: InMemorySpanExporter
) -> None:
    started["a"] = asyncio.Event()
    gate = asyncio.Event()

    async def turn() -> list[str]:
        results = await asyncio.gather(
            slow("a", tool_name="slow", conversation_id=CONV),
            quick("b", gate, tool_name="quick", conversation_id=CONV),
        )
        await asyncio.sleep(0)  # the turn's own task was not left cancelled
        return results

    task = asyncio.create_task(turn())
    await started["a"].wait()
    assert stop_call(ids["a"], reason="wrong question") == "stopping"
    assert stop_call(ids["a"]) in ("stopping", "already_ended")  # a second click: harmless
    gate.set()
    stopped, other = await asyncio.wait_for(task, 10)
    assert stopped == stopped_result("a is thinking") or stopped == stopped_result()
    assert stopped.startswith("The user stopped this tool call")
    assert other == "b answered"
    assert not task.cancelled()

    blocks = await terminals(emitter, ids["a"], 2)
    assert (blocks[-1]["state"], blocks[-1]["envelope"]["payload"]) == (
        "aborted",
        {"message": STOPPED_MESSAGE, "stopped": True},
    )
    assert pane_reads(blocks, ids["a"]) == ("ended", "stopped", STOPPED_MESSAGE)
    others = await terminals(emitter, ids["b"], 2)
    # Its own stream, left open, ends as a returned call's does: not stopped.
    assert others[-1]["envelope"]["payload"] == {
        "message": "the tool call ended before its stream did"
    }
    assert stop_call(ids["a"]) == "already_ended"

    [span] = [s for s in exporter.get_finished_spans() if s.name == "execute_tool slow"]
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == STOPPED_MESSAGE
    assert span.attributes is not None
    assert span.attributes["error.type"] == "cancelled"
    [other_span] = [s for s in exporter.get_finished_spans() if s.name == "execute_tool quick"]
    assert other_span.status.status_code is not StatusCode.ERROR


async def test_a_tool_awaited_in_the_turns_own_task_leaves_the_task_uncancelled(
    emitter: MemoryEmitter,
) -> None:
    started["a"] = asyncio.Event()

    async def turn() -> tuple[str, str]:
        result = await slow("a", tool_name="slow", conversation_id=CONV)
        this = asyncio.current_task()
        assert this is not None
        if sys.version_info >= (3, 11):  # the stop's cancellation undone (Task.uncancel)
            assert this.cancelling() == 0
        await asyncio.sleep(0.01)
        return result, "the turn went on"

    task = asyncio.create_task(turn())
    await started["a"].wait()
    assert stop_call(ids["a"]) == "stopping"
    result, after = await asyncio.wait_for(task, 10)
    assert result.startswith("The user stopped this tool call")
    assert after == "the turn went on"


async def test_a_cancellation_that_is_not_the_stops_still_propagates(
    emitter: MemoryEmitter,
) -> None:
    started["a"] = asyncio.Event()
    task = asyncio.create_task(slow("a", tool_name="slow", conversation_id=CONV))
    await started["a"].wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    blocks = await terminals(emitter, ids["a"], 2)
    assert "stopped" not in blocks[-1]["envelope"]["payload"]
    assert stop_call(ids["a"]) == "already_ended"


async def test_a_sync_call_sees_stop_requested_and_its_words_reach_the_model(
    emitter: MemoryEmitter,
) -> None:
    ready = threading.Event()
    work = asyncio.create_task(
        asyncio.to_thread(spin, "s", ready, tool_name="spin", conversation_id=CONV)
    )
    await asyncio.to_thread(ready.wait, 10)
    assert stop_call(ids["s"]) == "stopping"
    result = await asyncio.wait_for(work, 10)
    assert result == stopped_result("got through step 1")
    assert "got through step 1" in result
    blocks = await terminals(emitter, ids["s"], 2)
    assert blocks[-1]["envelope"]["payload"] == {"message": STOPPED_MESSAGE, "stopped": True}


async def test_stopping_a_call_stops_the_call_it_is_waiting_on(emitter: MemoryEmitter) -> None:
    started["inner"] = asyncio.Event()
    task = asyncio.create_task(outer(tool_name="outer", conversation_id=CONV))
    await started["inner"].wait()
    assert stop_call(ids["outer"]) == "stopping"
    result = await asyncio.wait_for(task, 10)
    assert result.startswith("The user stopped this tool call")
    inner = await terminals(emitter, ids["inner"], 2)
    assert inner[-1]["state"] == "aborted"  # cancelled with the call that started it
    assert stop_call(ids["inner"]) == "already_ended"


async def test_a_stop_that_comes_first_wins_the_race_with_the_calls_end(
    emitter: MemoryEmitter,
) -> None:
    result = self_stopping("the real answer", tool_name="self_stopping", conversation_id=CONV)
    assert answers == ["stopping"]
    assert result == stopped_result("the real answer")
    blocks = await terminals(emitter, ids["self"], 2)
    assert blocks[-1]["envelope"]["payload"] == {"message": STOPPED_MESSAGE, "stopped": True}


async def test_a_stop_after_the_calls_end_changes_nothing(emitter: MemoryEmitter) -> None:
    gate = asyncio.Event()
    gate.set()
    assert await quick("b", gate, tool_name="quick", conversation_id=CONV) == "b answered"
    assert stop_call(ids["b"]) == "already_ended"
    blocks = await terminals(emitter, ids["b"], 2)
    assert blocks[-1]["envelope"]["payload"] == {
        "message": "the tool call ended before its stream did"
    }


async def test_a_generator_tools_values_pass_unchanged_and_its_pane_reads_stopped(
    emitter: MemoryEmitter,
) -> None:
    values = steps(tool_name="steps", conversation_id=CONV)
    assert next(values) == "one"
    assert stop_call(ids["steps"]) == "stopping"
    assert list(values) == ["two"]
    blocks = await terminals(emitter, ids["steps"], 2)
    assert blocks[-1]["envelope"]["payload"] == {"message": STOPPED_MESSAGE, "stopped": True}


def test_a_tool_call_scope_is_stoppable_as_sync_code_is() -> None:
    provider = TracerProvider()
    with tool_call_scope(ToolDescription("scoped", CONV), tracer_provider=provider) as call:
        assert call is not None
        assert not call.stop_requested
        assert stop_call(call.call_id) == "stopping"
        assert call.stop_requested
        assert current_tool_call() is call
    assert stop_call(call.call_id) == "already_ended"
    provider.shutdown()


def test_a_nested_call_sees_the_stop_of_the_call_it_runs_in() -> None:
    provider = TracerProvider()
    with (
        tool_call_scope(ToolDescription("outer", CONV), tracer_provider=provider) as outer,
        tool_call_scope(ToolDescription("inner", CONV), tracer_provider=provider) as inner,
    ):
        assert outer is not None
        assert inner is not None
        assert inner.parent == outer
        assert stop_call(outer.call_id) == "stopping"
        assert inner.stop_requested  # what the call started stops with it
        assert not inner.life.stop_requested  # the inner call itself was not stopped
    provider.shutdown()


def test_the_stopped_result_carries_at_most_so_far_max_characters_of_what_was_said() -> None:
    assert stopped_result() == stopped_result("  ") == stopped_result(7)
    assert stopped_result().endswith("It had no result yet.")
    long = "x" * (SO_FAR_MAX + 10)
    text = stopped_result(long)
    assert text.endswith("x" * SO_FAR_MAX + "…[truncated 10 chars]")
    assert "\ud800" not in stopped_result("a \ud800 b")  # well-formed for the model's API


@pytest.mark.parametrize("so_far", [None, "", "   ", "said", "x" * (SO_FAR_MAX + 1), 7])
def test_every_stopped_result_begins_with_the_lead_sentence(so_far: object) -> None:
    text = stopped_result(so_far)
    assert text.startswith(STOPPED_RESULT_LEAD)
    assert STOPPED_RESULT_LEAD.endswith(".")
    assert text[len(STOPPED_RESULT_LEAD)] == " "  # a sentence of its own


def test_record_so_far_outside_a_call_is_a_no_op() -> None:
    record_so_far("nothing to attach it to")  # no call: nothing happens, nothing raises


@pytest.mark.parametrize("fails", [False, True], ids=["shaped", "hook-fails"])
async def test_a_targets_stopped_as_shapes_the_stopped_result(fails: bool) -> None:
    def shape(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any], text: str) -> Any:
        if fails:
            raise RuntimeError("cannot shape")
        return {"role": "tool", "for": args[0], "content": text}

    provider = TracerProvider()
    instrumentor = ToolRuntimeInstrumentor()
    instrumentor.instrument(
        tracer_provider=provider,
        targets=[ToolTarget(f"{__name__}:shaped", stopped_as=shape)],
    )
    started["s"] = asyncio.Event()
    try:
        task = asyncio.create_task(shaped("s", tool_name="shaped", conversation_id=CONV))
        await asyncio.wait_for(started["s"].wait(), 10)
        assert stop_call(ids["s"]) == "stopping"
        result = await asyncio.wait_for(task, 10)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    text = stopped_result()  # slow published, but recorded nothing so far
    assert result == (text if fails else {"role": "tool", "for": "s", "content": text})


async def test_a_stop_crossing_the_calls_end_gives_one_terminal_and_an_answer_that_matches(
    emitter: MemoryEmitter,
) -> None:
    """The stop from another thread and the call's own end, let go at once, many times: each
    time exactly one terminal, stopped if and only if the answer was ``stopping``, and the
    model's result says so too."""
    outcomes: list[tuple[str, str, object]] = []
    for run in range(60):
        gate = threading.Barrier(2)
        answer: list[str] = []

        def stopper(gate: threading.Barrier = gate, answer: list[str] = answer) -> None:
            gate.wait(10)
            answer.append(stop_call(ids["race"]))

        thread = threading.Thread(target=stopper)
        thread.start()
        pause = (run % 4) * 0.002
        result = await asyncio.to_thread(
            racing, gate, pause, tool_name="racing", conversation_id=CONV
        )
        thread.join(10)
        outcomes.append((ids["race"], answer[0], result))
    await emitter.wait_for(lambda records: len(records) >= 2 * len(outcomes))
    await emitter.flush(2)
    for call_id, answer, result in outcomes:
        ends = [
            b for b in emitter.blocks(CONV) if b["callId"] == call_id and b["state"] != "running"
        ]
        assert len(ends) == 1
        stopped = ends[0]["envelope"]["payload"].get("stopped") is True
        assert answer in ("stopping", "already_ended")
        assert stopped == (answer == "stopping")
        assert (result == stopped_result("finished first")) == stopped
        assert (result == "finished first") == (not stopped)


def test_a_forked_child_does_not_take_the_running_calls_along() -> None:
    provider = TracerProvider()
    with tool_call_scope(ToolDescription("forked", CONV), tracer_provider=provider) as call:
        assert call is not None
        pid = os.fork()
        if pid == 0:  # the child: the call runs on in the parent, not here
            os._exit(0 if stop_call(call.call_id) == "unknown" else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not call.stop_requested  # the child's answer touched nothing here
        assert stop_call(call.call_id) == "stopping"
    provider.shutdown()


@pytest.mark.parametrize(
    "bad",
    [None, 12, b"00000000000000a1", "0" * 15, "0" * 17, "A" * 16, "\ud800" * 16, "0" * 10_000_000],
    ids=["none", "int", "bytes", "short", "long", "upper", "surrogates", "huge"],
)
def test_a_malformed_call_id_is_refused_and_counted(bad: object) -> None:
    before = stop_counts().get("refused", 0)
    assert stop_call(bad) == "refused"
    assert stop_counts()["refused"] == before + 1


def test_a_call_id_of_no_running_call_is_unknown_and_counted() -> None:
    before = stop_counts().get("unknown", 0)
    assert stop_call("00000000000000a1") == "unknown"
    assert stop_counts()["unknown"] == before + 1


def test_a_call_set_by_hand_is_not_on_the_convergence_path_and_cannot_be_stopped() -> None:
    with kernel_ext.use_tool_call(kernel_ext.ToolCall("00000000000000b2", "hand")) as call:
        assert stop_call("00000000000000b2") == "unknown"
        assert call is not None
        assert not call.stop_requested


@pytest.mark.parametrize("stopped_first", [False, True], ids=["returned", "stopped"])
def test_the_last_recent_ends_ended_calls_are_remembered_and_no_more(stopped_first: bool) -> None:
    """``already_ended`` for a call with at most RECENT_ENDS - 1 calls ended after it (it is
    among the last RECENT_ENDS), ``unknown`` once RECENT_ENDS calls ended after it."""
    from kernel_ext.stop import RECENT_ENDS

    assert RECENT_ENDS == 512  # as docs/tool-authors.md says
    provider = TracerProvider()

    def one_call() -> str:
        with tool_call_scope(ToolDescription("brief", CONV), tracer_provider=provider) as call:
            assert call is not None
            return call.call_id

    with tool_call_scope(ToolDescription("first", CONV), tracer_provider=provider) as first:
        assert first is not None
        if stopped_first:
            assert stop_call(first.call_id) == "stopping"
            assert stop_call(first.call_id) == "stopping"  # still running: said again
    for _ in range(RECENT_ENDS - 1):
        one_call()
    assert stop_call(first.call_id) == "already_ended"
    one_call()
    assert stop_call(first.call_id) == "unknown"
    provider.shutdown()
