"""The AG-UI bridge's edges in one process: a real hub and bridge, a run's events given by
the test (no server; tests/integrations/test_ag_ui.py has the real server and client)."""

from __future__ import annotations

import pytest

pytest.importorskip("ag_ui.core", reason="the agui extra (ag-ui-protocol) is not installed")

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import jsonpatch
from ag_ui.core import (
    BaseEvent,
    EventType,
    RunErrorEvent,
    RunFinishedEvent,
    RunStartedEvent,
    ToolCallResultEvent,
)
from ag_ui.encoder import EventEncoder
from opentelemetry.sdk.trace import TracerProvider
from support.timing import CALL_TIMEOUT, FakeClock, wait_until

from kernel_ext import ToolCall, ToolDescription, use_tool_call
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.instrument import tool_call_scope
from kernel_ext.integrations.ag_ui import (
    NO_TOOL_CALL_ID,
    RUN_ENDED_OPEN,
    RUN_LIMIT,
    SURROGATES_REPLACED,
    AGUIBridge,
    message_id_of,
    subagent_run_id_of,
)
from kernel_ext.stream import StreamHub

CALL = "00000000000000a1"
TASK = "colleague-task-1"


class Run:
    """One run's own events, released by the test step by step."""

    def __init__(self, thread_id: str = "t1") -> None:
        self.thread_id = thread_id
        self.steps: asyncio.Queue[BaseEvent | Exception | None] = asyncio.Queue()

    async def events(self) -> AsyncIterator[BaseEvent]:
        while (step := await self.steps.get()) is not None:
            if isinstance(step, Exception):
                raise step
            yield step

    def start(self) -> None:
        self.steps.put_nowait(RunStartedEvent(thread_id=self.thread_id, run_id="r1"))

    def finish(self) -> None:
        self.steps.put_nowait(RunFinishedEvent(thread_id=self.thread_id, run_id="r1"))
        self.steps.put_nowait(None)


async def collect(bridge: AGUIBridge, run: Run, into: list[BaseEvent]) -> None:
    async for event in bridge.stream(run.thread_id, run.events()):
        into.append(event)


@pytest.fixture
async def bridge() -> AsyncIterator[AGUIBridge]:
    tap = Tap()
    tap.add(LiveCall(CALL, "ask_colleague", "t1", "llm-1"))
    bridge = AGUIBridge(hub=StreamHub(tap=tap), tap=tap, run_end_timeout=1.0)
    await bridge.start()
    yield bridge
    await bridge.stop()


def publish(bridge: AGUIBridge, text: str, *, call: str = CALL, **kwargs: object) -> None:
    with use_tool_call(ToolCall(call, "ask_colleague", "t1", "llm-1")):
        bridge.hub.publish(text, **kwargs)  # type: ignore[arg-type]


async def started(bridge: AGUIBridge, run: Run) -> tuple[Run, list[BaseEvent], asyncio.Task[None]]:
    """``run`` streamed through ``bridge`` in a task of its own, once its RUN_STARTED is out:
    the run, what it sent so far, the task."""
    got: list[BaseEvent] = []
    task = asyncio.create_task(collect(bridge, run, got))
    run.start()
    await wait_until(lambda: bridge.runs == 1 and got, 5, "run not started")
    return run, got, task


async def finish_after(
    run: Run, got: list[BaseEvent], n: int, task: asyncio.Task[None]
) -> list[str]:
    """Finish ``run`` once it has sent ``n`` events; the types of all it sent."""
    await wait_until(lambda: len(got) >= n, 5, f"fewer than {n} events sent")
    run.finish()
    await asyncio.wait_for(task, CALL_TIMEOUT)
    return types(got)


def types(events: list[BaseEvent]) -> list[str]:
    return [str(event.type.value) for event in events]


def delivered(bridge: AGUIBridge, n: int) -> Callable[[], bool]:
    return lambda: bridge.hub.stats()["delivered"] >= n


