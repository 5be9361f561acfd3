"""A scripted A2A colleague: a real a2a-sdk streaming server for tests and the demo.

(A documented entry point, ``python -m kernel_ext.testing.a2a_peer``; about 530 lines because each
fault script is a few lines of its own.)

The colleague thinks, calls its own tools, writes text and completes, sending each step
as a ``working`` status update whose message holds the step's *envelope* in a data part
(``a2a.helpers.new_data_part``), followed by a plain text part for peers that read text
only (docs/a2a.md). Variants, chosen per request, fail, get cancelled, send text only,
send malformed envelopes, flood, hang, crash, or ask for input.

Three more variants cannot be produced through the SDK, which refuses any update after a
terminal state and always ends its streams cleanly. The :class:`FaultInjectingEndpoint`
answers those requests itself with raw JSON-RPC over SSE, in front of the real SDK
endpoint: ``repeat-completed`` (two ``completed`` updates and a ``working`` after them),
``close-early`` (the stream ends without a terminal state) and ``disconnect`` (the
connection is dropped mid-stream, an incomplete chunked body).

Choosing a script: the message metadata key :data:`SCRIPT_KEY` (``"kx.script"``), else a
leading ``script:<name>`` word in the message text, else ``work``. Per-request knobs in
the metadata: :data:`DELAY_KEY` (seconds between steps), :data:`COUNT_KEY` and
:data:`RATE_KEY` (flood size and updates per second).

Run it standalone for the demo::

    python -m kernel_ext.testing.a2a_peer --port 8765 --delay 0.5

Guarantees: binds 127.0.0.1 unless told otherwise; :meth:`ScriptedPeer.aclose` ends
every execution still running (``hang`` included), so nothing is left pending.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from a2a.helpers import new_data_part, new_task_from_user_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

__all__ = [
    "COUNT_KEY",
    "DELAY_KEY",
    "FAULT_SCRIPTS",
    "RATE_KEY",
    "SCRIPTS",
    "SCRIPT_KEY",
    "FaultInjectingEndpoint",
    "ScriptedColleague",
    "ScriptedPeer",
    "build_agent_card",
    "main",
    "script_of",
]

logger = logging.getLogger(__name__)

SCRIPT_KEY = "kx.script"
DELAY_KEY = "kx.delay"
COUNT_KEY = "kx.count"
RATE_KEY = "kx.rate"

SCRIPTS: frozenset[str] = frozenset(
    {
        "work",
        "fail",
        "cancel",
        "reject",
        "text",
        "malformed",
        "flood",
        "hang",
        "artifact",
        "input",
        "crash",
    }
)
"""Scripts played by the real SDK executor."""

FAULT_SCRIPTS: frozenset[str] = frozenset({"repeat-completed", "close-early", "disconnect"})
"""Scripts answered by :class:`FaultInjectingEndpoint` with raw JSON-RPC/SSE."""

_WORKING = TaskState.TASK_STATE_WORKING


def _metadata(message: Message | None) -> dict[str, Any]:
    if message is None or not message.HasField("metadata"):
        return {}
    data = json_format.MessageToDict(message.metadata)
    return data if isinstance(data, dict) else {}


def script_of(message: Message | None, request_metadata: Mapping[str, Any] | None = None) -> str:
    """The script a request asks for: metadata ``kx.script``, else ``script:<name>``, else work.

    An unknown name selects ``work``.
    """
    meta = {**(request_metadata or {}), **_metadata(message)}
    name = meta.get(SCRIPT_KEY)
    if not isinstance(name, str) and message is not None:
        for part in message.parts:
            if part.HasField("text"):
                first = part.text.strip().split(maxsplit=1)
                if first and first[0].startswith("script:"):
                    name = first[0][len("script:") :]
                break
    if isinstance(name, str) and (name in SCRIPTS or name in FAULT_SCRIPTS):
        return name
    return "work"


def _number(meta: Mapping[str, Any], key: str, default: float) -> float:
    value = meta.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return default


def _envelope(kind: str, stream_key: str, seq: int, payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "v": 1,
        "kind": kind,
        "streamKey": stream_key,
        "seq": seq,
        "status": "running",
        "payload": payload,
    }


class Play:
    """One execution of a script: the task's updater, its envelope counter and its pace
    (what a subclass's step handlers are given)."""

    def __init__(self, updater: TaskUpdater, delay: float) -> None:
        self.updater = updater
        self.delay = delay
        self.seq = 0
        self.asked = False

    async def pause(self) -> None:
        if self.delay > 0:
            await asyncio.sleep(self.delay)

    async def working(self, parts: list[Part]) -> None:
        await self.updater.update_status(_WORKING, message=self.updater.new_agent_message(parts))

    async def step(self, kind: str, payload: dict[str, Any], text: str | None = None) -> None:
        """One ``working`` update: the envelope as a data part, plus its text for text readers."""
        self.seq += 1
        parts = [new_data_part(_envelope(kind, self.updater.task_id, self.seq, payload))]
        if text:
            parts.append(new_text_part(text))
        await self.working(parts)
        await self.pause()

    def text_message(self, text: str) -> Message:
        return self.updater.new_agent_message([new_text_part(text)])


class ScriptedColleague(AgentExecutor):
    """The colleague's brain: plays the script the request asks for (see :func:`script_of`).

    ``delay`` is the pause between steps (per request: metadata ``kx.delay``).
    """

    def __init__(self, *, delay: float = 0.0, flood_count: int = 200, flood_rate: float = 1000.0):
        self.delay = delay
        self.flood_count = flood_count
        self.flood_rate = flood_rate
        # The last envelope seq of each task waiting for input: a follow-up on the same task
        # continues its numbering (one seq space per stream). Released when it resumes.
        self._asked: dict[str, int] = {}

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Enqueue the task, then play its script to a terminal (or interrupted) state."""
        message = context.message
        meta = {**context.metadata, **_metadata(message)}
        script = script_of(message, context.metadata)
        task = context.current_task
        if task is None:
            if message is None:  # pragma: no cover - the SDK always passes the message
                raise RuntimeError("a new task needs the user's message")
            task = new_task_from_user_message(message)
            await event_queue.enqueue_event(task)
        play = Play(
            TaskUpdater(event_queue, task.id, task.context_id),
            _number(meta, DELAY_KEY, self.delay),
        )
        play.seq = self._asked.pop(task.id, 0)
        question = context.get_user_input()
        runner: Callable[[Play, str, Mapping[str, Any]], Awaitable[None]] = getattr(
            self, "_" + script.replace("-", "_")
        )
        await runner(play, question, meta)
        if play.asked:
            if len(self._asked) >= 10_000:  # a bound for a test peer: forget the oldest
                del self._asked[next(iter(self._asked))]
            self._asked[task.id] = play.seq

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Acknowledge a cancel request with a ``canceled`` status carrying a message."""
        task_id = context.task_id or ""
        updater = TaskUpdater(event_queue, task_id, context.context_id or "")
        await updater.cancel(updater.new_agent_message([new_text_part("cancelled on request")]))

    async def _work(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await play.step(
            "thinking", {"text": f"The question is: {question!r}. Check orders first."}, "Thinking…"
        )
        await play.step(
            "tool_call",
            {"name": "search_orders", "args": {"query": question, "limit": 3}},
            "Calling search_orders",
        )
        await play.step(
            "tool_call",
            {"name": "fetch_order", "args": {"id": 42, "score": 0.75, "weights": [1, 2.5]}},
            "Calling fetch_order",
        )
        await play.step("text", {"text": "Order 42 shipped on Monday."}, "Writing the answer")
        await play.updater.complete(
            play.text_message("Order 42 shipped on Monday; it arrives Friday.")
        )

    async def _fail(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await play.step("thinking", {"text": "Looking the order up."})
        await play.step("tool_call", {"name": "search_orders", "args": {"query": question}})
        await play.updater.failed(play.text_message("the order database is unreachable"))

    async def _cancel(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await play.step("thinking", {"text": "Starting, then my operator stops me."})
        await play.updater.cancel(play.text_message("cancelled by the colleague's operator"))

    async def _reject(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await play.updater.reject(play.text_message("I do not handle refunds"))

    async def _text(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        for line in ("Reading your question", "Looking it up", "Writing the answer"):
            await play.working([new_text_part(line)])
            await play.pause()
        await play.updater.complete(play.text_message("Plain answer without envelopes."))

    async def _malformed(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        task_id = play.updater.task_id
        # Negative seq, with text: the caller degrades it to a pseudo-envelope of the text.
        bad_seq = _envelope("text", task_id, 0, {"text": "x"}) | {"seq": -1}
        await play.working([new_data_part(bad_seq), new_text_part("degraded to text")])
        # No kind and no text: dropped and counted.
        no_kind = {k: v for k, v in _envelope("text", task_id, 9, {}).items() if k != "kind"}
        await play.working([new_data_part(no_kind)])
        # A string seq and a non-object data part, no text: dropped and counted.
        await play.working([new_data_part(_envelope("text", task_id, 0, {}) | {"seq": "ten"})])
        await play.working([new_data_part(["not", "an", "envelope"])])
        await play.pause()
        # A good envelope (its seq clear of the caller's pseudo-envelope counter) …
        play.seq = 10
        await play.step("text", {"text": "a good envelope"})
        # … after which a malformed one is dropped even with text: the seqs are the peer's.
        await play.working([new_data_part(bad_seq), new_text_part("dropped, not degraded")])
        await play.updater.complete(play.text_message("answer despite malformed envelopes"))

    async def _flood(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        count = int(_number(meta, COUNT_KEY, self.flood_count))
        rate = _number(meta, RATE_KEY, self.flood_rate) or self.flood_rate
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(count):
            play.seq += 1
            env = _envelope("text", play.updater.task_id, play.seq, {"text": f"update {i}"})
            await play.working([new_data_part(env)])
            # Pace to `rate` per second against the schedule, not per-step sleeps.
            ahead = start + (i + 1) / rate - loop.time()
            if ahead > 0:
                await asyncio.sleep(ahead)
        await play.updater.complete(play.text_message(f"flooded {count} updates"))

    async def _hang(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await play.step("thinking", {"text": "This will take forever."})
        await asyncio.Event().wait()  # until the task is cancelled or the peer closes

    async def _artifact(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await play.step("text", {"text": "Writing the report."})
        await play.updater.add_artifact(
            [new_text_part("Report: ")], artifact_id="report", name="report"
        )
        await play.updater.add_artifact(
            [new_text_part("all orders shipped.")],
            artifact_id="report",
            append=True,
            last_chunk=True,
        )
        await play.updater.complete()

    async def _input(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        """Asks which order is meant (``input-required``), its question both as an envelope
        (shown in the pane while the caller decides) and as text; a follow-up message on the
        same task plays the script it names (default ``work``), its seqs continuing."""
        await play.step("thinking", {"text": "The question is ambiguous."})
        play.seq += 1
        asking = "Which order do you mean?"
        envelope = _envelope("text", play.updater.task_id, play.seq, {"text": asking})
        play.asked = True
        await play.updater.requires_input(
            play.updater.new_agent_message([new_data_part(envelope), new_text_part(asking)])
        )

    async def _crash(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await play.step("thinking", {"text": "About to crash."})
        raise RuntimeError("simulated crash in the colleague")


def build_agent_card(url: str, *, name: str = "Scripted colleague") -> AgentCard:
    """The colleague's card: JSON-RPC at ``url``, protocol 1.0, streaming."""
    return AgentCard(
        name=name,
        description="A scripted A2A colleague that streams structured progress envelopes.",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain", "application/json"],
        skills=[
            AgentSkill(
                id="answer",
                name="Answer questions",
                description="Thinks, calls its tools, writes text and answers.",
                tags=["demo", "test"],
            )
        ],
    )


class _RawSSE:
    """An SSE response written by hand; ``complete=False`` drops the connection mid-body."""

    def __init__(self, frames: list[dict[str, Any]], *, complete: bool) -> None:
        self.frames = frames
        self.complete = complete

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        for frame in self.frames:
            body = f"data: {json.dumps(frame)}\n\n".encode()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        if self.complete:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        # else: return with the body unfinished; the server closes the connection.


class FaultInjectingEndpoint:
    """The JSON-RPC endpoint in front of the SDK's: raw SSE for :data:`FAULT_SCRIPTS`.

    A fake on purpose, and only for faults the SDK cannot produce (it raises on an update
    after a terminal state and always closes streams cleanly). Every other request goes
    to the SDK's own JSON-RPC endpoint unchanged.
    """

    def __init__(self, sdk_endpoint: Callable[[Request], Awaitable[Response]]) -> None:
        self.sdk_endpoint = sdk_endpoint

    async def handle(self, request: Request) -> Any:
        """The Starlette endpoint: raw SSE for a fault script, else the SDK's answer."""
        body = await request.body()  # cached on the request: the SDK endpoint reads it again
        try:
            rpc = json.loads(body)
            if not isinstance(rpc, dict) or rpc.get("method") != "SendStreamingMessage":
                raise ValueError("not a streaming send")
            params = json_format.ParseDict(
                rpc.get("params") or {}, SendMessageRequest(), ignore_unknown_fields=True
            )
            script = script_of(params.message, json_format.MessageToDict(params.metadata))
        except (ValueError, TypeError, json_format.ParseError):
            return await self.sdk_endpoint(request)
        if script not in FAULT_SCRIPTS:
            return await self.sdk_endpoint(request)
        return _RawSSE(
            self._frames(rpc.get("id"), script, params.message), complete=script != "disconnect"
        )

    @staticmethod
    def _frames(rpc_id: Any, script: str, message: Message) -> list[dict[str, Any]]:
        task = new_task_from_user_message(message)

        def frame(response: StreamResponse) -> dict[str, Any]:
            return {"jsonrpc": "2.0", "id": rpc_id, "result": json_format.MessageToDict(response)}

        def status(state: TaskState, parts: list[Part]) -> dict[str, Any]:
            msg = Message(
                role=Role.ROLE_AGENT,
                message_id=uuid.uuid4().hex,
                task_id=task.id,
                context_id=task.context_id,
                parts=parts,
            )
            event = TaskStatusUpdateEvent(
                task_id=task.id,
                context_id=task.context_id,
                status=TaskStatus(state=state, message=msg),
            )
            return frame(StreamResponse(status_update=event))

        def step(seq: int, text: str) -> dict[str, Any]:
            return status(
                _WORKING, [new_data_part(_envelope("text", task.id, seq, {"text": text}))]
            )

        frames = [
            frame(
                StreamResponse(
                    task=Task(id=task.id, context_id=task.context_id, status=task.status)
                )
            ),
            step(1, "working before the fault"),
        ]
        if script == "repeat-completed":
            done = TaskState.TASK_STATE_COMPLETED
            frames += [
                status(done, [new_text_part("the first answer")]),
                status(done, [new_text_part("a second answer")]),
                step(2, "working after completed"),
            ]
        return frames


class ScriptedPeer:
    """The colleague's server: a Starlette app holding the SDK's handler, card and routes.

    ``url`` is the JSON-RPC URL advertised on the card (``http://127.0.0.1:<port>/``).
    ``colleague`` replaces the executor (a :class:`ScriptedColleague` subclass that says
    other things; ``delay`` and the flood knobs are then its own). Serve :attr:`app` with
    uvicorn; await :meth:`aclose` when done.
    """

    def __init__(
        self,
        url: str,
        *,
        delay: float = 0.0,
        flood_count: int = 200,
        flood_rate: float = 1000.0,
        name: str = "Scripted colleague",
        colleague: ScriptedColleague | None = None,
    ) -> None:
        self.url = url
        self.colleague = colleague or ScriptedColleague(
            delay=delay, flood_count=flood_count, flood_rate=flood_rate
        )
        self.card = build_agent_card(url, name=name)
        self.handler = DefaultRequestHandler(
            agent_executor=self.colleague, task_store=InMemoryTaskStore(), agent_card=self.card
        )
        routes: list[Any] = list(create_agent_card_routes(self.card))
        for route in create_jsonrpc_routes(self.handler, rpc_url="/"):
            routes.append(
                Route(route.path, FaultInjectingEndpoint(route.endpoint).handle, methods=["POST"])
            )
        self.app = Starlette(routes=routes)

    async def aclose(self) -> None:
        """End every execution still running; safe to call more than once."""
        await self.handler.aclose()


async def _serve(host: str, port: int, delay: float) -> None:
    import uvicorn

    peer = ScriptedPeer(f"http://{host}:{port}/", delay=delay)
    server = uvicorn.Server(
        uvicorn.Config(peer.app, host=host, port=port, log_level="info", lifespan="off")
    )
    try:
        await server.serve()
    finally:
        await peer.aclose()


def main(argv: list[str] | None = None) -> None:
    """``python -m kernel_ext.testing.a2a_peer --port P [--host H] [--delay S]``."""
    parser = argparse.ArgumentParser(
        prog="python -m kernel_ext.testing.a2a_peer", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--delay",
        type=float,
        default=0.5,
        help="seconds between the colleague's steps (default 0.5)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    asyncio.run(_serve(args.host, args.port, args.delay))


if __name__ == "__main__":
    main()
