"""A stand-in for the relay's side of ``stop_call`` (docs/web.md, "Stopping a call"), for the
tests of its two clients — the renderer's stop control in Chromium and ``kernel-ext stop``.

It stands in for the relay (whose own handler, tests/relay/test_stop_relay.py, answers only
what a real worker decides) so that every answer can be chosen: a real python-socketio
``AsyncServer`` under uvicorn on 127.0.0.1 (on a :class:`~support.network.LoopThread`, since
Playwright's sync API owns the test's thread), serving the installed package's web
directory beside namespace ``/chat``. It accepts every browser (recording each ``auth``),
acknowledges every ``join_conversation`` with ``{"ok": true}`` (or the ``join_answer`` it is
given), records every ``stop_call`` and ``probe`` event it receives, and acknowledges a
``stop_call`` with the answer chosen for its callId (default: :attr:`StandInRelay.answer`);
:data:`NO_ACK` never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import socketio
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from kernel_ext.web import web_root
from support.network import LoopThread, serve_asgi
from support.timing import wait_until_sync

NS = "/chat"
CONV = "conv-1"
CALL = "00f067aa0ba902b7"
NO_ACK = object()
"""An answer that is never sent: the ``stop_call`` handler waits until the server stops."""
WAIT = 20.0


@dataclass
class StandInRelay:
    """The stand-in's state, read from the test's thread (each list only ever appended to)."""

    loop: LoopThread
    sio: socketio.AsyncServer
    port: int = 0
    answer: Any = field(default_factory=lambda: {"answer": "stopping"})
    answers: dict[Any, Any] = field(default_factory=dict)
    """The acknowledgement for a callId (a key of this dict); others get :attr:`answer`."""
    join_answer: Any = field(default_factory=lambda: {"ok": True})
    auths: list[Any] = field(default_factory=list)
    joins: list[Any] = field(default_factory=list)
    stops: list[Any] = field(default_factory=list)
    probes: list[Any] = field(default_factory=list)
    closing: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def emit_block(self, block: dict[str, Any], room: str = CONV) -> None:
        """Send one ``tool_event_stream`` block to ``room``'s browsers."""
        self.emit("tool_event_stream", block, room)

    def emit(self, event: str, data: Any, room: str = CONV) -> None:
        """Send ``event`` with ``data`` to ``room``'s browsers."""
        self.loop.run(self.sio.emit(event, data, room=room, namespace=NS))

    def wait_for(self, what: str, count: int) -> list[Any]:
        """Wait until ``count`` events of list ``what`` (``stops``, ``joins``, ``probes``)
        arrived; the list."""
        events: list[Any] = getattr(self, what)
        wait_until_sync(lambda: len(events) >= count, WAIT, lambda: f"{count} {what}: {events}")
        return events


def _register(relay: StandInRelay) -> None:
    sio = relay.sio

    async def connect(sid: str, environ: Any, auth: Any = None) -> bool:
        relay.auths.append(auth)
        return True

    async def join_conversation(sid: str, data: Any = None) -> Any:
        relay.joins.append(data)
        if isinstance(data, dict) and isinstance(data.get("conversationId"), str):
            await sio.enter_room(sid, data["conversationId"], namespace=NS)
        return relay.join_answer

    async def stop_call(sid: str, data: Any = None) -> Any:
        relay.stops.append(data)
        call_id = data.get("callId") if isinstance(data, dict) else None
        answer = relay.answers.get(call_id, relay.answer) if isinstance(call_id, str) else None
        answer = relay.answer if answer is None else answer
        if answer is NO_ACK:
            await relay.closing.wait()
            return None
        return answer

    async def probe(sid: str, data: Any = None) -> None:
        relay.probes.append(data)

    sio.on("connect", connect, namespace=NS)
    sio.on("join_conversation", join_conversation, namespace=NS)
    sio.on("stop_call", stop_call, namespace=NS)
    sio.on("probe", probe, namespace=NS)


@contextlib.contextmanager
def stand_in_relay(**fields: Any) -> Iterator[StandInRelay]:
    """The stand-in serving on 127.0.0.1 (``fields`` set its answers); stopped at the end."""
    loop = LoopThread()
    sio = socketio.AsyncServer(async_mode="asgi", cors_allowed_origins=[])
    relay = StandInRelay(loop, sio, **fields)
    relay.closing = loop.run(_event())
    _register(relay)
    files = Starlette(routes=[Mount("/", StaticFiles(directory=web_root()))])
    app = socketio.ASGIApp(sio, other_asgi_app=files)
    http = contextlib.AsyncExitStack()
    try:
        relay.port = loop.run(http.enter_async_context(serve_asgi(app)))
        yield relay
    finally:
        try:
            loop.run(_close(relay, http))
        finally:
            loop.close()


async def _event() -> asyncio.Event:
    return asyncio.Event()  # made on the server's loop


async def _close(relay: StandInRelay, http: contextlib.AsyncExitStack) -> None:
    relay.closing.set()
    if relay.sio.eio.sockets:
        await relay.sio.eio.disconnect()
    await relay.sio.shutdown()
    await http.aclose()
