"""Test helpers for the relay: real python-socketio browsers, a relay in this process
(:func:`relay_server`) with its internal worker connections (:func:`worker`) and the blocks and
frames they send, a relay in a subprocess (:class:`RelayProcess`), joins with a cursor."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import socketio
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.emit import LoopbackEmitter
from kernel_ext.observability import otel_metrics
from kernel_ext.protocol import FALLBACK_INVALID
from kernel_ext.relay import ChatRelay, allow_all, create_app
from kernel_ext.stream import StreamHub
from support.network import free_port, serve_asgi, wait_listening_async
from support.timing import CALL_TIMEOUT, wait_until

SECRET = "s3cret-for-tests"
SUPPORT = str(Path(__file__).resolve().parent)
NS = "/chat"
CALL = "00f067aa0ba902b7"
CONV = "conv-1"
C1, C2 = "conv-1", "conv-2"


class Browser:
    """A real ``socketio.AsyncClient`` acting as a browser: records what reaches it and
    re-joins its conversations after a reconnect."""

    def __init__(self, name: str = "browser", reconnect: bool = True) -> None:
        self.name = name
        self.client = socketio.AsyncClient(
            reconnection=reconnect,
            reconnection_delay=0.05,
            reconnection_delay_max=0.25,
            randomization_factor=0.1,
        )
        self.blocks: list[dict[str, Any]] = []
        self.chat_events: list[dict[str, Any]] = []
        self.order: list[str] = []
        self.rooms: list[str] = []
        self.connects = 0
        self.rejoined = asyncio.Event()
        self._changed = asyncio.Event()
        self.client.on("tool_event_stream", self._on_block, namespace=NS)
        self.client.on("chat_event", self._on_chat_event, namespace=NS)
        self.client.on("connect", self._on_connect, namespace=NS)

    def _on_block(self, block: dict[str, Any]) -> None:
        self.blocks.append(block)
        self.order.append("tool_event_stream")
        self._changed.set()

    def _on_chat_event(self, event: dict[str, Any]) -> None:
        self.chat_events.append(event)
        self.order.append("chat_event")
        self._changed.set()

    async def _on_connect(self) -> None:
        self.connects += 1
        if self.connects > 1 and self.rooms:
            asyncio.get_running_loop().create_task(self._rejoin())

    async def _rejoin(self) -> None:
        """Join the rooms again after a reconnect, saying what it holds (``have``), as the
        reference renderer does: the relay then sends only the rest."""
        for room in self.rooms:
            ack = await self.client.call(
                "join_conversation",
                {"conversationId": room, "have": self.have()},
                namespace=NS,
                timeout=10,
            )
            assert isinstance(ack, dict), ack
            assert ack.get("ok") is True, ack
        self.rejoined.set()

    def have(self) -> list[dict[str, Any]]:
        """Per stream it holds blocks of, the highest seq, and ``ended`` when it holds the
        stream's terminal (the join's ``have``)."""
        highest: dict[tuple[Any, Any], int] = {}
        ended: set[tuple[Any, Any]] = set()
        for block in self.blocks:
            key = (block["callId"], block["taskId"])
            highest[key] = max(block["envelope"]["seq"], highest.get(key, -1))
            if block["state"] != "running":
                ended.add(key)
        return [
            {"callId": c, "taskId": t, "seq": seq, **({"ended": True} if (c, t) in ended else {})}
            for (c, t), seq in highest.items()
        ]

    async def connect(self, port: int, auth: Any = None) -> None:
        await asyncio.wait_for(
            self.client.connect(
                f"http://127.0.0.1:{port}",
                namespaces=[NS],
                auth=auth,
                transports=["websocket"],
                wait_timeout=CALL_TIMEOUT,
            ),
            timeout=2 * CALL_TIMEOUT,
        )

    async def join(self, room: str) -> Any:
        ack = await self.client.call(
            "join_conversation", {"conversationId": room}, namespace=NS, timeout=CALL_TIMEOUT
        )
        if isinstance(ack, dict) and ack.get("ok"):
            self.rooms.append(room)
        return ack

    async def wait_for(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 10.0
    ) -> list[dict[str, Any]]:
        await wait_until(
            lambda: predicate(self.blocks),
            timeout,
            lambda: f"{self.name}: {len(self.blocks)} blocks, condition not met",
            wake=self._changed,
        )
        return self.blocks

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.shutdown(), timeout=CALL_TIMEOUT)


async def barrier(browser: Browser, port: int) -> None:
    """Everything sent to ``browser`` before now has arrived: a round trip through the
    server on the same connection (events are delivered in order)."""
    await browser.client.call(
        "leave_conversation", {"conversationId": "__barrier__"}, namespace=NS, timeout=CALL_TIMEOUT
    )


HOOKS = ["--authenticate", "relay_cli_hooks:authenticate"]
HOOKS += ["--authorize-join", "relay_cli_hooks:authorize_join"]
"""The relay's ``--authenticate``/``--authorize-join`` options naming tests/support's
``relay_cli_hooks`` (token-of-alice is alice, a member of conv-of-alice only)."""


def support_env(secret: str = SECRET) -> dict[str, str]:
    """The tests' environment for a ``kernel_ext`` subprocess: ``secret`` as its shared
    secret, and tests/support (the hooks module) on its path."""
    path = os.pathsep.join(p for p in (SUPPORT, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, KERNEL_EXT_SECRET=secret, PYTHONPATH=path)


class RelayProcess:
    """``python -m kernel_ext.relay`` in a subprocess on a fixed port (on 127.0.0.1, open to
    every browser: ``--allow-anyone``, unless ``hooks`` gives its ``--authenticate`` and
    ``--authorize-join`` options, naming functions of a module in tests/support/); killed in
    ``stop``."""

    def __init__(
        self, port: int | None = None, redis_url: str | None = None, hooks: Sequence[str] = ()
    ) -> None:
        self.port = port or free_port()
        self.redis_url = redis_url
        self.hooks = list(hooks)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        """Start it (``env``: its environment, default :func:`support_env`)."""
        env = env or support_env()
        cmd = [sys.executable, "-m", "kernel_ext.relay", "--port", str(self.port)]
        cmd += self.hooks or ["--allow-anyone"]
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    async def wait_ready(self, timeout: float = 20.0) -> None:
        """Return once the relay accepts a connection (fails early if it exited)."""
        assert self.proc is not None
        await wait_listening_async(self.port, process=self.proc, what="relay", timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def in_call(call_id: str = CALL) -> Any:
    return use_tool_call(ToolCall(call_id, "ask_colleague", CONV))


LONE = "before \ud800 after"
LONE_TOOL = {"eventId": CALL, "content": {"toolCall": {"functionCall": {"name": "ask\ud800"}}}}


def _envelope(kind: str, seq: int, payload: dict[str, Any]) -> dict[str, Any]:
    head = {"v": 1, "kind": kind, "streamKey": "task-1", "seq": seq, "status": "running"}
    return {**head, "payload": payload}


def publish_lone_surrogates(hub: StreamHub) -> None:
    """One call whose blocks hold a lone surrogate wherever a block may (docs/protocol.md,
    "Lone surrogates"): a tool's name in its ``chat_event`` and in a ``tool_call``, text,
    a ``done`` answer, an ``aborted`` message; and in a task id, where it may not. What a
    browser gets: :data:`LONE_STREAMS`."""
    with in_call():
        hub.publish_chat_event(LONE_TOOL)
        tool_call = {"name": "look\udfffup", "args": {"q": LONE}}
        hub.publish(_envelope("tool_call", 1, tool_call), task_id="task-1")
        hub.publish(_envelope("text", 2, {"text": LONE}), task_id="task-1")
        hub.publish(LONE, task_id="task-1", state="done")
        hub.publish(LONE, task_id="task-2")
        hub.publish("stopped \udc00", task_id="task-2", state="aborted")
        hub.publish("lost", task_id="t\ud800")  # dropped: a task id cannot hold one
        hub.publish("the answer", task_id="t\ud800", state="done")


LONE_STREAMS = {
    "task-1": [
        ("running", {"name": "look\udfffup", "args": {"q": LONE}}),
        ("running", {"text": LONE}),
        ("done", {"text": LONE}),
    ],
    "task-2": [("running", {"text": LONE}), ("aborted", {"message": "stopped \udc00"})],
    "t\ufffd": [("done", {"text": FALLBACK_INVALID})],
}
"""The streams of :func:`publish_lone_surrogates` as a browser gets them, by task id: each
block's state and payload, in order; the stream of the task id the worker could not send
ends with the fallback terminal, its task id made well formed."""
LONE_BLOCKS = sum(len(blocks) for blocks in LONE_STREAMS.values())


def streams_of(blocks: list[dict[str, Any]]) -> dict[str, list[tuple[str, Any]]]:
    """``blocks`` of one call by task id: each one's state and payload, in order."""
    streams: dict[str, list[tuple[str, Any]]] = {}
    for block in blocks:
        assert block["callId"] == CALL
        streams.setdefault(block["taskId"], []).append(
            (block["state"], block["envelope"]["payload"])
        )
    return streams