async def test_pane_events_wait_for_run_started_and_an_open_colleague_is_ended_once_at_run_end(
    bridge: AGUIBridge,
) -> None:
    run, got = Run(), []
    task = asyncio.create_task(collect(bridge, run, got))
    await wait_until(lambda: bridge.runs == 1, 5, "run not registered")
    publish(bridge, "thinking about it", task_id=TASK)
    await wait_until(delivered(bridge, 1), 5, "block not taken")
    run.start()
    assert await finish_after(run, got, 3, task) == [
        "RUN_STARTED",
        "SUBAGENT_STARTED",
        "ACTIVITY_SNAPSHOT",
        "SUBAGENT_ERROR",
        "RUN_FINISHED",
    ]
    started, snapshot, error = got[1], got[2], got[3]
    assert started.subagent_run_id == subagent_run_id_of(CALL, TASK)  # type: ignore[attr-defined]
    assert started.parent_tool_call_id == "llm-1"  # type: ignore[attr-defined]
    assert snapshot.message_id == message_id_of(CALL)  # type: ignore[attr-defined]
    assert snapshot.content["toolCallId"] == "llm-1"  # type: ignore[attr-defined]
    assert error.subagent_run_id == started.subagent_run_id  # type: ignore[attr-defined]
    assert bridge.counts[RUN_ENDED_OPEN] == 1
    assert bridge.runs == 0


async def test_a_colleague_that_ends_is_finished_once_after_the_delta_that_shows_it(
    bridge: AGUIBridge,
) -> None:
    run, got, task = await started(bridge, Run())
    publish(bridge, "working", task_id=TASK)
    await wait_until(lambda: len(got) >= 3, 5, "pane not sent")
    publish(bridge, "the answer", task_id=TASK, state="done")
    publish(bridge, "again", task_id=TASK, state="done")  # dropped by the hub
    assert await finish_after(run, got, 5, task) == [
        "RUN_STARTED",
        "SUBAGENT_STARTED",
        "ACTIVITY_SNAPSHOT",
        "ACTIVITY_DELTA",
        "SUBAGENT_FINISHED",
        "RUN_FINISHED",
    ]
    assert got[4].result == "the answer"  # type: ignore[attr-defined]
    assert bridge.counts[RUN_ENDED_OPEN] == 0


async def test_blocks_of_a_thread_with_no_run_reach_no_run_and_are_counted(
    bridge: AGUIBridge,
) -> None:
    run, got, task = await started(bridge, Run("other-thread"))
    publish(bridge, "for t1 only")
    await wait_until(lambda: bridge.hub.stats()["no_listener"] == 1, 5, "not counted")
    run.finish()
    await asyncio.wait_for(task, CALL_TIMEOUT)
    assert types(got) == ["RUN_STARTED", "RUN_FINISHED"]


async def test_a_call_unknown_to_the_tap_gets_a_pane_without_tool_call_id_counted(
    bridge: AGUIBridge,
) -> None:
    run, got, task = await started(bridge, Run())
    publish(bridge, "late", call="00000000000000b2", task_id=TASK)
    await finish_after(run, got, 3, task)
    assert got[1].parent_tool_call_id is None  # type: ignore[attr-defined]
    assert got[2].content["toolCallId"] is None  # type: ignore[attr-defined]
    assert bridge.counts[NO_TOOL_CALL_ID] == 1


ENDED_TTL = 60.0


@pytest.mark.parametrize(
    ("since_end", "tool_call_id"),
    [(0.0, "llm-quick"), (ENDED_TTL - 0.001, "llm-quick"), (ENDED_TTL, None)],
    ids=["at-once", "just-within-ended-ttl", "at-ended-ttl"],
)
async def test_a_quick_call_that_ended_before_the_bridge_took_its_blocks_keeps_its_tool_call_id(
    since_end: float, tool_call_id: str | None
) -> None:
    """A tool that publishes and returns without giving the event loop a turn: its call has
    ended (left the tap's live calls) when the bridge takes its first block. Its pane and
    its colleague still carry the model's tool-call id, until ``ended_ttl`` seconds after
    its end; from then on ``null``, counted."""
    clock = FakeClock()
    tap = Tap(ended_ttl=ENDED_TTL, clock=clock)
    hub = StreamHub(tap=tap)
    provider = TracerProvider()
    provider.add_span_processor(ToolSpanProcessor(tap=tap, sink=hub))
    bridge = AGUIBridge(hub=hub, tap=tap, run_end_timeout=1.0)
    await bridge.start()
    try:
        run, got, task = await started(bridge, Run())
        # The quick tool, with no await: the bridge gets no turn until it has returned.
        description = ToolDescription("ask_colleague", "t1", "llm-quick")
        with tool_call_scope(description, tracer_provider=provider, sink=hub) as call:
            assert call is not None
            hub.publish("the answer at once", task_id=TASK, state="done")
        assert tap.get(call.call_id) is None  # ended: not live any more
        clock.advance(since_end)
        assert await finish_after(run, got, 4, task) == [
            "RUN_STARTED",
            "SUBAGENT_STARTED",
            "ACTIVITY_SNAPSHOT",
            "SUBAGENT_FINISHED",
            "RUN_FINISHED",
        ]
        assert got[1].parent_tool_call_id == tool_call_id  # type: ignore[attr-defined]
        assert got[2].message_id == message_id_of(call.call_id)  # type: ignore[attr-defined]
        assert got[2].content["toolCallId"] == tool_call_id  # type: ignore[attr-defined]
        assert bridge.counts[NO_TOOL_CALL_ID] == (1 if tool_call_id is None else 0)
    finally:
        await bridge.stop()
        provider.shutdown()


