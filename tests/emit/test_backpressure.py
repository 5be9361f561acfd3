"""Back-pressure from the relay to the loopback sender (docs/operations.md, "Back-pressure").

A real relay (uvicorn on 127.0.0.1), the real ``LoopbackEmitter`` and real browsers. A relay
that cannot keep up is made by a real cause: a browser whose connection stops reading
(:class:`StalledBrowser`, a WebSocket client with a small receive buffer that stops
reading), so what the relay sends it piles up in python-engineio's queue for it.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import socketio
from support.network import serve_asgi
from support.relay_helpers import (
    NS,
    SECRET,
    Browser,
    emitter_for,
    small_buffer_websocket,
    terminals,
)
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.errors import ConfigError
from kernel_ext.relay import ChatRelay, create_app
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.timeout(90)]

ROOM = "conv-bp"
OTHER = "conv-other"
TEXT = "x" * 32_000  # large blocks fill the socket buffers (megabytes on loopback) quickly


@asynccontextmanager
async def relay_server(**options: Any) -> AsyncIterator[tuple[int, ChatRelay]]:
    ready = create_app(SECRET, **options)
    async with serve_asgi(ready.app) as port:
        yield port, ready.relay


class StalledBrowser:
    """A browser (Engine.IO 4 over a WebSocket, as a browser speaks it) that joins a room
    and then stops reading its connection until :meth:`drain`."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def open(self, port: int, room: str) -> None:
        self._ws = await small_buffer_websocket(port)
        await self._ws.send(f"40{NS},{{}}")
        assert (await self._recv()).startswith(f"40{NS},")
        await self._ws.send(f'42{NS},1["join_conversation",{{"conversationId":"{room}"}}]')
        answer = await self._recv()
        assert answer.startswith(f"43{NS},1"), answer
        assert json.loads(answer[len(f"43{NS},1") :])[0]["ok"] is True

    async def _recv(self) -> str:
        message: str = await asyncio.wait_for(self._ws.recv(), 10)
        return message

    def drain(self) -> None:
        """Start reading again (answering the server's pings), recording the blocks."""
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        prefix = f"42{NS},"
        async for message in self._ws:
            if message == "2":
                await self._ws.send("3")
            elif message.startswith(prefix):
                event, data = json.loads(message[len(prefix) :])
                if event == "tool_event_stream":
                    self.blocks.append(data)
                    self._changed.set()

    async def wait_for(self, predicate: Any, what: str) -> None:
        await wait_until(lambda: predicate(self.blocks), 30, what, wake=self._changed)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            self._ws.transport.abort()


@asynccontextmanager
async def browsers(port: int, stalled_room: str, *rooms: str) -> AsyncIterator[Any]:
    """A stalled browser in ``stalled_room``, and a reading browser in each of ``rooms``."""
    async with AsyncExitStack() as stack:
        stalled = StalledBrowser()
        stack.push_async_callback(stalled.close)
        await stalled.open(port, stalled_room)
        readers = []
        for room in rooms:
            browser = Browser(room)
            stack.push_async_callback(browser.close)
            await browser.connect(port)
            assert (await browser.join(room))["ok"] is True
            readers.append(browser)
        yield stalled, readers


def in_call(call_id: str, room: str) -> Any:
    return use_tool_call(ToolCall(call_id, "ask_colleague", room))


def publish_running(hub: StreamHub, call_id: str, room: str, n: int, tasks: int = 3) -> None:
    with in_call(call_id, room):
        for i in range(n):
            hub.publish(TEXT, task_id=f"task-{i % tasks}")


def end_streams(hub: StreamHub, call_id: str, room: str, tasks: int = 3) -> None:
    with in_call(call_id, room):
        for t in range(tasks):
            hub.publish(f"answer {t}", task_id=f"task-{t}", state="done")


def once_each(blocks: list[dict[str, Any]], n: int) -> bool:
    ends = Counter(b["taskId"] for b in terminals(blocks))
    return len(ends) == n and set(ends.values()) == {1}