def count(n: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda blocks: len(blocks) >= n


def terminals(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for b in blocks if b["state"] != "running"]


def emitter_for(port: int, hub: StreamHub, **options: Any) -> LoopbackEmitter:
    options.setdefault("reconnect_delay", 0.05)
    options.setdefault("reconnect_delay_max", 0.3)
    return LoopbackEmitter(f"http://127.0.0.1:{port}", SECRET, hub=hub, **options)


def record_sender_events(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[], dict[tuple[str, str], int]]:
    """Point ``kernel_ext.sender.events`` at an SDK meter with an in-memory reader (for this
    test); returns a reader of its totals by ``(sender, event)``."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter(otel_metrics.METER_NAME)
    monkeypatch.setattr(
        otel_metrics, "sender_events", meter.create_counter("kernel_ext.sender.events")
    )

    def totals() -> dict[tuple[str, str], int]:
        data = reader.get_metrics_data()
        found: dict[tuple[str, str], int] = {}
        for resource in data.resource_metrics if data is not None else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    assert metric.name == "kernel_ext.sender.events"
                    for point in metric.data.data_points:
                        key = (str(point.attributes["sender"]), str(point.attributes["event"]))
                        found[key] = int(getattr(point, "value", 0))
        return found

    return totals


def record_joins(relay: Any, into: list[Any] | None = None) -> list[Any]:
    """Record every ``join_conversation`` request ``relay`` (a real
    :class:`~kernel_ext.relay.ChatRelay`) gets, as it got it, in ``into`` (a new list when
    ``None``), before the relay handles it as always; returns the list, which fills as joins
    come."""
    requests: list[Any] = [] if into is None else into
    join = relay.on_join_conversation

    async def on_join_conversation(sid: str, data: Any = None) -> Any:
        requests.append(data)
        return await join(sid, data)

    relay.on_join_conversation = on_join_conversation
    return requests


async def run_script(
    script: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, str, str]:
    """Run a worker script (``python SCRIPT ARGS``) with the tests' secret to its end, at
    most ``timeout`` seconds (then killed); its exit status, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        *args,
        env={**os.environ, "KERNEL_EXT_SECRET": SECRET, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# -- a relay in this process, its workers' frames and its browsers' joins ----------------


def block(
    seq: int,
    *,
    state: str = "running",
    call_id: str | None = "00f067aa0ba902b7",
    task_id: str = "task-1",
    text: str | None = None,
) -> dict[str, Any]:
    """A wire block of a text stream: ``block {seq}`` (or ``text``), its terminal's text or
    message when ``state`` is not running."""
    key = "message" if state == "aborted" else "text"
    return {
        "v": 1,
        "callId": call_id,
        "taskId": task_id,
        "state": state,
        "ts": 1789123456789 + seq,
        "envelope": {
            "v": 1,
            "kind": "text",
            "streamKey": task_id,
            "seq": seq,
            "status": state,
            "payload": {key: text if text is not None else f"block {seq}"},
        },
    }


def frame(room: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``kx_blocks`` frame: ``blocks`` for ``room``."""
    return {"v": 1, "room": room, "blocks": blocks}


@asynccontextmanager
async def relay_server(**options: Any) -> AsyncIterator[tuple[int, ChatRelay]]:
    """A relay (``create_app(SECRET, **options)``, every join allowed unless ``options``
    say otherwise) served by uvicorn on 127.0.0.1: its port and the relay."""
    options.setdefault("authorize_join", allow_all)
    ready = create_app(SECRET, **options)
    async with serve_asgi(ready.app) as port:
        yield port, ready.relay


@asynccontextmanager
async def worker(
    port: int, secret: Any = SECRET, worker_id: str | None = None
) -> AsyncIterator[socketio.AsyncClient]:
    """An internal connection to the relay on ``port`` (as a worker's sender), by
    ``secret``, presenting ``worker_id`` when given."""
    client = socketio.AsyncClient(reconnection=False)
    auth = {"internal": secret} if worker_id is None else {"internal": secret, "worker": worker_id}
    await asyncio.wait_for(
        client.connect(
            f"http://127.0.0.1:{port}",
            namespaces=[NS],
            auth=auth,
            transports=["websocket"],
            wait_timeout=CALL_TIMEOUT,
        ),
        timeout=2 * CALL_TIMEOUT,
    )
    try:
        yield client
    finally:
        await asyncio.wait_for(client.disconnect(), timeout=CALL_TIMEOUT)


@asynccontextmanager
async def browsers(port: int, *rooms: str) -> AsyncIterator[list[Browser]]:
    """One connected :class:`Browser` per room of ``rooms``, each joined to its room."""
    made: list[Browser] = []
    try:
        for i, room in enumerate(rooms):
            b = Browser(f"browser-{i}")
            made.append(b)
            await b.connect(port)
            assert await b.join(room) == {"ok": True}
        yield made
    finally:
        for b in made:
            await b.close()


async def join(browser: Browser, room: str, **fields: Any) -> Any:
    """``browser`` joins ``room`` with the join's other ``fields`` (``have`` …): the
    acknowledgement."""
    ack = await browser.client.call(
        "join_conversation", {"conversationId": room, **fields}, namespace=NS, timeout=10
    )
    if isinstance(ack, dict) and ack.get("ok"):
        browser.rooms.append(room)
    return ack


async def connected(port: int, name: str = "browser") -> Browser:
    """A :class:`Browser` connected to the relay on ``port``, in no room yet."""
    browser = Browser(name)
    await browser.connect(port)
    return browser


def seqs(blocks: list[dict[str, Any]], task: str = "task-1") -> list[int]:
    """The seqs of ``task``'s blocks among ``blocks``, in order."""
    return [b["envelope"]["seq"] for b in blocks if b["taskId"] == task]


async def small_buffer_websocket(port: int) -> Any:
    """A WebSocket to the relay on ``port`` as a browser speaks it (Engine.IO 4), on a socket
    with a 4 KiB receive buffer, past Engine.IO's open packet: what the relay sends it stays
    queued at the relay as soon as it stops reading."""
    import socket

    from websockets.asyncio.client import connect

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    url = f"ws://127.0.0.1:{port}/socket.io/?EIO=4&transport=websocket"
    ws = await asyncio.wait_for(
        connect(url, sock=sock, max_queue=1, ping_interval=None, compression=None),
        CALL_TIMEOUT,
    )
    assert (await asyncio.wait_for(ws.recv(), CALL_TIMEOUT)).startswith("0")  # Engine.IO open
    return ws


class NeverReads:
    """A browser that never reads: Engine.IO 4 over a WebSocket (as a browser speaks it) on a
    socket with a 4 KiB receive buffer. After the handshake it only sends — joins and
    leaves, whose answers it never reads — so what the relay sends it stays queued there."""

    def __init__(self) -> None:
        self._ws: Any = None
        self._ids = 0

    async def open(self, port: int) -> None:
        import json

        self._ws = await small_buffer_websocket(port)
        await self._ws.send(f"40{NS},{{}}")
        assert (await asyncio.wait_for(self._ws.recv(), CALL_TIMEOUT)).startswith(f"40{NS},")
        self._json = json

    async def send(self, event: str, data: Any) -> None:
        """Send ``event`` with ``data`` asking for an answer it will not read."""
        self._ids += 1
        await self._ws.send(f"42{NS},{self._ids}" + self._json.dumps([event, data]))

    def abort(self) -> None:
        if self._ws is not None:
            self._ws.transport.abort()
