"""A relay that restarted knows whose each open stream is (issue 35, point 7): the loopback
sender announces its hub's open streams in ``kx_hello`` on every connection, and the relay
records them as their running blocks would.

Real processes over 127.0.0.1: the relay is ``tests/support/reliability_relay.py`` in a
subprocess (SIGKILLed, or SIGSTOPped then SIGKILLed, and started again on the same port), or
``create_app`` under uvicorn in this loop for the wire-level cases; the worker is a real
``LoopbackEmitter`` with a real stoppable call, or ``tests/support/stream_worker.py`` in a
subprocess that is SIGKILLed; browsers are python-socketio clients that re-join after a
reconnect.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import socketio
from support.network import serve_asgi
from support.relay_helpers import (
    CALL,
    NS,
    SECRET,
    Browser,
    barrier,
    block,
    emitter_for,
    frame,
    relay_server,
    terminals,
    worker,
)
from support.reliability_helpers import (
    TestRelay,
    WatchedBrowser,
    browser_on,
    running_relay,
    worker_process,
)
from support.stop_calls import (
    RunningCall,
    ask_stop,
    is_stopped,
    running_call,
    stop,
    stopped_terminals,
)
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.attribution.tap import Tap
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.emit import LoopbackEmitter
from kernel_ext.protocol import KX_BLOCKS, KX_HELLO, KX_HELLO_MAX_OPEN, STOP_EVENT, decode
from kernel_ext.relay import WORKER_GONE_MESSAGE, ChatRelay, allow_all
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

ROOM = "conv-restart"
HELLO_FIELDS = {"ok", "v", "frames", "maxFrameBlocks", "maxBlockBytes", "acks"}


def new_hub() -> StreamHub:
    return StreamHub(max_running_per_second=None, tap=Tap())


async def relay_stats(relay: TestRelay) -> dict[str, int]:
    counts: dict[str, int] = (await relay.stats())["counts"]
    return counts


async def restarted(relay: TestRelay, browser: Browser, emitter: LoopbackEmitter) -> None:
    """``relay``, SIGKILLed just now, started again on its port; back once ``browser`` has
    re-joined and ``emitter`` reconnected and heard the new relay's answer to ``kx_hello``."""
    await wait_until(lambda: not emitter.healthy, CALL_TIMEOUT, "the sender saw no disconnect")
    connections = emitter.connections
    relay.start()
    await relay.wait_ready()
    await asyncio.wait_for(browser.rejoined.wait(), CALL_TIMEOUT)
    await wait_until(
        lambda: emitter.connections > connections and emitter.rooms_per_frame,
        CALL_TIMEOUT,
        "the sender did not reconnect, or kx_hello had no answer",
    )


# -- across a restart of the web process -------------------------------------------------


@dataclass
class SilentCall:
    """A relay subprocess, a browser in :data:`ROOM`, a worker's sender, and its ``call``
    that sent its one block (at the browser) and sends nothing more."""

    relay: TestRelay
    browser: WatchedBrowser
    emitter: LoopbackEmitter
    call: RunningCall


@asynccontextmanager
async def silent_call() -> AsyncIterator[SilentCall]:
    hub = new_hub()
    async with running_relay() as relay, browser_on(relay.port, ROOM) as browser:
        emitter = emitter_for(relay.port, hub, ack_timeout=30.0)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            async with running_call(hub, ROOM) as call:
                await browser.wait_for(lambda b: any(x["callId"] == call.call_id for x in b))
                assert await emitter.flush(10)
                yield SilentCall(relay, browser, emitter, call)


async def stopped_once(scene: SilentCall) -> None:
    """The browser's stop is answered ``stopping``, the call returns the stopped result, and
    the browser gets exactly one terminal of it: ``aborted`` with ``"stopped": true``."""
    call, browser = scene.call, scene.browser
    ack = await ask_stop(browser, stop(ROOM, call.call_id))
    assert ack == {"answer": "stopping"}  # before the announcement: "unknown"
    result = await asyncio.wait_for(call.task, CALL_TIMEOUT)
    assert result.startswith("The user stopped this tool call")
    assert call.stop_seen == [True]
    await browser.wait_for(lambda b: bool(stopped_terminals(b, call.call_id)))
    assert await scene.emitter.flush(10)
    await barrier(browser, scene.relay.port)
    ends = stopped_terminals(browser.blocks, call.call_id)
    assert len(ends) == 1, ends
    assert is_stopped(ends[0]), ends