async def fill_window(
    hub: StreamHub, emitter: Any, relay: ChatRelay, call_id: str, room: str
) -> None:
    """Publish large running blocks until the relay holds the acknowledgement of every
    frame the sender's window lets out (the stalled browser has a quarter of the relay's
    ``browser_queue_max`` queued and reads nothing, so none of them comes)."""
    window = emitter.max_inflight_frames

    def held() -> bool:
        return relay.stats().get("acks_paced", 0) >= window

    for _ in range(400):
        if held():
            return
        publish_running(hub, call_id, room, 4)
        await wait_until(lambda: hub.queue_size == 0 or held(), 20, "the sender took nothing")
    raise AssertionError("the window never filled")


async def test_a_relay_that_cannot_keep_up_slows_the_sender_and_the_hub_drops_running_blocks_only():
    call = "0a0a0a0a0a0a0a0a"
    async with (
        relay_server(browser_queue_max=40, ack_pace_timeout=60) as (port, relay),
        browsers(port, ROOM, ROOM) as (stalled, (reader,)),
    ):
        hub = StreamHub(max_running_per_second=None, max_queue=50)
        emitter = emitter_for(port, hub, max_inflight_frames=2, batch_max=4)
        await emitter.start()
        try:
            await wait_until(lambda: emitter.paced, 10, "the relay did not say paced")
            await fill_window(hub, emitter, relay, call, ROOM)
            # The sender holds back: what is published now stays in the hub, whose
            # bounded queue drops running blocks (counted) and keeps terminals.
            publish_running(hub, call, ROOM, 200)
            end_streams(hub, call, ROOM)
            dropped = hub.stats().counts["queue_full"]
            assert dropped >= 200 - 50  # the hub's queue holds 50; the sender takes none now
            await wait_until(lambda: emitter.holding_back, 10, "the sender did not wait")
            assert emitter.inflight_frames == 2
            assert hub.queue_size >= 3  # the terminals wait in the hub
            stats = relay.stats()
            assert stats["browser_queue_longest"] < 40
            assert "ack_pace_timeouts" not in stats
            # The browser reads again: everything held goes, every terminal once.
            stalled.drain()
            await reader.wait_for(lambda b: once_each(b, 3), timeout=30)
            await stalled.wait_for(lambda b: once_each(b, 3), "stalled browser's terminals")
            assert await emitter.stop(10)
        finally:
            await emitter.stop(1)
        counts = hub.stats().counts
        assert counts["queue_full"] == dropped  # nothing more once it read again
        assert counts["delivered"] == counts["admitted"]  # nothing lost after the hub
        assert "browser_queue_full" not in relay.stats()  # the hub decided what dropped


async def test_one_stalled_browser_holds_up_no_other_conversation_and_its_queue_stays_bounded():
    stalled_call, other_call = "0b0b0b0b0b0b0b0b", "0c0c0c0c0c0c0c0c"
    bound = 40
    async with (
        relay_server(browser_queue_max=bound, ack_pace_timeout=0.2) as (port, relay),
        browsers(port, ROOM, OTHER, ROOM) as (stalled, (other, beside)),
    ):
        hub = StreamHub(max_running_per_second=None)
        emitter = emitter_for(port, hub, max_inflight_frames=2)
        await emitter.start()
        try:
            await wait_until(lambda: emitter.paced, 10, "the relay did not say paced")
            publish_running(hub, stalled_call, ROOM, 600)
            end_streams(hub, stalled_call, ROOM)
            publish_running(hub, other_call, OTHER, 30)
            end_streams(hub, other_call, OTHER)
            # The other conversation, and the reading browser beside the stalled one, get
            # everything while the stalled browser reads nothing: the relay gave up waiting
            # for it and skipped running blocks for it alone.
            await other.wait_for(lambda b: once_each(b, 3) and len(b) == 33, timeout=30)
            await beside.wait_for(lambda b: once_each(b, 3) and len(b) == 603, timeout=30)
            await wait_until(lambda: hub.queue_size == 0 and not emitter.inflight_frames, 30)
            stats = relay.stats()
            assert stats["ack_pace_timeouts"] >= 1
            assert stats["browser_queue_full"] >= 1
            assert stats["browser_queue_longest"] <= bound + 3  # the bound, and its terminals
            assert "queue_full" not in hub.stats().counts  # the relay delivered everything
            stalled.drain()
            await stalled.wait_for(lambda b: once_each(b, 3), "stalled browser's terminals")
            assert len(stalled.blocks) < 603  # running blocks were skipped for it
        finally:
            await emitter.stop(5)


