"""The loopback emitter against a real relay: order, batching, acks, reconnects, restarts."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from support.network import free_port, serve_asgi
from support.relay_helpers import (
    CALL,
    CONV,
    LONE_BLOCKS,
    LONE_STREAMS,
    LONE_TOOL,
    SECRET,
    Browser,
    RelayProcess,
    barrier,
    count,
    emitter_for,
    in_call,
    publish_lone_surrogates,
    record_sender_events,
    streams_of,
    terminals,
)
from support.timing import wait_until

from kernel_ext.attribution.tap import Tap
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.emit import LoopbackEmitter
from kernel_ext.relay import ChatRelay, allow_all, create_app
from kernel_ext.stream import StreamHub

pytestmark = pytest.mark.network


@asynccontextmanager
async def relay_in_loop(port: int | None = None) -> AsyncIterator[tuple[int, ChatRelay]]:
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app, port) as bound:
        yield bound, ready.relay


@asynccontextmanager
async def browser_in(port: int, room: str = CONV) -> AsyncIterator[Browser]:
    b = Browser()
    try:
        await b.connect(port)
        assert await b.join(room) == {"ok": True}
        yield b
    finally:
        await b.close()


async def test_blocks_reach_the_browser_in_order_batched_with_one_terminal() -> None:
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    async with relay_in_loop() as (port, relay), browser_in(port) as b:
        emitter = emitter_for(port, hub)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            with in_call():
                hub.publish_chat_event({"eventId": CALL, "status": "running"})
                for i in range(300):
                    hub.publish(f"step {i}", task_id=f"task-{i % 3}")
                for t in range(3):
                    hub.publish(f"answer {t}", task_id=f"task-{t}", state="done")
            await b.wait_for(count(303))
            assert await emitter.flush(10)
        await barrier(b, port)
        assert b.order[0] == "chat_event"
        for t in range(3):
            stream = [x for x in b.blocks if x["taskId"] == f"task-{t}"]
            seqs = [x["envelope"]["seq"] for x in stream]
            assert seqs == list(range(1, 102))
            assert stream[-1]["state"] == "done"
        assert len(terminals(b.blocks)) == 3
        assert relay.stats()["frames"] < 303  # batched on the internal hop
        assert hub.stats()["delivered"] == 303


async def test_lone_surrogates_reach_the_browser_as_published_live_and_in_the_catch_up() -> None:
    # python-socketio's JSON (ensure_ascii) carries a lone surrogate as its escape; the relay
    # checks, holds and sends each block back as it came (docs/protocol.md, Lone surrogates).
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    async with relay_in_loop() as (port, relay), browser_in(port) as live:
        emitter = emitter_for(port, hub)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            publish_lone_surrogates(hub)
            await live.wait_for(count(LONE_BLOCKS))
            assert await emitter.flush(10)
        async with browser_in(port) as late:  # after the call: caught up from the memory
            await late.wait_for(count(LONE_BLOCKS))
            await barrier(late, port)
        await barrier(live, port)
        assert live.chat_events == [LONE_TOOL]
        assert streams_of(live.blocks) == streams_of(late.blocks) == LONE_STREAMS
        assert [name for name in relay.stats() if name.startswith("rejected_")] == []
    assert (hub.stats()["invalid"], hub.stats()["error"]) == (1, 0)


async def test_running_blocks_are_dropped_while_disconnected_and_the_terminal_waits() -> None:
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    port = free_port()
    health: list[bool] = []
    emitter = emitter_for(port, hub, on_health=health.append)
    async with emitter:
        with in_call():
            hub.publish("lost 1")
            hub.publish("lost 2")
            hub.publish("final", state="done")
        await wait_until(lambda: hub.stats()["disconnected"] == 2)
        assert emitter._pending() == 1
        assert not emitter.healthy
        async with relay_in_loop(port) as (_, _relay), browser_in(port) as b:
            await b.wait_for(count(1))
            assert await emitter.flush(10)
            await barrier(b, port)
            assert [x["envelope"]["payload"] for x in b.blocks] == [{"text": "final"}]
    assert health[:1] == [True]


async def test_a_wrong_secret_never_connects_and_is_counted() -> None:
    hub = StreamHub(tap=Tap())
    async with relay_in_loop() as (port, relay):
        emitter = LoopbackEmitter(
            f"http://127.0.0.1:{port}", "not-the-relays-secret", hub=hub, reconnect_delay=0.05
        )
        async with emitter:
            await wait_until(lambda: emitter.counts.get("connect_failures", 0) >= 2)
            assert not emitter.healthy
        assert relay.stats()["rejected_bad_secret"] >= 2
        assert relay.stats()["internal"] == 0


async def test_a_refused_secret_is_logged_once_in_the_workers_own_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay answers a wrong secret with the CONNECT error "unauthorized"; the worker's
    log says so at ERROR, once however often the backoff tries again, and never with
    python-socketio's "One or more namespaces failed to connect"."""
    caplog.set_level(logging.WARNING, logger="kernel_ext")
    hub = StreamHub(tap=Tap())
    async with relay_in_loop() as (port, relay):
        emitter = LoopbackEmitter(
            f"http://127.0.0.1:{port}",
            "not-the-relays-secret",
            hub=hub,
            reconnect_delay=0.05,
            reconnect_delay_max=0.2,
        )
        async with emitter:
            await wait_until(lambda: emitter.counts.get("connect_refused", 0) >= 3)
            assert not emitter.healthy
        assert relay.stats()["rejected_bad_secret"] >= 3
    refused = [r for r in caplog.records if "the relay refused the internal secret" in r.message]
    assert [r.levelno for r in refused] == [logging.ERROR]
    assert "KERNEL_EXT_SECRET" in refused[0].message  # what to do about it
    assert not any("namespaces failed" in r.message for r in caplog.records)
    assert emitter.counts["connect_failures"] == emitter.counts["connect_refused"]


