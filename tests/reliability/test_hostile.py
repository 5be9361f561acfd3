"""Hostile packets at the relay (issue 13, item 8), written by hand as Engine.IO/Socket.IO
text frames over real WebSockets (aiohttp, python-socketio's own client transport) to a
real relay web process (``tests/support/reliability_relay.py``: ``create_app`` under uvicorn on
127.0.0.1, with a ``/stats`` page), or to an in-process server where the test needs the
server's log records.

* A ``CONNECT`` whose internal secret holds a lone surrogate is refused like any wrong
  secret (``connect_error``, counted ``bad_secret``, logged rarely) and leaves nothing in
  the server's manager: 1,000 tries, the same sizes after 100 and after 1,000.
* Events named by a number, a boolean, an object, or with more arguments than their
  handler takes are dropped, answered when they ask for an acknowledgement, and counted.
* Packets python-socketio cannot decode or dispatch (``[]``, ``{}``, ``null``, not JSON,
  nested past the recursion limit, unknown packet types) are counted, and the library's
  tracebacks about them are logged on the 1st, 2nd, 4th … time only: the relay's log does
  not grow with the number of tries. Other records of those loggers pass untouched.

Meanwhile a legit internal sender's stream reaches a legit browser, whole and in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import socketio
from support.network import serve_asgi
from support.relay_helpers import NS, SECRET, block, frame, worker
from support.reliability_helpers import DEFAULT_PINGS, TestRelay, browser_on, report, running_relay
from support.timing import wait_until

import kernel_ext.relay.guarded as relay_hostile
from kernel_ext.relay import ChatRelay, allow_all, create_app, mount_relay, with_packet_guard

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

C1 = "conv-1"
LONE_SURROGATE = "\ud800"
TRIES = 1_000
FIRST = 100
# What the server and the relay hold; each must be the same after 100 and 1,000 tries.
HELD = (
    "namespace_entries",
    "room_entries",
    "pending_connects",
    "pending_disconnects",
    "callbacks",
    "environs",
    "eio_sockets",
    "rooms",
    "held_terminals",
    "remembered_terminals",
    "queued_frames",
)


class RawSocket:
    """A hand-written Engine.IO v4 / Socket.IO v5 client on one real WebSocket: sends any
    text frame, answers the server's pings, and queues every other frame it receives."""

    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self.session = session
        self.url = f"http://127.0.0.1:{port}/socket.io/?EIO=4&transport=websocket"
        self.inbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.reader: asyncio.Task[None] | None = None
        self.ack_ids = 0

    async def __aenter__(self) -> RawSocket:
        self.ws = await self.session.ws_connect(self.url, timeout=aiohttp.ClientWSTimeout(10))
        opening = await self.ws.receive(timeout=10)
        assert isinstance(opening.data, str), opening
        assert opening.data.startswith("0{"), opening
        self.reader = asyncio.get_running_loop().create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.ws is not None
        assert self.reader is not None
        await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self.reader, timeout=10)

    async def _read(self) -> None:
        assert self.ws is not None
        async for message in self.ws:
            if message.type is not aiohttp.WSMsgType.TEXT:
                continue
            if message.data == "2":  # Engine.IO ping
                await self.ws.send_str("3")
                continue
            self.inbox.put_nowait(message.data)
        self.inbox.put_nowait(None)

    async def send(self, text: str) -> None:
        assert self.ws is not None
        await self.ws.send_str(text)

    async def receive(self, timeout: float = 10.0) -> str | None:
        """The next frame (``None`` once the connection is closed)."""
        return await asyncio.wait_for(self.inbox.get(), timeout)

    async def connect(self, auth: Any = None) -> str | None:
        """A Socket.IO ``CONNECT`` to ``/chat``; the server's answer."""
        await self.send("40" + NS + "," + ("" if auth is None else json.dumps(auth)))
        return await self.receive()

    async def barrier(self) -> None:
        """Everything sent before has been read by the server: a call on the same
        connection, answered once the server reached it."""
        self.ack_ids += 1
        await self.send(f'42{NS},{self.ack_ids}["leave_conversation",{{"conversationId":"x"}}]')
        while True:
            answer = await self.receive()
            assert answer is not None, "the connection closed"
            if answer.startswith(f"43{NS},{self.ack_ids}["):
                return