@pytest.mark.parametrize("window", [1, 3])
async def test_the_sender_keeps_exactly_max_inflight_frames_awaiting_acknowledgement(window: int):
    call = "0d0d0d0d0d0d0d0d"
    async with (
        relay_server(browser_queue_max=40, ack_pace_timeout=60) as (port, relay),
        browsers(port, ROOM) as (stalled, _),
    ):
        hub = StreamHub(max_running_per_second=None)
        emitter = emitter_for(
            port, hub, max_inflight_frames=window, frame_max_blocks=1, batch_max=1
        )
        await emitter.start()
        try:
            await wait_until(lambda: emitter.paced, 10, "the relay did not say paced")
            await fill_window(hub, emitter, relay, call, ROOM)
            # at the bound: `window` frames out, the next one waits in the sender
            assert emitter.inflight_frames == window
            assert relay.stats()["frames"] == emitter.counts["acks"] + window
            publish_running(hub, call, ROOM, 5)
            # past it: the sender holds the next block back; the rest stay queued
            await wait_until(lambda: emitter.holding_back, 10, "the sender did not wait")
            assert hub.queue_size >= 4
            assert emitter.inflight_frames == window
            assert relay.stats()["frames"] == emitter.counts["acks"] + window
            stalled.drain()
            await wait_until(lambda: hub.queue_size == 0 and not emitter.inflight_frames, 30)
            assert relay.stats()["frames"] == emitter.counts["acks"]
        finally:
            await emitter.stop(5)


def test_a_window_below_one_frame_is_refused():
    with pytest.raises(ConfigError, match="max_inflight_frames"):
        emitter_for(1, StreamHub(), max_inflight_frames=0)


@pytest.mark.parametrize("bound", [0, 3, -1, 2.5, "40"])
def test_a_browser_queue_bound_below_four_or_not_an_int_is_refused(bound: Any):
    with pytest.raises(ConfigError, match="browser_queue_max"):
        ChatRelay(SECRET, browser_queue_max=bound)


def test_a_browser_queue_bound_of_four_is_taken():
    assert ChatRelay(SECRET, browser_queue_max=4).browser_queue_max == 4


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_an_ack_pace_timeout_that_is_not_positive_is_refused(timeout: float):
    with pytest.raises(ConfigError, match="ack_pace_timeout"):
        ChatRelay(SECRET, ack_pace_timeout=timeout)


async def test_a_relay_without_paced_acks_gets_frames_as_before_from_a_new_sender():
    call = "0e0e0e0e0e0e0e0e"
    async with (
        relay_server(browser_queue_max=None) as (port, relay),
        browsers(port, ROOM, ROOM) as (stalled, (reader,)),
    ):
        hub = StreamHub(max_running_per_second=None)
        emitter = emitter_for(port, hub, max_inflight_frames=1)
        await emitter.start()
        try:
            await wait_until(lambda: emitter.rooms_per_frame, 10, "no answer to kx_hello")
            assert not emitter.paced
            publish_running(hub, call, ROOM, 200)
            end_streams(hub, call, ROOM)
            await reader.wait_for(lambda b: once_each(b, 3) and len(b) == 203, timeout=30)
            assert emitter.counts["window_full"] == 0
            # nothing bounds the stalled browser's queue: what the relay did before
            assert relay.stats()["browser_queue_longest"] > 40
        finally:
            await emitter.stop(5)
        stalled.drain()
        await stalled.wait_for(lambda b: once_each(b, 3), "stalled browser's terminals")


