"""The shipped example page (``kernel_ext/web/example.html?conversation=…``) following a
conversation live in real headless Chromium, on the vendored official Socket.IO client.

The server is real: python-socketio's ``AsyncServer`` with the ``/chat`` relay
(:func:`kernel_ext.relay.mount_relay`), serving the installed package's web directory, under
uvicorn on 127.0.0.1; a real :class:`~kernel_ext.emit.LoopbackEmitter` delivers the blocks a
:class:`~kernel_ext.stream.StreamHub` publishes inside a tool call. Servers run on a loop of
their own (:class:`network.LoopThread`): this thread belongs to Playwright's sync API.

* WebSocket allowed: the client starts on long-polling, upgrades, and the pane fills and
  ends with exactly one terminal.
* WebSocket refused by the server (``transports=["polling"]``: no upgrade offered, a
  WebSocket request refused): the same, on long-polling only.
* A browser the relay refuses: the page says so, and the client does not try again — the
  server saw exactly one attempt, and the client reports itself inactive (no reconnection
  scheduled).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import socketio
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from support import SUPPORT
from support.network import LoopThread, chromium, free_port, serve_asgi, wait_listening
from support.relay_helpers import CALL, CONV, NS, SECRET, emitter_for, in_call
from support.timing import wait_until_sync

from kernel_ext.relay import mount_relay
from kernel_ext.stream import StreamHub
from kernel_ext.web import web_root

pytestmark = [pytest.mark.browser, pytest.mark.network, pytest.mark.timeout(90)]

WAIT_MS = 20_000
TOKEN = "token-of-alice"
STEPS = ("Looking the order up", "Order 42 left the warehouse on Tuesday")
ANSWER = "Order 42 arrives on Friday."

# Installed before the page's scripts: every tool_event_stream block the page's socket
# receives and every join it sends, in order (the page exposes its socket as
# window.kx.socket once created).
RECORD = """() => {
  window.__blocks = [];
  window.__joins = [];
  const watch = setInterval(() => {
    if (!window.kx || !window.kx.socket) return;
    clearInterval(watch);
    window.kx.socket.on("tool_event_stream", (block) => window.__blocks.push(block));
    window.kx.socket.onAnyOutgoing((event, request) => {
      if (event === "join_conversation") window.__joins.push(request);
    });
  }, 5);
}"""


@dataclass
class Server:
    """The example's server on a loop thread: its port, the browsers' connection attempts
    (each ``auth`` the relay's hook was asked about) and the publishing side."""

    loop: LoopThread
    app: Any
    sio: socketio.AsyncServer
    port: int = 0
    attempts: list[Any] = field(default_factory=list)
    hub: StreamHub = field(default_factory=StreamHub)
    http: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    def serve(self) -> None:
        """Start uvicorn (on :attr:`port` once it has one)."""
        self.http = contextlib.AsyncExitStack()
        served = serve_asgi(self.app, self.port or None)
        self.port = self.loop.run(self.http.enter_async_context(served))

    def restart(self, while_down: Callable[[], None]) -> None:
        """Stop uvicorn (every connection closes), call ``while_down``, serve again on the
        same port."""
        self.loop.run(self.http.aclose())
        while_down()
        self.serve()

    def publish(self, text: str, state: str = "running") -> None:
        async def publish() -> None:
            with in_call():
                self.hub.publish(text, state=state)

        self.loop.run(publish())

    def stats(self) -> dict[str, int]:
        """The relay's counts (:meth:`~kernel_ext.relay.ChatRelay.stats`), read on its loop."""

        async def stats() -> dict[str, int]:
            return dict(self.sio.namespace_handlers[NS].stats())

        return dict(self.loop.run(stats()))

    def disconnect_browsers(self) -> int:
        """The server disconnects every browser in :data:`CONV`; how many there were."""

        async def disconnect() -> int:
            sids = [sid for sid, _ in self.sio.manager.get_participants(NS, CONV)]
            for sid in sids:
                await self.sio.disconnect(sid, namespace=NS)
            return len(sids)

        return int(self.loop.run(disconnect()))


@contextlib.contextmanager
def example_server(transports: list[str] | None = None, **relay_options: Any) -> Iterator[Server]:
    """The web directory plus ``/chat`` (browsers need ``auth {token: TOKEN}``; the relay
    takes ``relay_options``), and a running emitter; ``transports`` restricts the server's
    Engine.IO transports."""
    runner = LoopThread()
    attempts: list[Any] = []

    def authenticate(auth: Any, environ: Any) -> Any:
        attempts.append(auth)
        return "alice" if isinstance(auth, dict) and auth.get("token") == TOKEN else None

    options: dict[str, Any] = {}
    if transports is not None:
        # A pending long-poll is answered at the next ping at the latest: short pings, so
        # that the emitter's polling connection closes promptly at the end.
        options.update(transports=transports, ping_interval=1, ping_timeout=1)
    sio = socketio.AsyncServer(async_mode="asgi", cors_allowed_origins=[], **options)
    mount_relay(
        sio,
        SECRET,
        authenticate=authenticate,
        authorize_join=lambda user, room: True,
        **relay_options,
    )
    files = Starlette(routes=[Mount("/", StaticFiles(directory=web_root()))])
    server = Server(runner, socketio.ASGIApp(sio, other_asgi_app=files), sio, attempts=attempts)
    emitter = None
    try:
        server.serve()
        # The worker's emitter speaks WebSocket by default; on a polling-only server it polls.
        emitter = emitter_for(server.port, server.hub, transports=transports or ["websocket"])
        runner.run(emitter.start())
        yield server
    finally:
        try:
            if emitter is not None:
                runner.run(emitter.stop())
        finally:
            try:
                runner.run(_end_sessions(sio))
            finally:
                try:
                    runner.run(server.http.aclose())
                finally:
                    runner.close()


async def _end_sessions(sio: socketio.AsyncServer) -> None:
    """What python-socketio asks for before the web server stops: every Engine.IO session
    closed, so that a long-poll a closed page left pending (answered at the next ping, up to
    ``ping_interval + ping_timeout`` later) does not hold uvicorn's shutdown, and the
    server's background task ended."""
    if sio.eio.sockets:
        await sio.eio.disconnect()
    await sio.shutdown()


@contextlib.contextmanager
def page_at(url: str) -> Iterator[tuple[Any, list[str]]]:
    """A page at ``url`` recording its blocks (:data:`RECORD`); page errors are collected."""
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 900, "height": 700})
        page.set_default_timeout(WAIT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.add_init_script(f"({RECORD})()")
        page.goto(url)
        yield page, errors


def example_page(server: Server, token: str) -> contextlib.AbstractContextManager[Any]:
    """The example page following :data:`CONV` with ``token``."""
    return page_at(f"http://127.0.0.1:{server.port}/example.html?conversation={CONV}&token={token}")


def _stream_and_check(server: Server, page: Any) -> None:
    """Publish the call's steps and its answer once the page has joined; the pane fills
    and ends, and the page received exactly one terminal, last."""
    page.wait_for_selector("body[data-joined='1']")
    for step in STEPS:
        server.publish(step)
    server.publish(ANSWER, state="done")
    pane = page.locator(f"section.kx-pane[data-call-id='{CALL}']")
    pane.locator(".kx-end").wait_for(state="visible")
    assert pane.locator(".kx-final-text").inner_text() == ANSWER
    assert pane.locator(".kx-text").all_inner_texts() == list(STEPS)
    page.wait_for_function("() => window.__blocks.some((b) => b.state !== 'running')")
    blocks = page.evaluate("window.__blocks")
    assert [b["state"] for b in blocks] == ["running"] * len(STEPS) + ["done"]
    assert [b["envelope"]["seq"] for b in blocks] == list(range(1, len(STEPS) + 2))
    assert {b["callId"] for b in blocks} == {CALL}


def test_the_example_page_follows_a_conversation_over_websocket() -> None:
    with example_server() as server, example_page(server, TOKEN) as (page, errors):
        # window.kx.socket exists once the page's dynamic import of the client resolved.
        page.wait_for_function(
            "() => window.kx.socket && window.kx.socket.io.engine.transport.name === 'websocket'"
        )
        _stream_and_check(server, page)
        assert page.get_attribute("#connection", "data-transport") == "websocket"
        assert errors == []
        assert len(server.attempts) == 1


def test_with_websocket_refused_the_example_page_works_on_long_polling() -> None:
    with (
        example_server(transports=["polling"]) as server,
        example_page(server, TOKEN) as (page, errors),
    ):
        _stream_and_check(server, page)
        assert page.evaluate("window.kx.socket.io.engine.transport.name") == "polling"
        assert page.get_attribute("#connection", "data-transport") == "polling"
        assert "polling" in page.inner_text("#connection")
        assert errors == []


def test_a_refused_browser_is_told_so_and_does_not_try_again() -> None:
    with example_server() as server, example_page(server, "wrong-token") as (page, errors):
        page.wait_for_function(
            "() => document.getElementById('connection').textContent.includes('refused')"
        )
        assert page.inner_text("#connection") == f"{CONV} · refused: unauthorized"
        # socket.active is false: the official client has given up, nothing is scheduled.
        assert page.evaluate("window.kx.socket.active") is False
        assert page.evaluate("window.kx.socket.connected") is False
        assert server.attempts == [{"token": "wrong-token"}]
        assert errors == []


def test_after_the_server_disconnects_it_the_page_does_not_reconnect() -> None:
    with example_server() as server, example_page(server, TOKEN) as (page, errors):
        page.wait_for_selector("body[data-joined='1']")
        assert server.disconnect_browsers() == 1
        page.wait_for_function(
            "() => document.getElementById('connection').textContent.includes(' · disconnected')"
        )
        assert page.evaluate("window.kx.socket.active") is False
        assert len(server.attempts) == 1
        assert errors == []


def test_after_the_server_restarts_the_page_reconnects_rejoins_and_sends_what_waited() -> None:
    with example_server() as server, example_page(server, TOKEN) as (page, errors):
        page.wait_for_selector("body[data-joined='1']")
        joined = "() => document.getElementById('connection').textContent.includes(' · joined')"
        page.wait_for_function(joined)
        # Reconnection delays are randomised (jitter), so browsers do not return in step.
        assert page.evaluate("window.kx.socket.io.randomizationFactor()") > 0

        def while_down() -> None:
            page.wait_for_function("() => !window.kx.socket.connected && window.kx.socket.active")
            # Emitted while disconnected: the client buffers it and sends it on reconnect.
            page.evaluate(
                """() => { window.__ack = null; window.kx.socket.emit("join_conversation",
                  { conversationId: "conv-2" }, (ack) => { window.__ack = ack; }); }"""
            )

        server.restart(while_down)
        page.wait_for_function("() => window.__ack !== null")
        assert page.evaluate("window.__ack") == {"ok": True}
        page.wait_for_function(joined)  # attachSocket joined the room again
        _stream_and_check(server, page)
        assert [attempt["token"] for attempt in server.attempts] == [TOKEN, TOKEN]
        assert errors == []


def test_the_page_kernel_ext_relay_serves_follows_a_worker_that_enabled_kernel_ext() -> None:
    """docs/integrators.md §6 with a real browser: ``kernel-ext relay`` serves the example
    page at /kernel_ext/; a worker process calls ``kernel_ext.enable(relay_url=…)``,
    publishes a call and shuts down with ``adisable()``; the page's pane ends with it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_EXT_")}
    env["KERNEL_EXT_SECRET"] = SECRET
    relay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kernel_ext.cli.entry",
            "relay",
            "--port",
            str(port),
            "--allow-anyone",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_listening(port, process=relay, what="kernel-ext relay", timeout=30)
        page_url = f"http://127.0.0.1:{port}/kernel_ext/example.html?conversation={CONV}"
        with page_at(page_url) as (page, errors):
            page.wait_for_selector("body[data-joined='1']")
            script = str(SUPPORT / "shutdown_worker.py")
            worker = subprocess.run(
                [sys.executable, script, "async-adisable", f"http://127.0.0.1:{port}", CONV, CALL],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert worker.returncode == 0, worker.stderr
            pane = page.locator(f"section.kx-pane[data-call-id='{CALL}']")
            pane.locator(".kx-end").wait_for(state="visible")
            assert pane.locator(".kx-final-text").inner_text() == "the final answer"
            assert pane.locator(".kx-text").all_inner_texts() == ["working on it"]
            assert page.evaluate("window.kx.socket.io.engine.transport.name") == "websocket"
            assert errors == []
    finally:
        relay.terminate()
        relay.wait(timeout=10)


def test_after_a_drop_the_page_rejoins_with_what_it_holds_and_shows_the_catch_up() -> None:
    """Offline (Playwright's offline mode: the WebSocket drops, every reconnect fails) while
    the call goes on and ends; back online, the official client's re-join carries ``have``
    and the relay sends the rest from its memory — the terminal included, before its
    acknowledgement — of which one block gave way to the relay's bound: the pane goes
    replay → live, shows where the block is missing, and ends once."""
    # Blocks 2-4 are long: the stream bound holds the first block, two of them and the
    # terminal, so block 2 (the oldest running one) gives way when block 4 comes.
    long = [f"step {n}: " + "x" * 2_000 for n in (2, 3, 4)]
    bounds = {"max_block_bytes": 3_000, "replay_stream_bytes": 6_000}
    with example_server(**bounds) as server, example_page(server, TOKEN) as (page, errors):
        page.wait_for_selector("body[data-joined='1']")
        server.publish(STEPS[0])
        pane = page.locator(f"section.kx-pane[data-call-id='{CALL}']")
        page.wait_for_function("() => window.__blocks.length === 1")
        page.evaluate(
            """() => {
              window.__modes = [];
              const modes = window.__modes;
              new MutationObserver(() => {
                const mode = document.querySelector("section.kx-pane").dataset.mode;
                if (modes.at(-1) !== mode) modes.push(mode);
              }).observe(document.body, {
                subtree: true, attributes: true, attributeFilter: ["data-mode"],
              });
            }"""
        )
        page.context.set_offline(True)
        page.wait_for_function("() => !window.kx.socket.connected && window.kx.socket.active")
        for text in long:
            server.publish(text)
        server.publish(ANSWER, state="done")
        wait_until_sync(lambda: server.stats()["blocks_emitted"] == 5, 20, "the relay has all")
        assert server.stats()["replay_gave_way"] == 1
        page.context.set_offline(False)
        pane.locator(".kx-end").wait_for(state="visible")
        task = page.evaluate("window.__blocks[0].taskId")
        assert page.evaluate("window.__joins") == [
            {"conversationId": CONV, "have": []},
            {"conversationId": CONV, "have": [{"callId": CALL, "taskId": task, "seq": 1}]},
        ]
        page.wait_for_function("() => window.__modes.at(-1) === 'live'")
        assert page.evaluate("window.__modes") == ["replay", "live"]
        classes = pane.locator(".kx-items > *").evaluate_all(
            "nodes => nodes.map((n) => n.className)"
        )
        assert classes == ["kx-text", "kx-missing", "kx-text", "kx-text"]
        assert pane.locator(".kx-missing").inner_text() == "1 条较早的内容已不可用"
        assert pane.locator(".kx-text").all_inner_texts() == [STEPS[0], *long[1:]]
        assert pane.locator(".kx-final-text").inner_text() == ANSWER
        # Only what the page lacked came again: blocks 3 to 5, once each.
        seqs = [block["envelope"]["seq"] for block in page.evaluate("window.__blocks")]
        assert seqs == [1, 3, 4, 5]
        assert errors == []


def test_the_page_rejoining_after_drops_with_what_it_holds_is_never_limited() -> None:
    """Five drops (offline) while the call goes on, with the smallest catch-up budget a relay
    takes (one conversation's bound): the reference renderer's re-join carries ``have``
    every time, gets only the blocks the page lacks, and is never limited; the pane ends
    whole, each block once."""
    bounds = {
        "max_block_bytes": 3_000,
        "replay_stream_bytes": 6_000,
        "replay_conversation_bytes": 6_000,
        "catch_up_budget": 6_000,
    }
    with example_server(**bounds) as server, example_page(server, TOKEN) as (page, errors):
        page.wait_for_selector("body[data-joined='1']")
        server.publish("step 1")
        page.wait_for_function("() => window.__blocks.length === 1")
        sent = 1
        for _ in range(5):
            page.context.set_offline(True)
            page.wait_for_function("() => !window.kx.socket.connected && window.kx.socket.active")
            for _ in range(2):
                sent += 1
                server.publish(f"step {sent}")
            wait_until_sync(lambda n=sent: server.stats()["blocks_emitted"] == n, 20, "emitted")
            page.context.set_offline(False)
            page.wait_for_function(f"() => window.__blocks.length === {sent}")
        server.publish(ANSWER, state="done")
        pane = page.locator(f"section.kx-pane[data-call-id='{CALL}']")
        pane.locator(".kx-end").wait_for(state="visible")
        joins = page.evaluate("window.__joins")
        assert len(joins) == 6
        assert joins[0]["have"] == []
        assert [j["have"][0]["seq"] for j in joins[1:]] == [1, 3, 5, 7, 9]
        seqs = [block["envelope"]["seq"] for block in page.evaluate("window.__blocks")]
        assert seqs == list(range(1, sent + 2))
        stats = server.stats()
        assert "catch_up_limited" not in stats
        assert stats["replay_blocks"] == 10  # only what the page lacked, each once
        assert pane.locator(".kx-missing").count() == 0
        assert errors == []