async def log_size(relay: TestRelay) -> int:
    return len(relay.log().encode("utf-8"))


async def settled_sizes(relay: TestRelay, like: dict[str, Any] | None = None) -> dict[str, Any]:
    """The relay's /stats once the raw connections closed so far are gone from the server
    (Engine.IO sockets and environs back to ``like``'s), polled with a deadline."""
    stats = await relay.stats()
    if like is None:
        return stats

    async def back() -> bool:
        nonlocal stats
        stats = await relay.stats()
        return (stats["eio_sockets"], stats["environs"]) == (like["eio_sockets"], like["environs"])

    with contextlib.suppress(TimeoutError):  # the comparison in the test shows what is left
        await wait_until(back, 20, interval=0.05)
    return stats


def held(stats: dict[str, Any]) -> dict[str, Any]:
    return {name: stats[name] for name in HELD}


class LegitStream:
    """A legit internal sender's stream to ``C1``, one acknowledged block at a time, run
    while the attacks run; paused (at a frame boundary) while the relay's sizes are read."""

    def __init__(self, sender: socketio.AsyncClient, task_id: str) -> None:
        self.sender = sender
        self.task_id = task_id
        self.sent = 0
        self.stopped = False
        self.go = asyncio.Event()
        self.idle = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.go.set()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not self.go.is_set():
                self.idle.set()
                await self.go.wait()
            if self.stopped:
                return
            self.sent += 1
            ack = await self.sender.call(
                "kx_blocks", frame(C1, [block(self.sent, task_id=self.task_id)]), namespace=NS
            )
            assert ack == {"ok": True, "accepted": 1, "rejected": 0}

    async def pause(self) -> None:
        self.go.clear()
        await asyncio.wait_for(self.idle.wait(), timeout=30)

    def resume(self) -> None:
        self.idle.clear()
        self.go.set()

    async def stop(self) -> None:
        await self.pause()
        self.stopped = True
        self.resume()
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout=30)


async def attack_with_a_legit_stream(
    relay: TestRelay, attack: Callable[[int], Awaitable[None]], name: str
) -> dict[str, Any]:
    """Run ``attack(n)`` for the first 100 tries, then up to 1,000, while a legit stream
    flows to a browser; sizes and log size before, after 100 and after 1,000 (read with
    the stream paused)."""
    figures: dict[str, Any] = {}
    async with (
        browser_on(relay.port, C1, name="watcher") as watcher,
        worker(relay.port) as sender,
    ):
        stream = LegitStream(sender, name)
        stream.start()
        await stream.pause()
        figures["base"] = base = await settled_sizes(relay)
        figures["log_before"] = await log_size(relay)
        stream.resume()
        await attack(FIRST)
        await stream.pause()
        figures["after_100"] = await settled_sizes(relay, base)
        figures["log_after_100"] = await log_size(relay)
        stream.resume()
        await attack(TRIES - FIRST)
        await stream.stop()
        figures["after_1000"] = await settled_sizes(relay, base)
        figures["log_after_1000"] = await log_size(relay)
        last = stream.sent + 1  # and one more afterwards
        ack = await sender.call("kx_blocks", frame(C1, [block(last, task_id=name)]), namespace=NS)
        assert ack == {"ok": True, "accepted": 1, "rejected": 0}
        await watcher.wait_for(lambda blocks: len(blocks) >= last, timeout=30)
        assert [b["envelope"]["seq"] for b in watcher.blocks] == list(range(1, last + 1))
        figures["legit_blocks"] = last
    return figures


