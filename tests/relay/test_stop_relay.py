"""The relay's side of a browser's ``stop_call`` (issue 35, phase 2b), on one web process:
the real relay (``create_app`` under uvicorn on 127.0.0.1), a real worker (a
``LoopbackEmitter`` with a real call running under the wrapped runtime) and python-socketio
browsers. Who may stop what, the routing to the worker that owns the call, the answers, the
counts, the rate limit, and ``kernel-ext stop`` as a real subprocess."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import pytest
from support.relay_helpers import (
    NS,
    SECRET,
    Browser,
    RelayProcess,
    barrier,
    block,
    connected,
    emitter_for,
    frame,
    relay_server,
    support_env,
    worker,
)
from support.stop_calls import (
    ask_stop,
    gated_call,
    is_stopped,
    running_call,
    stop,
    stopped_terminals,
)
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.attribution.tap import Tap
from kernel_ext.protocol import KX_BLOCKS, KX_STOP, STOP_ANSWERS
from kernel_ext.relay.limits import DEFAULT_STOP_BURST, DEFAULT_STOP_RATE
from kernel_ext.stream import StreamHub

pytestmark = pytest.mark.network

ROOM, OTHER = "conv-stop-a", "conv-stop-b"
NOBODY = "00000000000000c3"


def new_hub() -> StreamHub:
    return StreamHub(max_running_per_second=None, tap=Tap())


async def joined(port: int, room: str, name: str = "browser", auth: Any = None) -> Browser:
    browser = Browser(name)
    await browser.connect(port, auth)
    assert await browser.join(room) == {"ok": True}
    return browser


async def test_a_stop_reaches_the_owning_worker_and_the_pane_ends_once_as_stopped() -> None:
    hub = new_hub()
    async with relay_server() as (port, relay):
        emitter = emitter_for(port, hub, ack_timeout=30.0)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            browser = await joined(port, ROOM)
            bystander = await joined(port, ROOM, "bystander")
            try:
                async with running_call(hub, ROOM) as call, running_call(hub, ROOM) as other:
                    await browser.wait_for(
                        lambda b: {x["callId"] for x in b} >= {call.call_id, other.call_id}
                    )
                    ack = await ask_stop(browser, stop(ROOM, call.call_id))
                    assert ack == {"answer": "stopping"}
                    result = await asyncio.wait_for(call.task, CALL_TIMEOUT)
                    assert result.startswith("The user stopped this tool call")
                    assert call.stop_seen == [True]
                    for b in (browser, bystander):
                        await b.wait_for(lambda x: bool(stopped_terminals(x, call.call_id)))
                    # The terminal came before the answer to a second request: it ended.
                    again = await ask_stop(bystander, stop(ROOM, call.call_id))
                    assert again == {"answer": "already_ended"}
                    assert not other.task.done()  # the other call of the room goes on
                    assert await emitter.flush(10)
                    for b in (browser, bystander):
                        await barrier(b, port)
                        ends = stopped_terminals(b.blocks, call.call_id)
                        assert len(ends) == 1, ends
                        assert is_stopped(ends[0]), ends
                        assert stopped_terminals(b.blocks, other.call_id) == []
            finally:
                await browser.close()
                await bystander.close()
        stats = relay.stats()
        assert stats["stops_stopping"] == 1
        assert stats["stops_already_ended"] == 1


async def test_only_a_browser_in_the_calls_room_may_stop_it_and_bad_requests_are_refused() -> None:
    hub = new_hub()
    async with relay_server(stop_burst=50) as (port, relay):  # no flood here
        emitter = emitter_for(port, hub, ack_timeout=30.0)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            member = await joined(port, ROOM, "member")
            outsider = await joined(port, OTHER, "outsider")
            lurker = await connected(port, "lurker")  # in no room
            try:
                async with running_call(hub, ROOM) as call:
                    await member.wait_for(lambda b: any(x["callId"] == call.call_id for x in b))
                    cid = call.call_id
                    # Another room's call: refused for its room, unknown for one's own.
                    assert (await ask_stop(outsider, stop(ROOM, cid)))["answer"] == "refused"
                    assert await ask_stop(outsider, stop(OTHER, cid)) == {"answer": "unknown"}
                    assert (await ask_stop(lurker, stop(ROOM, cid)))["answer"] == "refused"
                    malformed: list[Any] = [
                        None,
                        "stop",
                        [ROOM, cid],
                        {"room": ROOM, "callId": cid},
                        {"v": 2, "room": ROOM, "callId": cid},
                        {"v": True, "room": ROOM, "callId": cid},
                        {"v": 1.0, "room": ROOM, "callId": cid},
                        {"v": 1, "room": ROOM, "callId": cid.upper()},
                        {"v": 1, "room": ROOM, "callId": cid + "0"},
                        {"v": 1, "room": ROOM, "callId": 7},
                        {"v": 1, "room": ROOM},
                        {"v": 1, "room": "", "callId": cid},
                        {"v": 1, "room": 5, "callId": cid},
                        {"v": 1, "room": "r" * 513, "callId": cid},
                        {"v": 1, "room": "conv-\ud800", "callId": cid},
                        {"v": 1, "room": ROOM, "callId": cid[:15] + "\udc00"},
                    ]
                    for data in malformed:
                        ack = await ask_stop(member, data)
                        assert ack["answer"] == "refused", data
                        assert isinstance(ack.get("reason"), str)
                    # A browser cannot send the relay's own event to anyone.
                    await member.client.emit(KX_STOP, {"v": 1, "callId": cid}, namespace=NS)
                    await barrier(member, port)
                    assert not call.task.done()
                    assert call.stop_seen == []
                    assert stopped_terminals(member.blocks, cid) == []
            finally:
                for b in (member, outsider, lurker):
                    await b.close()
        stats = relay.stats()
        assert stats["rejected_stop_not_joined"] == 2
        assert stats["rejected_bad_stop"] == 16
        assert stats["rejected_unknown_event"] >= 1
        assert stats["stops_refused"] == 18
        assert stats["stops_unknown"] == 1
        assert "stops_stopping" not in stats


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync-hook", "async-hook"])
async def test_the_authorize_stop_hook_narrows_who_may_stop(asynchronous: bool) -> None:
    asked: list[tuple[Any, str, str]] = []

    def decide(identity: Any, room: str, call_id: str) -> bool:
        asked.append((identity, room, call_id))
        return identity == "owner"

    async def decide_async(identity: Any, room: str, call_id: str) -> bool:
        await asyncio.sleep(0)
        return decide(identity, room, call_id)

    def authenticate(auth: Any, environ: Any) -> Any:
        return auth.get("who") if isinstance(auth, dict) else None

    hub = new_hub()
    hook = decide_async if asynchronous else decide
    async with relay_server(authenticate=authenticate, authorize_stop=hook) as (port, relay):
        emitter = emitter_for(port, hub, ack_timeout=30.0)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            guest = await joined(port, ROOM, "guest", {"who": "guest"})
            owner = await joined(port, ROOM, "owner", {"who": "owner"})
            try:
                async with running_call(hub, ROOM) as call:
                    await guest.wait_for(lambda b: any(x["callId"] == call.call_id for x in b))
                    ack = await ask_stop(guest, stop(ROOM, call.call_id))
                    assert ack["answer"] == "refused"
                    assert not call.task.done()
                    ack = await ask_stop(owner, stop(ROOM, call.call_id))
                    assert ack == {"answer": "stopping"}
                    await asyncio.wait_for(call.task, CALL_TIMEOUT)
            finally:
                await guest.close()
                await owner.close()
        assert [who for who, _, _ in asked] == ["guest", "owner"]
        assert {(room, cid) for _, room, cid in asked} == {(ROOM, call.call_id)}
        assert relay.stats()["rejected_stop_forbidden"] == 1


async def test_a_hook_that_raises_refuses() -> None:
    def broken(identity: Any, room: str, call_id: str) -> bool:
        raise RuntimeError("the application's bug")

    async with relay_server(authorize_stop=broken) as (port, relay):
        browser = await joined(port, ROOM)
        try:
            ack = await ask_stop(browser, stop(ROOM, NOBODY))
            assert ack["answer"] == "refused"
        finally:
            await browser.close()
        assert relay.stats()["rejected_stop_forbidden"] == 1


@pytest.mark.parametrize("burst", [1, 3])
async def test_a_flood_is_refused_past_the_burst_per_connection(burst: int) -> None:
    # A rate so low that no request comes back into the bucket during the test.
    async with relay_server(stop_rate=0.001, stop_burst=burst) as (port, relay):
        flooder = await joined(port, ROOM, "flooder")
        calm = await joined(port, ROOM, "calm")
        try:
            answers = [
                (await ask_stop(flooder, stop(ROOM, NOBODY)))["answer"] for _ in range(burst)
            ]
            assert answers == ["unknown"] * burst  # exactly at the bound: every one answered
            past = await ask_stop(flooder, stop(ROOM, NOBODY))  # one past it
            assert past["answer"] == "refused"
            assert "retry in" in past["reason"]
            # Even malformed ones are counted against it, and another browser is untouched.
            assert (await ask_stop(flooder, None))["answer"] == "refused"
            assert await ask_stop(calm, stop(ROOM, NOBODY)) == {"answer": "unknown"}
        finally:
            await flooder.close()
            await calm.close()
        stats = relay.stats()
        assert stats["rejected_stop_rate"] == 2
        assert "rejected_bad_stop" not in stats


def test_the_documented_rate_limit_defaults() -> None:
    assert (DEFAULT_STOP_RATE, DEFAULT_STOP_BURST) == (2.0, 5)


async def test_a_gone_or_silent_worker_is_unreachable() -> None:
    async with relay_server(worker_grace=60.0, stop_timeout=0.5) as (port, relay):
        browser = await joined(port, ROOM)
        try:
            # A worker that sends a running block and never answers kx_stop.
            call_id = "1111111111111111"
            async with worker(port) as silent:
                ack = await silent.call(
                    KX_BLOCKS,
                    frame(ROOM, [block(1, call_id=call_id)]),
                    namespace=NS,
                    timeout=CALL_TIMEOUT,
                )
                assert ack["accepted"] == 1
                await browser.wait_for(lambda b: len(b) == 1)
                ack = await ask_stop(browser, stop(ROOM, call_id))
                assert ack["answer"] == "unreachable"
                assert relay.stats()["stop_no_answer"] == 1
            # Its connection is gone (its grace runs): unreachable at once.
            ack = await ask_stop(browser, stop(ROOM, call_id))
            assert ack["answer"] == "unreachable"
            assert relay.stats()["stop_no_answer"] == 1
        finally:
            await browser.close()
        assert relay.stats()["stops_unreachable"] == 2


async def test_a_worker_that_reconnects_is_asked_on_its_new_connection() -> None:
    hub = new_hub()
    async with relay_server(worker_grace=60.0) as (port, _relay):
        browser = await joined(port, ROOM)
        try:
            first = emitter_for(port, hub, ack_timeout=30.0)
            await first.start()
            await wait_until(lambda: first.healthy)
            async with running_call(hub, ROOM) as call:
                await browser.wait_for(lambda b: any(x["callId"] == call.call_id for x in b))
                assert await first.stop()  # the worker's connection is gone; the call runs on
                assert (await ask_stop(browser, stop(ROOM, call.call_id)))["answer"] == (
                    "unreachable"
                )
                assert not call.task.done()
                second = emitter_for(port, hub, ack_timeout=30.0, worker_id=first.worker_id)
                async with second:
                    await wait_until(lambda: second.healthy)
                    ack = await ask_stop(browser, stop(ROOM, call.call_id))
                    assert ack == {"answer": "stopping"}
                    await asyncio.wait_for(call.task, CALL_TIMEOUT)
                    await browser.wait_for(lambda b: bool(stopped_terminals(b, call.call_id)))
                    assert await second.flush(10)
                await barrier(browser, port)
                assert len(stopped_terminals(browser.blocks, call.call_id)) == 1
        finally:
            await browser.close()


async def test_a_stop_crossing_the_calls_end_gives_one_terminal_and_an_answer_that_says_which() -> (
    None
):
    hub = new_hub()
    seen: dict[str, int] = {}
    async with relay_server(stop_burst=100) as (port, _):
        emitter = emitter_for(port, hub, ack_timeout=30.0)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            browser = await joined(port, ROOM)
            try:
                for i in range(12):
                    gate = asyncio.Event()
                    async with gated_call(hub, ROOM, gate) as call:
                        await browser.wait_for(
                            lambda b, c=call: any(x["callId"] == c.call_id for x in b)
                        )
                        asking = asyncio.ensure_future(ask_stop(browser, stop(ROOM, call.call_id)))
                        # The call's end at varied moments of the request's way (which
                        # one wins is not asserted: either must give one terminal).
                        await asyncio.sleep(0.001 * i)
                        gate.set()
                        ack = await asking
                        result = await asyncio.wait_for(call.task, CALL_TIMEOUT)
                        await browser.wait_for(
                            lambda b, c=call: bool(stopped_terminals(b, c.call_id))
                        )
                        assert await emitter.flush(10)
                        await barrier(browser, port)
                        ends = stopped_terminals(browser.blocks, call.call_id)
                        assert len(ends) == 1, ends
                        answer = ack["answer"]
                        seen[answer] = seen.get(answer, 0) + 1
                        # The answer says which came first; the pane's one terminal agrees.
                        assert answer in ("stopping", "already_ended"), ack
                        assert is_stopped(ends[0]) == (answer == "stopping"), (answer, ends)
                        assert (result == "done") == (answer == "already_ended"), result
            finally:
                await browser.close()
    assert sum(seen.values()) == 12, seen


async def test_kernel_ext_stop_against_the_real_relay() -> None:
    hub = new_hub()
    async with relay_server() as (port, _):
        emitter = emitter_for(port, hub, ack_timeout=30.0)
        async with emitter:
            await wait_until(lambda: emitter.healthy)
            watcher = await joined(port, ROOM, "watcher")
            try:
                async with running_call(hub, ROOM) as call:
                    await watcher.wait_for(lambda b: any(x["callId"] == call.call_id for x in b))
                    url = f"http://127.0.0.1:{port}"
                    base = [sys.executable, "-m", "kernel_ext", "stop", "--url", url]
                    base += ["--conversation", ROOM, "--lang", "en", "--call-id"]
                    proc = await asyncio.create_subprocess_exec(
                        *base,
                        call.call_id,
                        env=support_env(SECRET),
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                    )
                    out, err = await asyncio.wait_for(proc.communicate(), 60)
                    assert proc.returncode == 0, err
                    assert out.decode().startswith(f"stopping {call.call_id}"), out
                    await asyncio.wait_for(call.task, CALL_TIMEOUT)
                    await watcher.wait_for(lambda b: bool(stopped_terminals(b, call.call_id)))
                    proc = await asyncio.create_subprocess_exec(
                        *base,
                        NOBODY,
                        env=dict(os.environ),
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                    )
                    out, _ = await asyncio.wait_for(proc.communicate(), 60)
                    assert proc.returncode == 3, out
                    assert out.decode().startswith("unknown"), out
            finally:
                await watcher.close()


def test_every_answer_the_relay_gives_is_a_protocol_answer() -> None:
    from kernel_ext.relay import stops

    assert {
        stops.STOPPING,
        stops.ALREADY_ENDED,
        stops.UNKNOWN,
        stops.REFUSED,
        stops.UNREACHABLE,
    } == set(STOP_ANSWERS)


@pytest.mark.parametrize("how", ["option", "variable"])
async def test_kernel_ext_relay_takes_the_stop_rate_from_its_option_or_variable(how: str) -> None:
    env = support_env()
    flags = ["--allow-anyone"]
    if how == "option":
        flags += ["--stop-rate", "1000000"]
    else:
        env["KERNEL_EXT_STOP_RATE"] = "1000000"
    relay = RelayProcess(hooks=flags)
    relay.start(env)
    browser = Browser()
    try:
        await relay.wait_ready()
        await browser.connect(relay.port)
        assert await browser.join(ROOM) == {"ok": True}
        # A million a second: the bucket is full again by the next request (at the default
        # rate, 2 a second, the one past the burst would be refused).
        answers = [
            (await ask_stop(browser, stop(ROOM, NOBODY)))["answer"]
            for _ in range(4 * DEFAULT_STOP_BURST)
        ]
        assert answers == ["unknown"] * (4 * DEFAULT_STOP_BURST)
    finally:
        await browser.close()
        relay.stop()