async def test_a_run_past_max_runs_gets_no_panes_and_is_counted() -> None:
    tap = Tap()
    bridge = AGUIBridge(hub=StreamHub(tap=tap), tap=tap, max_runs=1)
    await bridge.start()
    try:
        first, second, got_first, got_second = Run(), Run(), [], []
        tasks = [
            asyncio.create_task(collect(bridge, first, got_first)),
            asyncio.create_task(collect(bridge, second, got_second)),
        ]
        first.start()
        second.start()
        await wait_until(lambda: got_first and got_second, 5, "runs not started")
        assert bridge.runs == 1
        assert bridge.counts[RUN_LIMIT] == 1
        publish(bridge, "x")
        await wait_until(lambda: len(got_first) >= 2, 5, "pane not sent")
        first.finish()
        second.finish()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert types(got_second) == ["RUN_STARTED", "RUN_FINISHED"]
    finally:
        await bridge.stop()


async def test_the_agents_error_reaches_the_caller_and_the_run_is_released(
    bridge: AGUIBridge,
) -> None:
    run, got = Run(), []
    run.start()
    run.steps.put_nowait(RuntimeError("the model failed"))
    with pytest.raises(RuntimeError, match="the model failed"):
        await asyncio.wait_for(collect(bridge, run, got), 5)
    assert types(got) == ["RUN_STARTED"]
    assert bridge.runs == 0


async def test_a_run_error_closes_open_colleagues_before_it(bridge: AGUIBridge) -> None:
    run, got, task = await started(bridge, Run())
    publish(bridge, "working", task_id=TASK)
    await wait_until(lambda: len(got) >= 3, 5, "pane not sent")
    run.steps.put_nowait(RunErrorEvent(message="boom"))
    run.steps.put_nowait(None)
    await asyncio.wait_for(task, CALL_TIMEOUT)
    assert types(got)[-2:] == ["SUBAGENT_ERROR", "RUN_ERROR"]
    assert got[-1].type == EventType.RUN_ERROR


async def test_every_event_is_encodable_each_lone_surrogate_replaced_and_each_input_counted_once(
    bridge: AGUIBridge,
) -> None:
    # AG-UI's encoder (pydantic's JSON) refuses a lone surrogate; a block may hold one.
    run, got, task = await started(bridge, Run())
    tool = {"toolCall": {"functionCall": {"name": "ask\ud800"}}}
    bridge.hub.publish_chat_event(
        {"eventId": CALL, "eventScene": "tool", "content": tool}, conversation_id="t1"
    )
    publish(bridge, "a \udc00 b", task_id=TASK)
    publish(bridge, "nothing to replace", task_id="other-task")
    publish(bridge, "done \ud800", task_id=TASK, state="done")
    await wait_until(lambda: "SUBAGENT_FINISHED" in types(got), 5, "colleague not finished")
    run.steps.put_nowait(
        ToolCallResultEvent(message_id="m1", tool_call_id="llm-1", content="result \ud800")
    )
    await finish_after(run, got, len(got) + 1, task)
    encoder = EventEncoder()
    sent = [json.loads(encoder.encode(event).removeprefix("data: ")) for event in got]
    pane: dict[str, Any] = {}
    for event in sent:
        if event["type"] == "ACTIVITY_SNAPSHOT":
            pane = event["content"]
        elif event["type"] == "ACTIVITY_DELTA":
            pane = jsonpatch.apply_patch(pane, event["patch"])
    assert pane["tool"] == "ask\ufffd"
    items = {t["taskId"]: [i["text"] for i in t["items"]] for t in pane["tasks"]}
    assert items == {TASK: ["a \ufffd b"], "other-task": ["nothing to replace"]}
    assert pane["final"]["text"] == "done \ufffd"
    [finished] = [e for e in sent if e["type"] == "SUBAGENT_FINISHED"]
    assert finished["result"] == "done \ufffd"
    [result] = [e for e in sent if e["type"] == "TOOL_CALL_RESULT"]
    assert result["content"] == "result \ufffd"
    # The snapshot, two blocks and the run's own event: once each, whatever was sent after.
    assert bridge.counts[SURROGATES_REPLACED] == 4