def assert_flat_and_bounded(figures: dict[str, Any]) -> None:
    base, after_100, after_1000 = figures["base"], figures["after_100"], figures["after_1000"]
    assert held(after_100) == held(base)
    assert held(after_1000) == held(after_100)
    first = figures["log_after_100"] - figures["log_before"]
    rest = figures["log_after_1000"] - figures["log_after_100"]
    # 900 more tries add less to the log than the first 100 did: it does not grow with them.
    assert rest < first, (first, rest)


def report_figures(scenario: str, figures: dict[str, Any], counted: int) -> None:
    report(
        scenario,
        tries=TRIES,
        counted=counted,
        legit_blocks_delivered=figures["legit_blocks"],
        log_bytes_first_100=figures["log_after_100"] - figures["log_before"],
        log_bytes_next_900=figures["log_after_1000"] - figures["log_after_100"],
        rss_kb={
            "before": figures["base"]["rss_kb"],
            "after_100": figures["after_100"]["rss_kb"],
            "after_1000": figures["after_1000"]["rss_kb"],
        },
        held_after_1000=held(figures["after_1000"]),
    )


# -- a lone surrogate as the internal secret ---------------------------------------------


async def test_a_lone_surrogate_secret_is_refused_counted_and_leaves_nothing_behind() -> None:
    """Regression: ``"\\ud800".encode("utf-8")`` raised in ``on_connect``: no
    ``connect_error``, not counted, a traceback logged, and the connection left half-open
    in python-socketio's manager for good (one entry per try)."""
    async with running_relay(pings=DEFAULT_PINGS) as relay, aiohttp.ClientSession() as session:
        answers: list[str | None] = []

        async def one() -> None:
            async with RawSocket(session, relay.port) as raw:
                answers.append(await raw.connect({"internal": LONE_SURROGATE}))

        async def attack(n: int) -> None:
            for start in range(0, n, 10):  # ten connections at a time
                await asyncio.gather(*(one() for _ in range(min(10, n - start))))

        figures = await attack_with_a_legit_stream(relay, attack, "surrogate")
        stats = (await relay.stats())["counts"]
    assert len(answers) == TRIES
    assert set(answers) == {f'44{NS},{{"message":"unauthorized"}}'}  # CONNECT_ERROR, each
    assert stats["rejected_bad_secret"] == TRIES
    assert stats.get("rejected_connect_error", 0) == 0
    assert stats["internal_connects"] == 1  # the legit sender
    assert_flat_and_bounded(figures)
    report_figures("hostile: lone surrogate as the internal secret", figures, TRIES)


# -- event names that are not strings, arguments a handler cannot take -------------------

BAD_EVENTS = (
    "[5]",
    '[{"a":1}]',
    "[true]",
    '[1.5,"x"]',
    '[["a"]]',
    '["kx_blocks",{},1,2]',
    '["join_conversation",{},1]',
    '["leave_conversation",1,2,3]',
)


async def test_events_with_bad_names_or_arguments_are_dropped_answered_and_counted() -> None:
    """Regression: ``"on_" + event`` (and calling a handler with extra arguments) raised
    ``TypeError`` in the relay's event task: "Task exception was never retrieved" with a
    traceback per packet, nothing counted, a call left unanswered."""
    async with running_relay(pings=DEFAULT_PINGS) as relay, aiohttp.ClientSession() as session:
        async with (
            RawSocket(session, relay.port) as browser,
            RawSocket(session, relay.port) as sender,
        ):
            assert (await browser.connect() or "").startswith(f"40{NS},")
            assert (await sender.connect({"internal": SECRET}) or "").startswith(f"40{NS},")
            sent = {"names": 0, "arguments": 0, "answered": 0}

            async def attack(n: int) -> None:
                for i in range(n):
                    payload = BAD_EVENTS[i % len(BAD_EVENTS)]
                    raw = (browser, sender)[i % 2]
                    raw.ack_ids += 1
                    ack_id = raw.ack_ids
                    await raw.send(f"42{NS},{ack_id}{payload}")
                    answer = await raw.receive()
                    assert answer == f"43{NS},{ack_id}[]", (payload, answer)
                    sent["answered"] += 1
                    sent["arguments" if payload.startswith('["') else "names"] += 1

            figures = await attack_with_a_legit_stream(relay, attack, "bad-events")
            await browser.barrier()
            await sender.barrier()
        stats = (await relay.stats())["counts"]
        log = relay.log()
    assert sent["answered"] == TRIES
    assert stats["rejected_bad_event_name"] == sent["names"]
    assert stats["rejected_bad_arguments"] == sent["arguments"]
    assert "Task exception was never retrieved" not in log
    assert "Traceback" not in log
    assert_flat_and_bounded(figures)
    report_figures(
        "hostile: events named by non-strings, or with arguments the handler cannot take",
        figures,
        stats["rejected_bad_event_name"] + stats["rejected_bad_arguments"],
    )