async def test_web_process_killed_and_restarted_mid_stream_terminal_arrives_once() -> None:
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    relay = RelayProcess()
    relay.start()
    try:
        await relay.wait_ready()
        b = Browser()
        try:
            await b.connect(relay.port)
            assert await b.join(CONV) == {"ok": True}
            emitter = emitter_for(relay.port, hub)
            async with emitter:
                await wait_until(lambda: emitter.healthy)
                with in_call():
                    for i in range(5):
                        hub.publish(f"before {i}")
                await b.wait_for(count(5))
                relay.kill()  # SIGKILL mid-stream
                with in_call():
                    hub.publish("while down")
                    hub.publish("the answer", state="done")
                await wait_until(lambda: not emitter.healthy)
                relay.start()  # same port
                await relay.wait_ready()
                await b.wait_for(lambda blocks: len(terminals(blocks)) >= 1, timeout=20)
                assert await emitter.flush(10)
                assert emitter.connections >= 2
            await barrier(b, relay.port)
            finals = terminals(b.blocks)
            assert len(finals) == 1
            assert finals[0]["envelope"]["payload"] == {"text": "the answer"}
            assert [x["envelope"]["payload"]["text"] for x in b.blocks[:5]] == [
                f"before {i}" for i in range(5)
            ]
        finally:
            await b.close()
    finally:
        relay.stop()


async def test_a_frozen_web_process_forces_a_reconnect_and_the_terminal_arrives_once() -> None:
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    relay = RelayProcess()
    relay.start()
    try:
        await relay.wait_ready()
        b = Browser()
        try:
            await b.connect(relay.port)
            assert await b.join(CONV) == {"ok": True}
            emitter = emitter_for(relay.port, hub, ack_timeout=0.5, connect_timeout=0.5)
            async with emitter:
                await wait_until(lambda: emitter.healthy)
                assert relay.proc is not None
                relay.proc.send_signal(signal.SIGSTOP)  # frozen: sockets stay open
                try:
                    with in_call():
                        hub.publish("the answer", state="done")
                    await wait_until(lambda: emitter.counts.get("ack_timeouts", 0) >= 1)
                finally:
                    relay.proc.send_signal(signal.SIGCONT)
                await b.wait_for(count(1), timeout=20)
                assert await emitter.flush(15)
            await barrier(b, relay.port)
            assert len(terminals(b.blocks)) == 1
        finally:
            await b.close()
    finally:
        relay.stop()


async def test_the_senders_counts_reach_opentelemetry_as_they_happen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = record_sender_events(monkeypatch)
    hub = StreamHub(tap=Tap())
    port = free_port()
    emitter = emitter_for(port, hub)
    async with emitter:
        await wait_until(lambda: emitter.counts["connect_failures"] >= 1)  # nothing listens
        async with relay_in_loop(port):
            await wait_until(lambda: emitter.healthy)
        await wait_until(lambda: not emitter.healthy)  # the relay stopped
    assert emitter.counts["connects"] == emitter.connections >= 1
    assert emitter.counts["disconnects"] >= 1
    assert events() == {("loopback", event): n for event, n in emitter.counts.items()}


@asynccontextmanager
async def browsers_in_rooms(port: int, rooms: list[str]) -> AsyncIterator[list[Browser]]:
    """One browser joined to each room, closed at the end."""
    watchers: list[Browser] = []
    try:
        for room in rooms:
            b = Browser()
            await b.connect(port)
            assert await b.join(room) == {"ok": True}
            watchers.append(b)
        yield watchers
    finally:
        for b in watchers:
            await b.close()