async def test_a_stop_after_the_relay_restarted_reaches_the_silent_call_once() -> None:
    """The call's one block went to the relay that died: the restarted relay knows the
    call's worker from the sender's announcement alone."""
    async with silent_call() as scene:
        scene.relay.kill()  # SIGKILL: the relay's memory of the call's owner is gone
        await restarted(scene.relay, scene.browser, scene.emitter)
        await stopped_once(scene)
        counts = await relay_stats(scene.relay)
    assert counts["stops_stopping"] == 1


async def test_a_worker_that_dies_after_the_relay_restarted_has_its_pane_ended_once() -> None:
    grace = 1.0
    async with (
        running_relay(worker_grace=grace) as relay,
        browser_on(relay.port) as browser,
    ):
        async with worker_process("worker-across-restart", relay_port=relay.port) as worker_proc:
            await worker_proc.do("run t1 one")
            await browser.wait_for(lambda blocks: len(blocks) == 1)
            relay.kill()
            relay.start()
            await relay.wait_ready()
            await asyncio.wait_for(browser.rejoined.wait(), CALL_TIMEOUT)

            async def known() -> bool:  # announced by the worker on its new connection
                return (await relay_stats(relay))["worker_streams"] == 1

            await wait_until(known, CALL_TIMEOUT, "the restarted relay knows no open stream")
            await worker_proc.kill()
        await browser.wait_for(lambda blocks: bool(terminals(blocks)), timeout=grace + 20)

        async def settled() -> bool:
            counts = await relay_stats(relay)
            return counts["worker_streams"] == counts["workers_tracked"] == 0

        await wait_until(settled, CALL_TIMEOUT)
        await barrier(browser, relay.port)
        counts = await relay_stats(relay)
    stream = browser.stream(CALL, "t1")
    assert [b["state"] for b in stream] == ["running", "aborted"]
    final = stream[-1]
    decode(final)  # a valid block
    assert final["envelope"]["payload"] == {"message": WORKER_GONE_MESSAGE}
    assert final["envelope"]["seq"] == stream[0]["envelope"]["seq"] + 1
    assert (counts["worker_aborted"], counts["workers_gone"]) == (1, 1)


async def test_a_stop_in_flight_when_the_relay_dies_gets_no_answer_and_a_second_one_ends_it() -> (
    None
):
    async with silent_call() as scene:
        relay, browser, call = scene.relay, scene.browser, scene.call
        assert relay.proc is not None
        relay.proc.send_signal(signal.SIGSTOP)  # the request reaches a frozen relay
        with pytest.raises(socketio.exceptions.TimeoutError):
            await browser.client.call(STOP_EVENT, stop(ROOM, call.call_id), namespace=NS, timeout=3)
        relay.kill()  # SIGKILL while stopped: the request dies with it
        await restarted(relay, browser, scene.emitter)
        # The frozen relay never asked the worker: the call is untouched.
        assert not call.task.done()
        assert call.stop_seen == []
        await stopped_once(scene)


# -- the announcement on the wire ---------------------------------------------------------


def entry(room: str = ROOM, call_id: str = CALL, task_id: str = "t1", seq: int = 1) -> Any:
    return {"room": room, "callId": call_id, "taskId": task_id, "seq": seq}


def tracked(relay: ChatRelay) -> tuple[int, int]:
    stats = relay.stats()
    return stats["workers_tracked"], stats["worker_streams"]


async def test_hostile_open_entries_are_counted_and_ignored_and_the_answer_keeps_its_fields() -> (
    None
):
    hostile: list[Any] = [
        None,
        "entry",
        [ROOM, CALL, "t1", 1],
        entry(room=""),
        entry(room=7),  # type: ignore[arg-type]
        entry(room="r" * 513),
        entry(room="\ud800"),  # a lone surrogate
        entry(call_id=CALL + "0"),  # 17 hex digits
        entry(call_id=CALL.upper()),
        entry(call_id=None),  # type: ignore[arg-type]
        entry(task_id=""),
        entry(task_id="t" * 513),
        entry(task_id="\udfff"),
        entry(seq=True),
        entry(seq=-1),
        entry(seq=1.0),  # type: ignore[arg-type]
        entry(seq=2**53),
        {"room": ROOM, "callId": CALL, "taskId": "t1"},  # no seq
    ]
    good = [entry(task_id="good"), entry(room="r" * 512, task_id="t" * 512, seq=2**53 - 1)]
    async with (
        relay_server(worker_grace=30.0) as (port, relay),
        worker(port, worker_id="w-hostile") as w,
    ):
        answer = await w.call(KX_HELLO, {"v": 1, "open": hostile + good}, namespace=NS)
        assert set(answer) == HELLO_FIELDS
        assert answer["ok"] is True
        assert relay.stats()["rejected_bad_announce"] == len(hostile)
        assert tracked(relay) == (1, 2)
        assert relay.workers.owner_of(CALL, ROOM) == "w-hostile"
        # Not a list: one entry ignored; no "open" (an older sender): nothing.
        await w.call(KX_HELLO, {"v": 1, "open": {"room": ROOM}}, namespace=NS)
        await w.call(KX_HELLO, {"v": 1}, namespace=NS)
        assert relay.stats()["rejected_bad_announce"] == len(hostile) + 1
        # A huge list: the first KX_HELLO_MAX_OPEN entries are read, the rest counted.
        many = [entry(task_id=f"many-{i}") for i in range(KX_HELLO_MAX_OPEN + 5)]
        answer = await w.call(KX_HELLO, {"v": 1, "open": many}, namespace=NS)
        assert set(answer) == HELLO_FIELDS
        assert relay.stats()["rejected_bad_announce"] == len(hostile) + 1 + 5
        assert tracked(relay) == (1, 2 + KX_HELLO_MAX_OPEN)
        assert relay.workers.owner_of(CALL, ROOM) == "w-hostile"