# -- packets python-socketio cannot decode or dispatch -----------------------------------

# Past every Python's JSON recursion limit (3.13 parses 5,000 levels, 3.10–3.12 do not).
DEEP = "[" * 50_000 + "]" * 50_000
# frame -> the exception python-socketio raises on it (the kinds the relay logs apart)
MALFORMED = {
    f"42{NS},[]": "IndexError",
    f"42{NS},{{}}": "KeyError",
    f"42{NS},null": "TypeError",
    f"42{NS},{{not json": "JSONDecodeError",
    f"42{NS},{DEEP}": "RecursionError",
    "4x": "ValueError",
    "49": "ValueError",
}


def logged_occurrences(seen: int) -> int:
    """How many of ``seen`` occurrences are logged: the 1st, 2nd, 4th, 8th …"""
    return seen.bit_length()


async def test_malformed_packets_are_counted_and_their_tracebacks_logged_rarely() -> None:
    """Regression: python-engineio logged each of these with a full traceback at ERROR
    (about 2 KB a packet, twice with its own handler): the log grew with every packet."""
    frames = list(MALFORMED)
    async with running_relay(pings=DEFAULT_PINGS) as relay, aiohttp.ClientSession() as session:
        async with RawSocket(session, relay.port) as raw:
            assert (await raw.connect() or "").startswith(f"40{NS},")
            sent: dict[str, int] = {}

            async def attack(n: int) -> None:
                for _ in range(n):
                    index = sum(sent.values())
                    packet = frames[index % len(frames)]
                    await raw.send(packet)
                    sent[packet] = sent.get(packet, 0) + 1
                    if index % 50 == 49:
                        await raw.barrier()
                await raw.barrier()  # the connection survives every one of them

            figures = await attack_with_a_legit_stream(relay, attack, "malformed")

            # python-engineio handles each message in a task of its own: the barrier's answer
            # can overtake the last packets' handling, so wait (with a deadline) for it.
            async def handled() -> bool:
                return (await relay.stats())["counts"].get("rejected_bad_packet", 0) >= TRIES

            await wait_until(handled, 30, "not every malformed packet was handled", interval=0.05)
        stats = (await relay.stats())["counts"]
        log = relay.log()
    by_kind: dict[str, int] = {}
    for packet, count in sent.items():
        by_kind[MALFORMED[packet]] = by_kind.get(MALFORMED[packet], 0) + count
    logged = sum(logged_occurrences(count) for count in by_kind.values())
    assert sum(sent.values()) == TRIES
    assert stats["rejected_bad_packet"] == TRIES
    assert stats["suppressed_log_records"] == TRIES - logged
    # The first of each kind with its traceback (python-engineio's own handler prints each
    # record too: twice), the later ones in one line.
    assert log.count("Traceback (most recent call last)") == 2 * len(by_kind)
    assert log.count("a malformed packet from a client") == 2 * logged
    assert_flat_and_bounded(figures)
    report_figures("hostile: packets python-socketio cannot decode", figures, TRIES)


# -- integers of more than 100 digits, long-polling bodies, frames below Engine.IO --------