def publish_steps(hub: StreamHub, rooms: list[str], steps: int) -> None:
    """``steps`` blocks on one stream per room, round-robin over the rooms; the last
    ``done``."""
    for step in range(steps):
        for i, room in enumerate(rooms):
            with use_tool_call(ToolCall(f"{i + 1:016x}", "ask_colleague", room)):
                state = "done" if step == steps - 1 else "running"
                hub.publish(f"step {step}", task_id="t", state=state)


class _OlderRelay(ChatRelay):
    """A relay from before ``kx_hello``: it answers the question with nothing, and refuses
    a frame of several rooms as a bad frame (what such a relay did)."""

    async def on_kx_hello(self, sid: str, data: object = None) -> None:  # type: ignore[override]
        return None

    def _sections(self, data: object) -> list[tuple[str, list[object]]] | str:  # type: ignore[override]
        if isinstance(data, dict) and "rooms" in data:
            return "a frame is {v: 1, room, blocks}"
        return super()._sections(data)


async def test_blocks_published_at_start_already_share_frames_across_rooms() -> None:
    """Blocks of many rooms published the moment the sender starts wait for the relay's
    answer to ``kx_hello``, then go in frames of several rooms, not one frame per room."""
    rooms = [f"conv-{i}" for i in range(60)]
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    async with relay_in_loop() as (port, relay), browsers_in_rooms(port, rooms) as watchers:
        emitter = emitter_for(port, hub)
        async with emitter:  # at once, before the first connection is up
            publish_steps(hub, rooms, 2)
            for b in watchers:
                await b.wait_for(count(2))
            assert await emitter.flush(10)
        for b in watchers:
            assert [x["envelope"]["seq"] for x in b.blocks] == [1, 2]
        assert relay.stats()["frames"] <= 4  # 120 blocks of 60 rooms, in a few frames
        assert hub.stats()["delivered"] == 2 * len(rooms)


