"""The A2A tests' shared helpers: a recording test double of ``publish``, hand-built A2A
events, a real colleague (kernel_ext.testing.a2a_peer's a2a-sdk server under uvicorn on 127.0.0.1)
and a pane (the real StreamHub and a MemoryEmitter), for tests/a2a/."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from a2a.types import (
    Message,
    Part,
    Role,
    StreamResponse,
    Task,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)

from kernel_ext.a2a import (
    A2AStreamAdapter,
    stream_colleague,
)
from kernel_ext.attribution.tap import LiveCall
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.protocol import Envelope, decode
from kernel_ext.stream import StreamHub
from kernel_ext.testing import MemoryEmitter
from kernel_ext.testing.a2a_peer import SCRIPT_KEY, ScriptedPeer
from support.timing import FakeClock, wait_until

# -- a recording test double of kernel_ext.stream.publish ---------------------------------


@dataclass(frozen=True)
class Published:
    item: Any
    task_id: str | None
    state: str
    conversation_id: str | None
    tool_name: str
    provisional: bool = False

    @property
    def envelope(self) -> Envelope:
        assert isinstance(self.item, Envelope)
        return self.item


class RecordingPublisher:
    """Test double of ``publish``: records every call; ``wait_for`` polls with a deadline."""

    def __init__(self, *, fail: bool = False) -> None:
        self.calls: list[Published] = []
        self.fail = fail
        self._changed = asyncio.Event()

    def __call__(
        self,
        item: Any,
        *,
        task_id: str | None = None,
        state: str = "running",
        conversation_id: str | None = None,
        tool_name: str = "ask_colleague",
        provisional: bool = False,
    ) -> None:
        self.calls.append(Published(item, task_id, state, conversation_id, tool_name, provisional))
        self._changed.set()
        if self.fail:
            raise RuntimeError("publisher double told to fail")

    def terminals(self, task_id: str | None = ...) -> list[Published]:  # type: ignore[assignment]
        """Terminal publishes (provisional ones are not terminals yet)."""
        return [
            c
            for c in self.calls
            if c.state != "running"
            and not c.provisional
            and (task_id is ... or c.task_id == task_id)
        ]

    def provisionals(self) -> list[Published]:
        return [c for c in self.calls if c.provisional]

    def running(self) -> list[Published]:
        return [c for c in self.calls if c.state == "running"]

    async def wait_for(
        self, predicate: Callable[[list[Published]], bool], timeout: float = 10
    ) -> None:
        await wait_until(
            lambda: predicate(self.calls),
            timeout,
            lambda: f"condition not met; calls: {self.calls}",
            wake=self._changed,
        )


# -- hand-built A2A events for the adapter's unit tests ------------------------------------

TASK = "task-1"
CTX = "ctx-1"


def _task_event(task_id: str = TASK, state: int = TaskState.TASK_STATE_SUBMITTED) -> StreamResponse:
    return StreamResponse(task=Task(id=task_id, context_id=CTX, status=TaskStatus(state=state)))


def _status(state: int, parts: list[Part] | None = None, task_id: str = TASK) -> StreamResponse:
    status = TaskStatus(state=state)
    if parts is not None:
        status.message.CopyFrom(
            Message(
                role=Role.ROLE_AGENT, message_id="m", task_id=task_id, context_id=CTX, parts=parts
            )
        )
    return StreamResponse(
        status_update=TaskStatusUpdateEvent(task_id=task_id, context_id=CTX, status=status)
    )


def _envelope(seq: Any = 1, **extra: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "kind": "thinking",
        "streamKey": TASK,
        "seq": seq,
        "status": "running",
        "payload": {"text": "hm"},
    } | extra


WORKING = TaskState.TASK_STATE_WORKING
COMPLETED = TaskState.TASK_STATE_COMPLETED


def _adapter(publisher: RecordingPublisher) -> A2AStreamAdapter:
    return A2AStreamAdapter(publisher, conversation_id="conv-1", tool_name="ask_colleague")


# -- end to end: real peer, real client, recording publisher --------------------------------


@dataclass
class Colleague:
    url: str
    peer: ScriptedPeer


async def _ask(
    colleague: Colleague, script: str, publisher: RecordingPublisher, **kwargs: Any
) -> Any:
    meta: Mapping[str, Any] = {SCRIPT_KEY: script, **kwargs.pop("metadata", {})}
    return await stream_colleague(
        colleague.url, f"where is order 42 ({script})?", metadata=meta, publish=publisher, **kwargs
    )


def _one_terminal(publisher: RecordingPublisher) -> Published:
    [terminal] = publisher.terminals()
    assert publisher.calls[-1] is terminal
    return terminal


# -- end to end through the real StreamHub and a MemoryEmitter ------------------------------

CALL_A = "00f067aa0ba902b7"
CALL_B = "5b8aa5a2d2c872e8"
CONV = "conv-a2a"


@dataclass
class Pane:
    hub: StreamHub
    emitter: MemoryEmitter
    clock: FakeClock

    def blocks(self, call_id: str | None = None) -> list[dict[str, Any]]:
        return [b for b in self.emitter.blocks(CONV) if call_id is None or b["callId"] == call_id]

    async def wait_terminals(self, n: int = 1) -> None:
        await self.emitter.wait_for(
            lambda records: sum(b["state"] != "running" for _, b in records) >= n, timeout=10
        )


def _in_call(call_id: str) -> Any:
    return use_tool_call(ToolCall(call_id, "ask_colleague", CONV))


def _check_stream(
    blocks: list[dict[str, Any]], call_id: str, task_id: str | None
) -> dict[str, Any]:
    """Every block valid on the wire, attributed to the call, ordered by seq, one terminal last."""
    assert blocks, "no blocks"
    for block in blocks:
        decode(block)
        assert (block["callId"], block["taskId"]) == (call_id, task_id or call_id)
    running = [b["envelope"]["seq"] for b in blocks if b["state"] == "running"]
    assert running == sorted(set(running))
    terminals = [b for b in blocks if b["state"] != "running"]
    assert len(terminals) == 1
    assert blocks[-1] is terminals[0]
    return terminals[0]


def _ended(pane: Pane, call_id: str) -> None:
    """The tool call ends (what the instrumented runtime or the span processor tells)."""
    pane.hub.tool_call_ended(LiveCall(call_id, "ask_colleague", CONV), None)