BIG = "9" * 101  # python-engineio's JSON decoder refuses integers of more than 100 digits
BIG_INTEGERS = (
    f'42{NS},["join_conversation",{{"conversationId":{BIG}}}]',
    f'42{NS},["leave_conversation",{BIG}]',
    f'42{NS},7["join_conversation",{{"conversationId":"c","have":[{{"seq":{BIG}}}]}}]',
    f"43{NS},1[{BIG}]",
    f'40{NS},{{"token":{BIG}}}',
)


async def test_integers_of_more_than_100_digits_are_counted_and_logged_rarely() -> None:
    """Regression: each such packet was logged with its traceback, twice, and not counted:
    1,000 of them (202 KB) made 58,000 log lines."""
    async with running_relay(pings=DEFAULT_PINGS) as relay, aiohttp.ClientSession() as session:
        async with RawSocket(session, relay.port) as raw:
            assert (await raw.connect() or "").startswith(f"40{NS},")
            lines_before = len(relay.log().splitlines())
            sent = 0

            async def attack(n: int) -> None:
                nonlocal sent
                for _ in range(n):
                    await raw.send(BIG_INTEGERS[sent % len(BIG_INTEGERS)])
                    sent += 1
                    if sent % 50 == 0:
                        await raw.barrier()
                await raw.barrier()  # the connection survives every one of them

            figures = await attack_with_a_legit_stream(relay, attack, "big-integers")

            async def handled() -> bool:
                return (await relay.stats())["counts"].get("rejected_bad_packet", 0) >= TRIES

            await wait_until(handled, 30, "not every packet was handled", interval=0.05)
        stats = (await relay.stats())["counts"]
        log = relay.log()
    assert sent == TRIES
    assert stats["rejected_bad_packet"] == TRIES
    assert stats["suppressed_log_records"] == TRIES - logged_occurrences(TRIES)
    # One kind (ValueError): its first record with the traceback, then one line on the 2nd,
    # 4th … time; python-engineio's own handler prints each record too (twice).
    assert log.count("Traceback (most recent call last)") == 2
    assert log.count("a malformed packet from a client: ValueError: Integer is too large") == (
        2 * logged_occurrences(TRIES)
    )
    assert len(log.splitlines()) - lines_before < 100
    assert_flat_and_bounded(figures)
    # docs/operations.md (Abuse, probe e): the relay holds nothing per bad packet — its
    # resident memory after 1,000 of them within 16 MiB of before (generous: the measured
    # growth is under 1 MiB), while the legit stream above got every block in order.
    grown_kb = figures["after_1000"]["rss_kb"] - figures["base"]["rss_kb"]
    assert grown_kb < 16 * 1024, grown_kb
    report_figures("hostile: integers of more than 100 digits", figures, TRIES)


# body -> the exception python-engineio raises on it
UNDECODABLE_BODIES = {
    b"x": "ValueError",  # no packet type
    b"\xff\xfe not UTF-8": "UnicodeDecodeError",
    "\x1e".join(["6"] * 20).encode(): "ValueError",  # more packets than it decodes at once
    f'42{NS},["join_conversation",{BIG}]'.encode(): "ValueError",
}


async def test_long_polling_bodies_engineio_cannot_decode_are_counted_and_logged_rarely() -> None:
    """Regression: python-engineio logged each such body's traceback ("post request handler
    error") and the relay did not count it."""
    tries = 200
    bodies = list(UNDECODABLE_BODIES)
    async with running_relay(pings=DEFAULT_PINGS) as relay, aiohttp.ClientSession() as session:
        base = f"http://127.0.0.1:{relay.port}/socket.io/?EIO=4&transport=polling"
        async with session.get(base) as opened:
            url = f"{base}&sid={json.loads((await opened.text())[1:])['sid']}"
        by_kind: dict[str, int] = {}
        for i in range(tries):
            body = bodies[i % len(bodies)]
            async with session.post(url, data=body) as answer:
                assert answer.status == 200
            kind = UNDECODABLE_BODIES[body]
            by_kind[kind] = by_kind.get(kind, 0) + 1

        async def handled() -> bool:
            return (await relay.stats())["counts"].get("rejected_bad_packet", 0) >= tries

        await wait_until(handled, 30, "not every body was handled", interval=0.05)
        async with session.post(url, data=f"40{NS},".encode()) as answer:
            assert answer.status == 200  # the session survived every one of them
        async with session.get(url) as answer:
            assert (await answer.text()).startswith(f"40{NS},")
        stats = (await relay.stats())["counts"]
        log = relay.log()
    logged = sum(logged_occurrences(n) for n in by_kind.values())
    assert stats["rejected_bad_packet"] == tries
    assert stats["suppressed_log_records"] == tries - logged
    assert log.count("Traceback (most recent call last)") == 2 * len(by_kind)
    assert log.count("a malformed packet from a client") == 2 * logged