async def test_a_browser_cannot_announce_streams() -> None:
    async with relay_server() as (port, relay):
        browser = Browser()
        try:
            await browser.connect(port)
            answer = await browser.client.call(
                KX_HELLO, {"v": 1, "open": [entry()]}, namespace=NS, timeout=CALL_TIMEOUT
            )
        finally:
            await browser.close()
    assert answer == {"ok": False, "error": "forbidden"}
    assert relay.stats()["rejected_not_internal"] == 1
    assert tracked(relay) == (0, 0)
    assert relay.workers.owner_of(CALL, ROOM) is None


async def test_an_announced_stream_whose_terminal_went_out_stays_ended() -> None:
    """Same relay process: a stream's terminal went out, then its worker (say, a
    reconnection racing its terminal) announces it as open: the relay does not take it as
    open again, so a stop is answered from what it holds and no worker's watch ends it a
    second time."""
    async with (
        relay_server(worker_grace=30.0, stop_timeout=1.0) as (port, relay),
    ):
        browser = Browser()
        try:
            await browser.connect(port)
            assert await browser.join(ROOM) == {"ok": True}
            async with worker(port, worker_id="w-ended") as w:
                ended = [block(1, task_id="t1"), block(2, state="done", task_id="t1")]
                await w.call(KX_BLOCKS, frame(ROOM, ended), namespace=NS)
                await browser.wait_for(lambda b: len(b) == 2)
                answer = await w.call(KX_HELLO, {"v": 1, "open": [entry()]}, namespace=NS)
                assert answer["ok"] is True
                assert tracked(relay) == (0, 0)
                assert relay.workers.owner_of(CALL, ROOM) is None
                ack = await browser.client.call(
                    STOP_EVENT, stop(ROOM, CALL), namespace=NS, timeout=CALL_TIMEOUT
                )
            await barrier(browser, port)
        finally:
            await browser.close()
    assert ack == {"answer": "already_ended"}  # not asked of a worker that ended it
    assert len(terminals(browser.blocks)) == 1


async def test_a_stream_ended_for_a_gone_worker_is_not_reopened_by_its_announcement() -> None:
    grace = 0.2
    async with relay_server(worker_grace=grace) as (port, relay):
        browser = Browser()
        try:
            await browser.connect(port)
            assert await browser.join(ROOM) == {"ok": True}
            async with worker(port, worker_id="w-back") as w:
                await w.call(KX_BLOCKS, frame(ROOM, [block(1, task_id="t1")]), namespace=NS)
                await browser.wait_for(lambda b: len(b) == 1)
            await browser.wait_for(lambda b: bool(terminals(b)), timeout=grace + 10)
            # The worker was only cut off: it comes back and says the stream is open.
            async with worker(port, worker_id="w-back") as w:
                answer = await w.call(KX_HELLO, {"v": 1, "open": [entry()]}, namespace=NS)
                assert answer["ok"] is True
                assert tracked(relay) == (0, 0)
            await barrier(browser, port)
        finally:
            await browser.close()
    assert [b["state"] for b in browser.blocks] == ["running", "aborted"]


# -- what the sender announces -----------------------------------------------------------