async def test_a_sender_asking_no_acknowledgement_for_running_frames_is_served_by_a_pacing_relay():
    """A sender from before back-pressure: running frames without an acknowledgement
    request, a terminal's frame with one."""
    call = "0f0f0f0f0f0f0f0f"

    def block(seq: int, state: str = "running") -> dict[str, Any]:
        payload = {"text": f"b{seq}"}
        return {
            "v": 1,
            "callId": call,
            "taskId": "task-0",
            "state": state,
            "ts": 1,
            "envelope": {
                "v": 1,
                "kind": "text",
                "streamKey": "task-0",
                "seq": seq,
                "status": "running" if state == "running" else "completed",
                "payload": payload,
            },
        }

    async with (
        relay_server(browser_queue_max=40) as (port, _relay),
        browsers(port, OTHER, ROOM) as (_, (reader,)),
    ):
        old = socketio.AsyncClient(reconnection=False)
        await old.connect(
            f"http://127.0.0.1:{port}",
            namespaces=[NS],
            auth={"internal": SECRET, "worker": "old-sender"},
            transports=["websocket"],
            wait_timeout=CALL_TIMEOUT,
        )
        try:
            for seq in range(1, 51):
                await old.emit(
                    "kx_blocks", {"v": 1, "room": ROOM, "blocks": [block(seq)]}, namespace=NS
                )
            ack = await old.call(
                "kx_blocks",
                {"v": 1, "room": ROOM, "blocks": [block(51, "done")]},
                namespace=NS,
                timeout=10,
            )
        finally:
            await old.disconnect()
        assert ack == {"ok": True, "accepted": 1, "rejected": 0}
        await reader.wait_for(lambda b: len(b) == 51, timeout=10)
        assert [b["envelope"]["seq"] for b in reader.blocks] == list(range(1, 52))


async def test_aclose_sends_the_acknowledgements_that_wait_for_the_browsers():
    call = "1a1a1a1a1a1a1a1a"
    async with (
        relay_server(browser_queue_max=40, ack_pace_timeout=60) as (port, relay),
        browsers(port, ROOM) as (_, _readers),
    ):
        hub = StreamHub(max_running_per_second=None)
        emitter = emitter_for(port, hub, max_inflight_frames=2)
        await emitter.start()
        try:
            await wait_until(lambda: emitter.paced, 10, "the relay did not say paced")
            await fill_window(hub, emitter, relay, call, ROOM)
            acks = emitter.counts["acks"]
            await relay.aclose()
            await wait_until(lambda: emitter.counts["acks"] >= acks + 2, 10, "no acknowledgement")
            assert emitter.counts["ack_timeouts"] == 0
        finally:
            await emitter.stop(1)


async def test_a_paced_acknowledgement_holds_none_of_its_frames_blocks():
    """While the relay holds a frame's acknowledgement back, the frame's blocks are out and
    released: the handler has emptied the frame's block lists (a saturated relay kept every
    waiting frame's blocks alive through the wait, so the garbage collector moved them into
    its oldest generation). The acknowledgement still counts them."""
    from kernel_ext.protocol import text_block

    async with (
        relay_server(browser_queue_max=40, ack_pace_timeout=60) as (port, relay),
        browsers(port, ROOM) as (stalled, _),
    ):
        internal = socketio.AsyncClient(reconnection=False)
        await internal.connect(
            f"http://127.0.0.1:{port}",
            namespaces=[NS],
            transports=["websocket"],
            auth={"internal": SECRET},
            wait_timeout=10,
        )
        try:
            sid = internal.get_sid(NS)
            seq = 0
            waiting: list[tuple[dict[str, Any], asyncio.Task[dict[str, Any]]]] = []
            while not relay.stats().get("acks_paced"):
                assert seq < 400, "the relay never paced an acknowledgement"
                seq += 1
                block = text_block("0e0e0e0e0e0e0e0e", "task-0", "running", 1, seq, TEXT)
                frame = {"v": 1, "rooms": [{"room": ROOM, "blocks": [block, dict(block)]}]}
                task = asyncio.ensure_future(relay.on_kx_blocks(sid, frame))
                waiting.append((frame, task))
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            frame, task = waiting[-1]
            assert not task.done()  # its acknowledgement waits for the stalled browser
            assert frame["rooms"][0]["blocks"] == []
            stalled.drain()
            acks = await asyncio.wait_for(asyncio.gather(*(t for _, t in waiting)), 30)
            assert all(ack["ok"] and ack["accepted"] == 2 for ack in acks)
        finally:
            await internal.disconnect()