# frame -> the exception python-engineio raises on it, out of the ASGI app
NOT_ENGINEIO = {"x": "ValueError", "": "ValueError", "bA": "Error"}


async def test_websocket_frames_that_are_no_engineio_packets_are_counted_and_closed() -> None:
    """Regression: python-engineio raised out of the ASGI app on each such frame, uvicorn
    logged its traceback ("Exception in ASGI application"), and the connection's socket and
    browser stayed in the server until their ping timeout (45 s here)."""
    tries = 60
    frames = list(NOT_ENGINEIO)
    async with running_relay(pings=DEFAULT_PINGS) as relay, aiohttp.ClientSession() as session:
        base = await settled_sizes(relay)
        by_kind: dict[str, int] = {}
        for i in range(tries):
            async with RawSocket(session, relay.port) as raw:
                assert (await raw.connect() or "").startswith(f"40{NS},")
                await raw.send(frames[i % len(frames)])
                while await raw.receive() is not None:  # closed by the server
                    pass
            kind = NOT_ENGINEIO[frames[i % len(frames)]]
            by_kind[kind] = by_kind.get(kind, 0) + 1

        async def released() -> bool:
            now = await relay.stats()
            return bool(
                now["counts"].get("rejected_bad_packet", 0) >= tries
                and now["counts"]["browsers"] == base["counts"]["browsers"]
                and (now["eio_sockets"], now["environs"]) == (base["eio_sockets"], base["environs"])
            )

        await wait_until(released, 15, "the sockets were not released", interval=0.05)
        stats = (await relay.stats())["counts"]
        log = relay.log()
    logged = sum(logged_occurrences(n) for n in by_kind.values())
    assert stats["rejected_bad_packet"] == tries
    assert stats["suppressed_log_records"] == tries - logged
    assert "Exception in ASGI application" not in log
    assert log.count("Traceback (most recent call last)") == len(by_kind)
    assert log.count("could not decode a WebSocket frame") == logged


async def test_the_packet_guard_passes_every_other_exception_unchanged() -> None:
    """An application's own error — a ValueError from ``int("x")`` too, what python-engineio
    raises on a frame that is no packet — leaves the guard as it came."""

    async def application(scope: Any, receive: Any, send: Any) -> None:
        int("x")

    async def nothing() -> dict[str, Any]:
        return {}

    async def ignore(message: Any) -> None:
        return None

    with pytest.raises(ValueError, match="invalid literal"):
        await with_packet_guard(application)({"type": "websocket"}, nothing, ignore)


# -- in one process: which records the filter takes, and that it is installed once -------


class BoomRelay(ChatRelay):
    """A relay with an application event whose handler fails (a real error)."""

    async def on_boom(self, sid: str, data: Any = None) -> None:
        raise RuntimeError("a real bug in an application handler")


@contextlib.asynccontextmanager
async def in_process(sio: socketio.AsyncServer) -> AsyncIterator[tuple[int, aiohttp.ClientSession]]:
    async with serve_asgi(socketio.ASGIApp(sio)) as port, aiohttp.ClientSession() as session:
        yield port, session