class _SilentRelay(ChatRelay):
    """A relay that never answers ``kx_hello`` (until released at the end of the test)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        import asyncio

        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = asyncio.Event()

    async def on_kx_hello(self, sid: str, data: object = None) -> None:  # type: ignore[override]
        await self.release.wait()


async def test_blocks_at_start_go_after_a_bounded_wait_when_the_relay_never_answers() -> None:
    """The first blocks wait at most about a second for ``kx_hello``'s answer; a relay that
    never gives one still gets every block, one room per frame."""
    import socketio

    rooms = [f"conv-{i}" for i in range(5)]
    sio = socketio.AsyncServer(async_mode="asgi")
    relay = _SilentRelay(SECRET, authorize_join=allow_all)
    sio.register_namespace(relay)
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    try:
        async with (
            serve_asgi(socketio.ASGIApp(sio)) as port,
            browsers_in_rooms(port, rooms) as watchers,
        ):
            emitter = emitter_for(port, hub, ack_timeout=30.0)
            async with emitter:
                publish_steps(hub, rooms, 2)
                for b in watchers:
                    await b.wait_for(count(2))
                assert await emitter.flush(10)
                assert not emitter.rooms_per_frame
            for b in watchers:
                assert [x["envelope"]["seq"] for x in b.blocks] == [1, 2]
            assert relay.stats()["frames"] >= len(rooms)  # one room per frame
            assert hub.stats()["delivered"] == 2 * len(rooms)
    finally:
        relay.release.set()


async def test_a_relay_replaced_by_an_older_one_gets_one_room_per_frame() -> None:
    """The sender asks again on every connection: after the relay on the same address is
    replaced by one that does not answer ``kx_hello``, frames carry one room each and every
    block arrives."""
    import socketio

    rooms = [f"conv-{i}" for i in range(6)]
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    port = free_port()
    emitter = emitter_for(port, hub)
    async with emitter:
        async with relay_in_loop(port):
            await wait_until(lambda: emitter.rooms_per_frame)
        await wait_until(lambda: not emitter.healthy)
        assert not emitter.rooms_per_frame
        sio = socketio.AsyncServer(async_mode="asgi")
        older = _OlderRelay(SECRET, authorize_join=allow_all)
        sio.register_namespace(older)
        async with (
            serve_asgi(socketio.ASGIApp(sio), port),
            browsers_in_rooms(port, rooms) as watchers,
        ):
            await wait_until(lambda: emitter.healthy)
            publish_steps(hub, rooms, 3)
            for b in watchers:
                await b.wait_for(count(3))
            assert await emitter.flush(10)
            assert not emitter.rooms_per_frame
            for b in watchers:
                assert [x["envelope"]["seq"] for x in b.blocks] == [1, 2, 3]
            assert older.stats().get("rejected_bad_frame", 0) == 0
            assert hub.stats()["delivered"] == 3 * len(rooms)


class _AnswerAcrossReconnect:
    """A FAKE client (named as such): python-socketio drops a pending call's callback when
    its connection drops, so a real answer cannot cross a reconnect. This one holds the
    answer to ``kx_hello`` until told, for the fault of an answer arriving late."""

    def __init__(self) -> None:
        import asyncio

        self.release = asyncio.Event()
        self.asked = 0

    async def call(self, event: str, data: object, **_: object) -> object:
        self.asked += 1
        if self.asked == 1:  # the first connection's question, answered late
            await self.release.wait()
            return {"ok": True, "v": 1, "frames": ["rooms"]}
        return None  # the second connection's relay does not answer

    def get_sid(self, namespace: str) -> str:
        return "fake-sid"


async def test_an_answer_to_kx_hello_from_an_earlier_connection_is_ignored() -> None:
    import asyncio

    emitter = LoopbackEmitter("http://127.0.0.1:9", SECRET, hub=StreamHub(tap=Tap()))
    fake = _AnswerAcrossReconnect()
    emitter._client = fake
    await emitter._on_connect()  # connection 1 asks
    first = emitter._hello_task
    await wait_until(lambda: fake.asked == 1)
    await emitter._on_disconnect("transport close")
    await emitter._on_connect()  # connection 2 (an older relay) asks and gets nothing
    await wait_until(lambda: fake.asked == 2)
    fake.release.set()  # connection 1's answer arrives now
    for task in (first, emitter._hello_task):
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert emitter.healthy
    assert not emitter.rooms_per_frame


@pytest.mark.parametrize("older", [False, True], ids=["rooms-per-frame", "older-relay"])
async def test_blocks_of_many_rooms_share_frames_when_the_relay_takes_them(older: bool) -> None:
    import socketio

    rooms = [f"conv-{i}" for i in range(40)]
    sio = socketio.AsyncServer(async_mode="asgi")
    relay_class = _OlderRelay if older else ChatRelay
    relay = relay_class(SECRET, authorize_join=allow_all)
    sio.register_namespace(relay)
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    async with (
        serve_asgi(socketio.ASGIApp(sio)) as port,
        browsers_in_rooms(port, rooms) as watchers,
    ):
        emitter = emitter_for(port, hub)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            if not older:
                await wait_until(lambda: emitter.rooms_per_frame)
            publish_steps(hub, rooms, 5)
            for b in watchers:
                await b.wait_for(count(5))
            assert await emitter.flush(10)
            assert emitter.rooms_per_frame is not older
        for i, b in enumerate(watchers):
            await barrier(b, port)
            assert [x["envelope"]["seq"] for x in b.blocks] == [1, 2, 3, 4, 5]
            assert {x["callId"] for x in b.blocks} == {f"{i + 1:016x}"}
            assert [x["state"] for x in b.blocks][-1] == "done"
        frames = relay.stats()["frames"]
        if older:
            assert frames >= len(rooms)  # one room per frame
        else:
            assert frames < len(rooms)  # blocks of several rooms per frame
        assert relay.stats().get("rejected_unknown_event", 0) == 0
        assert hub.stats()["delivered"] == 5 * len(rooms)


_CTRL_C_APP = """
import asyncio, sys
from support.network import serve_asgi
from support.relay_helpers import SECRET
from kernel_ext.emit import LoopbackEmitter
from kernel_ext.relay import allow_all, create_app
from kernel_ext.stream import StreamHub

async def main():
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port:
        emitter = LoopbackEmitter(f"http://127.0.0.1:{port}", SECRET, hub=StreamHub())
        await emitter.start()
        while not emitter.healthy:
            await asyncio.sleep(0.01)
        print("ready", flush=True)
        try:
            await asyncio.sleep(120)
        finally:
            await emitter.stop(timeout=5)

try:
    asyncio.run(main())
except KeyboardInterrupt:
    print("the application's own Ctrl-C", flush=True)
"""


@pytest.mark.network
@pytest.mark.timeout(120)
def test_an_emitter_on_the_main_threads_loop_leaves_ctrl_c_to_the_application() -> None:
    """python-engineio's client takes SIGINT over on the main thread's loop unless told not
    to (it cancels every task and stops the loop: ``asyncio.run`` then raises "Event loop
    stopped before Future completed"); a sender is a library and must not."""
    import os
    import subprocess
    import sys

    from support.relay_helpers import SUPPORT, support_env

    env = support_env()
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(SUPPORT), env["PYTHONPATH"]])
    proc = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_APP],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "the application's own Ctrl-C" in out, (out, err)
    assert "Event loop stopped" not in err, err
    assert proc.returncode == 0, (proc.returncode, err)
