"""The handshake turnstile (issue 36, item 6): new Engine.IO sessions are handled a few at a
time, the rest wait first come first served, and one past the waiting bound is answered
``503`` and counted — against the real relay (``create_app``) under uvicorn on 127.0.0.1,
with raw WebSocket and long-polling clients and python-socketio browsers.

To hold handshakes in the turnstile without timing, the tests wrap the real server's
``handle_request`` in :class:`SlowHandshakes`, a test double for a handshake that takes as
long as the test says (the one fault here no client can cause on its own)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
import socketio
from support.network import serve_asgi
from support.relay_helpers import NS, SECRET
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.errors import ConfigError
from kernel_ext.relay import allow_all, create_app
from kernel_ext.relay.turnstile import (
    DEFAULT_MAX_HANDSHAKE_WAITING,
    DEFAULT_MAX_HANDSHAKES,
    REFUSED_HANDSHAKE_BODY,
)

REFUSED = "rejected_handshake_limit"


class SlowHandshakes:
    """Test double: the relay server's ``handle_request``, held for every new session (no
    ``sid`` in its query) until :attr:`go` is set; :attr:`entered` lists the ``tag`` query
    parameter of each new session the turnstile let in, in order."""

    def __init__(self, sio: socketio.AsyncServer) -> None:
        self.handle = sio.handle_request
        self.entered: list[str] = []
        self.go = asyncio.Event()
        sio.handle_request = self  # type: ignore[method-assign]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
        query = scope.get("query_string", b"").decode()
        if "sid=" not in query:
            tags = [part[4:] for part in query.split("&") if part.startswith("tag=")]
            self.entered.append(tags[0] if tags else "")
            await self.go.wait()
        return await self.handle(scope, receive, send)


def url(port: int, tag: str, transport: str = "websocket") -> str:
    scheme = "ws" if transport == "websocket" else "http"
    return f"{scheme}://127.0.0.1:{port}/socket.io/?EIO=4&transport={transport}&tag={tag}"


async def opened(session: aiohttp.ClientSession, port: int, tag: str) -> str:
    """A raw Engine.IO WebSocket's first frame (its open packet), then closed."""
    async with session.ws_connect(url(port, tag)) as ws:
        return await ws.receive_str(timeout=CALL_TIMEOUT)


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_handshakes_wait_in_turn_up_to_the_bound_and_one_more_is_refused() -> None:
    """One handshake at a time and two waiting: the two are let in first come first
    served; a third waiting WebSocket or long-polling handshake is answered 503 with
    Retry-After and counted, a request of an existing session (its ``sid``) is not held;
    once the queue drains a new handshake is let in again."""
    ready = create_app(SECRET, authorize_join=allow_all, max_handshakes=1, max_handshake_waiting=2)
    slow = SlowHandshakes(ready.sio)
    turnstile = ready.turnstile
    assert turnstile is not None
    async with serve_asgi(ready.app) as port, aiohttp.ClientSession() as session:
        first = asyncio.create_task(opened(session, port, "a"))
        await wait_until(lambda: slow.entered == ["a"], 10, lambda: f"{slow.entered}")
        second = asyncio.create_task(opened(session, port, "b"))
        await wait_until(lambda: turnstile.waiting == 1, 10, "b never waited")
        third = asyncio.create_task(opened(session, port, "c"))
        await wait_until(lambda: turnstile.waiting == 2, 10, "c never waited")
        try:
            # One past the bound: refused at once, over WebSocket and over long-polling.
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(url(port, "d"))
            assert refused.value.status == 503
            async with session.get(url(port, "e", "polling")) as answer:
                assert answer.status == 503
                assert answer.headers["Retry-After"] == "1"
                assert await answer.read() == REFUSED_HANDSHAKE_BODY
            assert ready.relay.stats()[REFUSED] == 2
            # A request of a session (a sid, here unknown) is not a handshake: not held.
            async with session.get(url(port, "f", "polling") + "&sid=nosuchsid") as answer:
                assert answer.status == 400
            assert slow.entered == ["a"]
            assert turnstile.waiting == 2
            slow.go.set()
            for task in (first, second, third):
                assert (await asyncio.wait_for(task, CALL_TIMEOUT)).startswith("0{")
            assert slow.entered == ["a", "b", "c"]
            assert turnstile.waiting == 0
            assert (await opened(session, port, "g")).startswith("0{")
            assert slow.entered == ["a", "b", "c", "g"]
            assert ready.relay.stats()[REFUSED] == 2
        finally:
            slow.go.set()
            for task in (first, second, third):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


@pytest.mark.network
@pytest.mark.timeout(90)
async def test_browsers_that_retry_all_get_in_after_a_burst_of_refusals() -> None:
    """A restart's reconnecting browsers: 20 python-socketio clients that retry with
    backoff arrive while one handshake is held, one at a time and two waiting; the 17
    refused (counted) retry, and once handshakes go through again every one connects."""
    ready = create_app(SECRET, authorize_join=allow_all, max_handshakes=1, max_handshake_waiting=2)
    slow = SlowHandshakes(ready.sio)
    clients = [
        socketio.AsyncClient(reconnection_delay=0.05, reconnection_delay_max=0.2) for _ in range(20)
    ]
    async with serve_asgi(ready.app) as port:
        connecting = [
            asyncio.create_task(
                client.connect(
                    f"http://127.0.0.1:{port}",
                    namespaces=[NS],
                    transports=["websocket"],
                    wait_timeout=CALL_TIMEOUT,
                    retry=True,
                )
            )
            for client in clients
        ]
        try:
            await wait_until(
                lambda: ready.relay.stats().get(REFUSED, 0) >= 17,
                20,
                lambda: f"{ready.relay.stats()}",
            )
            assert not any(client.connected for client in clients)
            slow.go.set()
            await asyncio.wait_for(asyncio.gather(*connecting), 60)
            assert all(client.connected for client in clients)
            assert ready.relay.stats()["browsers"] == 20
        finally:
            slow.go.set()
            for task in connecting:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            for client in clients:
                await asyncio.wait_for(client.shutdown(), CALL_TIMEOUT)


def test_the_bounds_default_and_are_checked() -> None:
    """The documented defaults; a bound that is not a positive int is refused at
    construction; ``max_handshakes=None`` turns the turnstile off."""
    assert (DEFAULT_MAX_HANDSHAKES, DEFAULT_MAX_HANDSHAKE_WAITING) == (4, 1_000)
    ready = create_app(SECRET)
    assert ready.turnstile is not None
    assert ready.turnstile.max_handshakes == DEFAULT_MAX_HANDSHAKES
    assert ready.turnstile.max_waiting == DEFAULT_MAX_HANDSHAKE_WAITING
    for bad in ({"max_handshakes": 0}, {"max_handshake_waiting": 0}, {"max_handshakes": 1.5}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            create_app(SECRET, **bad)  # type: ignore[arg-type]