async def test_other_records_of_the_library_loggers_pass_untouched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The filter takes only records about malformed packets: an application handler's
    error, logged by python-engineio under the very same message (the server runs events
    inline), passes every time with its traceback."""
    caplog.set_level(logging.ERROR)
    sio = socketio.AsyncServer(async_mode="asgi", async_handlers=False)
    relay = BoomRelay(SECRET, authorize_join=allow_all)
    sio.register_namespace(relay)
    async with in_process(sio) as (port, session), RawSocket(session, port) as raw:
        assert (await raw.connect() or "").startswith(f"40{NS},")
        for _ in range(5):
            await raw.send(f'42{NS},["boom"]')
            await raw.send(f"42{NS},[]")
        await raw.barrier()
    library = [r for r in caplog.records if r.name == "engineio.server"]
    booms = [r for r in library if r.exc_info and isinstance(r.exc_info[1], RuntimeError)]
    malformed = [r for r in library if "a malformed packet" in r.getMessage()]
    assert len(booms) == 5
    assert all(r.getMessage() == "message async handler error" for r in booms)
    assert len(malformed) == 3  # the 1st, 2nd and 4th
    assert [bool(r.exc_info) for r in malformed] == [True, False, False]
    assert len(library) == 8
    stats = relay.stats()
    assert (stats["rejected_bad_packet"], stats["suppressed_log_records"]) == (5, 2)


async def test_unhashable_event_names_on_a_server_with_decorator_handlers_are_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a decorator handler on ``/chat`` python-socketio looks the event name up in a
    dict before the relay sees it: an unhashable name fails its event task ("Task exception
    was never retrieved", logged by asyncio). mount_relay's filter bounds those too."""
    caplog.set_level(logging.ERROR)
    sio = socketio.AsyncServer(async_mode="asgi")

    @sio.on("typing", namespace=NS)  # type: ignore[misc]
    async def typing(sid: str, data: Any = None) -> bool:
        return True

    relay = mount_relay(sio, SECRET, authorize_join=allow_all)
    async with in_process(sio) as (port, session), RawSocket(session, port) as raw:
        assert (await raw.connect() or "").startswith(f"40{NS},")
        for i in range(10):
            await raw.send(f'42{NS},[{{"n":{i}}}]')
        await raw.barrier()
        await wait_until(lambda: relay.stats().get("rejected_bad_packet", 0) == 10)
    failed = [r for r in caplog.records if "Task exception was never retrieved" in r.msg]
    assert len(failed) == 4  # the 1st, 2nd, 4th and 8th
    assert relay.stats()["suppressed_log_records"] == 6


def test_the_filter_is_installed_once_per_logger_and_keeps_no_server_alive() -> None:
    names = ("socketio.server", "engineio.server", "asyncio")
    known_before = len(relay_hostile._RELAY_OF)
    for _ in range(50):
        create_app(SECRET, authorize_join=allow_all)
    for name in names:
        filters = logging.getLogger(name).filters
        ours = [f for f in filters if isinstance(f, relay_hostile._MalformedPacketFilter)]
        assert ours == [relay_hostile._PACKET_FILTER], name
    gc.collect()
    assert len(relay_hostile._RELAY_OF) <= known_before


async def test_a_connect_handler_that_fails_refuses_the_connection_and_leaves_nothing() -> None:
    """Any unexpected error in on_connect (here a subclass's bug) refuses the connection
    instead of leaving it half-open in python-socketio's manager."""

    class Broken(ChatRelay):
        async def on_connect(self, sid: str, environ: Any, auth: Any = None) -> bool:
            raise KeyError("a bug in a subclass")

    sio = socketio.AsyncServer(async_mode="asgi")
    relay = Broken(SECRET, authorize_join=allow_all)
    sio.register_namespace(relay)
    answers: list[str | None] = []
    async with in_process(sio) as (port, session):
        for _ in range(20):
            async with RawSocket(session, port) as raw:
                answers.append(await raw.connect())
        await wait_until(lambda: not sio.environ)
    entries = sum(len(room) for ns in sio.manager.rooms.values() for room in ns.values())
    assert set(answers) == {f'44{NS},{{"message":"unauthorized"}}'}
    assert relay.stats()["rejected_connect_error"] == 20
    assert (entries, sio.manager.pending_connect) == (0, {})