class HelloLog(ChatRelay):
    """The real relay, also keeping each ``kx_hello`` and ``kx_blocks`` in arrival order
    with the connection it came on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str, Any]] = []

    async def on_kx_hello(self, sid: str, data: Any = None) -> dict[str, Any]:
        self.seen.append((sid, KX_HELLO, data))
        return await super().on_kx_hello(sid, data)

    async def on_kx_blocks(self, sid: str, data: Any = None) -> dict[str, Any]:
        self.seen.append((sid, KX_BLOCKS, None))
        return await super().on_kx_blocks(sid, data)


@asynccontextmanager
async def hello_log() -> AsyncIterator[tuple[int, HelloLog]]:
    """A :class:`HelloLog` relay served on 127.0.0.1."""
    sio = socketio.AsyncServer(async_mode="asgi")
    relay = HelloLog(SECRET, authorize_join=allow_all, worker_grace=30.0)
    sio.register_namespace(relay)
    try:
        async with serve_asgi(socketio.ASGIApp(sio)) as port:
            yield port, relay
    finally:
        await relay.aclose()


async def reconnected(relay: HelloLog, emitter: LoopbackEmitter) -> Any:
    """Drop ``emitter``'s connection from the relay's side; once it reconnected and the
    relay answered, the ``kx_hello`` of its new connection."""
    old = emitter.sid
    assert old is not None
    await relay.disconnect(old)
    await wait_until(lambda: emitter.sid not in (None, old) and emitter.rooms_per_frame)
    hellos = [d for sid, event, d in relay.seen if sid == emitter.sid and event == KX_HELLO]
    assert len(hellos) == 1, hellos
    return hellos[0]


def publish_streams(hub: StreamHub, tasks: list[str], call_id: str = CALL) -> None:
    with use_tool_call(ToolCall(call_id, "ask_colleague", ROOM)):
        for task in tasks:
            hub.publish(f"{task} says", task_id=task)


async def test_the_sender_announces_its_open_streams_newest_first_before_its_frames() -> None:
    hub = new_hub()
    async with hello_log() as (port, relay):
        emitter = emitter_for(port, hub, ack_timeout=30.0)
        async with emitter:
            await wait_until(lambda: emitter.rooms_per_frame)
            publish_streams(hub, ["t1", "t2", "t3"])
            with use_tool_call(ToolCall(CALL, "ask_colleague", ROOM)):
                hub.publish("t2 again", task_id="t2")
                hub.publish("t3's answer", task_id="t3", state="done")
                # A colleague's question kept for the call's end: nothing sent on it yet.
                hub.publish("a question", task_id="t4", state="done", provisional=True)
                # The peer's own envelope carries its seq: the hub numbered none.
                peer = {"kind": "text", "streamKey": "t5", "seq": 7, "payload": {"text": "hi"}}
                hub.publish(peer, task_id="t5")
            assert await emitter.flush(10)
            first = [data for _, event, data in relay.seen if event == KX_HELLO]
            assert first == [{"v": 1, "open": []}]  # nothing was open on the first connection
            hello = await reconnected(relay, emitter)
            with use_tool_call(ToolCall(CALL, "ask_colleague", ROOM)):
                hub.publish("t1's answer", task_id="t1", state="done")
            assert await emitter.flush(10)
            events = [(event, data) for sid, event, data in relay.seen if sid == emitter.sid]
    # t3 ended; t4 has sent nothing; newest first, with the seqs the hub gave.
    assert hello == {
        "v": 1,
        "open": [
            {"room": ROOM, "callId": CALL, "taskId": "t5", "seq": 0},
            {"room": ROOM, "callId": CALL, "taskId": "t2", "seq": 2},
            {"room": ROOM, "callId": CALL, "taskId": "t1", "seq": 1},
        ],
    }
    assert [event for event, _ in events] == [KX_HELLO, KX_BLOCKS]


async def test_the_announcement_keeps_the_newest_streams_within_its_bounds() -> None:
    tasks = [f"t{i}" for i in range(KX_HELLO_MAX_OPEN + 5)]
    hub, small = new_hub(), new_hub()
    async with hello_log() as (port, relay):
        emitter = emitter_for(port, hub, ack_timeout=30.0)
        # Each entry here costs 98 characters of the budget: two fit in 250.
        tight = emitter_for(port, small, ack_timeout=30.0, frame_max_chars=250)
        async with emitter, tight:
            await wait_until(lambda: emitter.rooms_per_frame and tight.rooms_per_frame)
            publish_streams(hub, tasks)
            publish_streams(small, ["t1", "t2", "t3"])
            assert await emitter.flush(10)
            assert await tight.flush(10)
            announced = await reconnected(relay, emitter)
            cut = await reconnected(relay, tight)
    assert [e["taskId"] for e in announced["open"]] == tasks[::-1][:KX_HELLO_MAX_OPEN]
    assert [e["taskId"] for e in cut["open"]] == ["t3", "t2"]
    assert relay.stats().get("rejected_bad_announce", 0) == 0
