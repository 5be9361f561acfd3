"""Abuse (issue 36): what one hostile or careless signed-in user costs the real relay and
the other conversations, on 127.0.0.1 — each probe twice, side by side in one run: with the
relay's bounds (its defaults) and with the bounds relaxed through the relay's options to
their old unbounded behaviour ("bounds off": no per-browser queue bound, no catch-up budget,
no bound in flight, no admission caps, no handshake turnstile, CPython's garbage collector
as is; the named options are in :data:`BOUNDS_OFF`).

One relay process per mode (``create_app`` served as ``kernel-ext relay`` serves it, by the
command's own :func:`kernel_ext.cli.relay.serve`, its garbage-collector tuning included; an
``authenticate`` hook whose identity is the browser's ``token``), filled by a worker
with a held pane of ``PANE_BYTES`` (four live streams of 16 KB blocks). A bystander — a
browser of another conversation with its own token — and the worker that sends it
``LIVE_RATE`` live blocks a second run in a process of their own, so that the attackers'
clients do not slow them; its latency is from the worker's send to its handler
(``time.monotonic``, one clock for the machine). The attackers are raw WebSocket clients
(the Engine.IO handshake, then bytes counted and discarded: no JSON parsed), so that the
load generator costs little next to the relay. The probes, one after the other:

* **(a) leave/join loop**: one connection joins the big conversation without ``have``,
  leaves and joins again, as fast as the acknowledgements come;
* **(b) tabs of one token**: ``TABS`` connections of one token connect and join the big
  conversation within a second, each reading;
* **(c) a reader that never reads**: a client with a 4 KiB receive buffer joins and leaves
  the big conversation ``SLOW_JOINS`` times and reads nothing;
* **(d) idle connections and pipelined joins**: ``IDLE`` connections of one token that do
  nothing, and ``PIPELINED`` joins of distinct conversations written at once on one more;
* **(e) integers of over 100 digits**: ``BIG_PACKETS`` packets each holding one, on one
  connection — the relay's log lines are counted.

For each: the amplification factor (wire bytes the attacker received per byte it sent), the
relay's resident memory growth at the peak of the probe over its value before it, and the
bystander's p99 during the probe. Each probe lasts ``PROBE_SECONDS`` at most (the
connections are closed at its end), against a relay of its own. The relay also reports how
late its event loop ran (the most a 10 ms sleep overshot, and the CPU its thread used over
that sleep: close to the overshoot, the loop was held by work; far below it, the relay
waited for a core), which tells a relay that holds its loop from a
machine that is short of cores. Bounded: about 60–90 s in all.

Diagnosis (not used by ``tox -e bench``): ``ABUSE_RELAY_OPTIONS='{"catch_up_inflight_bytes":
1048576}'`` passes relay options, ``ABUSE_GC_THRESHOLD=N`` sets the relay's
``--gc-threshold``, ``ABUSE_SLOW_CALLBACKS=1`` turns on asyncio's debug mode in the relay and
prints what held its loop over 30 ms.
Run ``python benchmarks/run.py --only abuse``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import socket
import sys
import time
from typing import Any

from loads import EVENT, NS, SECRET, block
from processes import (
    ask,
    end_processes,
    free_port,
    read_line,
    rss_bytes,
    spawn,
    wait_listening_async,
)

PROBE_SECONDS = 4.0
QUICK_PROBE_SECONDS = 2.5
STREAMS = 4
BLOCK_TEXT = 16_000
PANE_BYTES = 3_800_000
TABS = 300
SLOW_JOINS = 50
IDLE = 2_000
PIPELINED = 10_000
BIG_PACKETS = 1_000
LIVE_RATE = 10
BASELINE_SECONDS = 1.0
PER_STREAM = PANE_BYTES // STREAMS // (BLOCK_TEXT + 200)
WHOLE = PER_STREAM * STREAMS * BLOCK_TEXT
"""Bytes a tab has received when it holds the whole pane (the blocks' text alone)."""
ROOM, LIVE = "abuse-big", "abuse-live"
CALL = "ab05e0000000cafe"
BOUNDS_OFF: dict[str, Any] = {
    "browser_queue_max": None,
    "browser_queue_bytes": None,
    "browser_stall_timeout": None,
    "catch_up_inflight_bytes": 1 << 40,
    "catch_up_budget": None,
    "max_browsers": None,
    "max_per_identity": None,
    "max_browser_rooms": None,
    "join_rate": None,
    "max_handshakes": None,
}
"""The relay options of the "bounds off" run: each new bound relaxed to unbounded."""
_SCRIPT = os.path.abspath(__file__)


def token_identity(auth: Any, environ: Any) -> Any:
    """The bench relay's ``authenticate`` hook: the browser's ``token`` is its identity."""
    if isinstance(auth, dict) and isinstance(auth.get("token"), str):
        return auth["token"]
    return None


def role_relay(port: int, mode: str) -> None:
    """The relay under test, in a process of its own (``--role relay``), started as
    ``kernel-ext relay`` starts it (:func:`kernel_ext.cli.relay.serve`: its logging, uvicorn,
    its garbage-collector tuning at ``--gc-threshold``'s default; none with the bounds off,
    as before it); every quarter of a second it prints ``LAG <ms> <ms>``: the most its event
    loop was late over that quarter (a 10 ms sleep's overshoot) and the CPU its thread used
    in that turn, so that a slow bystander can be told from a held loop."""
    from kernel_ext.cli._common import listen
    from kernel_ext.cli.relay import DEFAULT_GC_THRESHOLD, serve
    from kernel_ext.relay import allow_all, create_app
    from kernel_ext.relay._log import log_as_command

    options = dict(BOUNDS_OFF) if mode == "off" else {}
    options.update(json.loads(os.environ.get("ABUSE_RELAY_OPTIONS", "{}")))  # experiments
    gc_threshold = 0 if mode == "off" else DEFAULT_GC_THRESHOLD
    gc_threshold = int(os.environ.get("ABUSE_GC_THRESHOLD", gc_threshold))  # experiments
    log_as_command("relay", "warning")
    ready = create_app(SECRET, authenticate=token_identity, authorize_join=allow_all, **options)
    tasks: list[asyncio.Task[None]] = []

    async def lag() -> None:
        worst = [0.0, 0.0]
        since = time.monotonic()
        while True:
            start, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(0.01)  # the loop's lag is this sleep's overshoot
            late = (time.monotonic() - start - 0.01) * 1e3
            if late > worst[0]:
                # How much of it the loop spent working (the rest: the OS ran others).
                worst = [late, (time.thread_time() - cpu) * 1e3]
            if time.monotonic() - since >= 0.25:
                print(f"LAG {worst[0]:.1f} {worst[1]:.1f}", flush=True)
                worst, since = [0.0, 0.0], time.monotonic()

    async def announce() -> None:
        tasks.append(asyncio.get_running_loop().create_task(lag()))
        if os.environ.get("ABUSE_SLOW_CALLBACKS"):  # a diagnosis: name what holds the loop
            asyncio.get_running_loop().set_debug(True)
            asyncio.get_running_loop().slow_callback_duration = 0.03

    with listen("127.0.0.1", port) as sock:
        serve(ready.app, sock, "warning", announce, gc_threshold)


async def _client(port: int, auth: Any) -> Any:
    import socketio

    client = socketio.AsyncClient(reconnection=False)
    await client.connect(
        f"http://127.0.0.1:{port}",
        namespaces=[NS],
        auth=auth,
        transports=["websocket"],
        wait_timeout=10,
    )
    return client


async def role_bystander(port: int) -> None:
    """The bystander and its worker, in a process of their own (``--role bystander``): a
    browser of ``LIVE`` and a worker sending it ``LIVE_RATE`` live blocks a second; each
    ``P99`` line on stdin answers ``P99 [<ms or null>, <blocks>, <in order>]`` over the
    blocks since the last."""
    from processes import stdin_lines

    worker = await _client(port, {"internal": SECRET})
    browser = await _client(port, {"token": "bystander"})
    latencies: dict[int, float] = {}
    order = [0, True]  # the last seq received, and whether every one came in order
    sent = [0]
    arrived = asyncio.Event()

    def on_block(data: dict[str, Any]) -> None:
        envelope = data["envelope"]
        latencies[envelope["seq"]] = (time.monotonic() - float(envelope["payload"]["text"])) * 1e3
        order[1] = order[1] and envelope["seq"] == order[0] + 1
        order[0] = envelope["seq"]
        arrived.set()

    browser.on(EVENT, on_block, namespace=NS)
    await browser.call("join_conversation", {"conversationId": LIVE}, namespace=NS)

    async def send() -> None:
        while True:
            sent[0] += 1
            live = block(sent[0], repr(time.monotonic()), "live", CALL)
            await worker.emit("kx_blocks", {"v": 1, "room": LIVE, "blocks": [live]}, namespace=NS)
            await asyncio.sleep(1 / LIVE_RATE)

    sender = asyncio.get_running_loop().create_task(send())
    print("READY", flush=True)
    reader = await stdin_lines()
    done = 0
    while await reader.readline():
        target = sent[0]  # the window: every block sent since the last question
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(60):
                while order[0] < target:
                    arrived.clear()
                    await arrived.wait()
        window = sorted(latencies.get(seq, math.inf) for seq in range(done + 1, target + 1))
        done = target
        p99 = window[max(0, math.ceil(len(window) * 0.99) - 1)] if window else None
        p99 = None if p99 is None or math.isinf(p99) else p99
        print("P99 " + json.dumps([p99, len(window), order[1]]), flush=True)
        order[1] = True
    sender.cancel()
    await browser.disconnect()
    await worker.disconnect()


class Raw:
    """A raw Socket.IO-over-WebSocket client: sends masked text frames, counts the bytes
    it writes and reads; reads frames only when asked (the handshake, acknowledgements),
    otherwise discards what arrives unparsed."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.drain: asyncio.Task[None] | None = None

    async def open(self, port: int, token: str, rcvbuf: int | None = None) -> bool:
        """Connect and enter the namespace; ``False`` when the relay refused."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        self.reader, self.writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            "GET /socket.io/?EIO=4&transport=websocket HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
        self.writer.write(request)
        self.sent += len(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        self.received += len(head)
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            return False
        await self.frame()  # the Engine.IO open packet
        self.send(f"40{NS}," + json.dumps({"token": token}))
        return (await self.frame()).startswith(f"40{NS},")

    def send(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        head = bytes([0x81]) + (
            bytes([0x80 | n])
            if n < 126
            else bytes([0x80 | 126]) + n.to_bytes(2, "big")
            if n < 65536
            else bytes([0x80 | 127]) + n.to_bytes(8, "big")
        )
        frame = head + b"\0\0\0\0" + data  # a zero mask: the payload as is
        assert self.writer is not None
        self.writer.write(frame)
        self.sent += len(frame)

    async def frame(self) -> str:
        """The next text frame."""
        assert self.reader is not None
        head = await self.reader.readexactly(2)
        n = head[1] & 0x7F
        extra = b""
        if n == 126:
            extra = await self.reader.readexactly(2)
        elif n == 127:
            extra = await self.reader.readexactly(8)
        if extra:
            n = int.from_bytes(extra, "big")
        payload = await self.reader.readexactly(n)
        self.received += 2 + len(extra) + n
        return payload.decode()

    def discard(self) -> None:
        """Read and count whatever arrives from now on, unparsed."""

        async def drain() -> None:
            assert self.reader is not None
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while data := await self.reader.read(1 << 16):
                    self.received += len(data)

        self.drain = asyncio.get_running_loop().create_task(drain())

    def close(self) -> None:
        if self.drain is not None:
            self.drain.cancel()
        if self.writer is not None:
            self.writer.transport.abort()


def _join(ack: int, room: str) -> str:
    return f"42{NS},{ack}" + json.dumps(["join_conversation", {"conversationId": room}])


def _leave(ack: int, room: str) -> str:
    return f"42{NS},{ack}" + json.dumps(["leave_conversation", {"conversationId": room}])


class Sampler:
    """The relay's resident memory, sampled every 50 ms until stopped: its peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = self.peak = rss_bytes(pid)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes(self.pid))
            await asyncio.sleep(0.05)  # sampling the relay's memory

    def stop(self) -> int:
        self.task.cancel()
        self.peak = max(self.peak, rss_bytes(self.pid))
        return self.peak - self.before


async def probe_rejoin(port: int, seconds: float) -> dict[str, Any]:
    raw = Raw()
    await raw.open(port, "a")
    joins = limited = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            raw.send(_join(1, ROOM))
            while not (ack := await raw.frame()).startswith(f"43{NS},1"):
                pass
            limited += '"limited":true' in ack
            raw.send(_leave(2, ROOM))
            while not (await raw.frame()).startswith(f"43{NS},2"):
                pass
            joins += 1
    finally:
        raw.close()
    return {"raw": [raw], "detail": f"{joins} joins, {limited} acknowledged limited"}


async def probe_tabs(port: int, seconds: float) -> dict[str, Any]:
    tabs = [Raw() for _ in range(TABS)]
    deadline = time.monotonic() + seconds

    async def tab(raw: Raw) -> bool:
        if not await raw.open(port, "b"):
            return False
        raw.send(_join(1, ROOM))
        raw.discard()
        return True

    admitted = sum(await asyncio.gather(*(tab(raw) for raw in tabs)))
    whole = 0
    while time.monotonic() < deadline:
        whole = sum(raw.received >= WHOLE for raw in tabs)
        if whole >= admitted:
            break
        await asyncio.sleep(0.05)  # polling the tabs' byte counts
    for raw in tabs:
        raw.close()
    return {
        "raw": tabs,
        "detail": f"{admitted} of {TABS} admitted, {whole} with the whole pane within the probe",
    }


async def probe_never_reads(port: int, seconds: float) -> dict[str, Any]:
    raw = Raw()
    await raw.open(port, "c", rcvbuf=4096)
    for n in range(SLOW_JOINS):
        raw.send(_join(2 * n + 1, ROOM))
        raw.send(_leave(2 * n + 2, ROOM))
    await asyncio.sleep(seconds)  # the probe's window: it reads nothing
    raw.close()
    return {"raw": [raw], "detail": f"{SLOW_JOINS} joins, nothing read"}


async def probe_idle_and_pipelined(port: int, seconds: float) -> dict[str, Any]:
    idle = [Raw() for _ in range(IDLE)]
    admitted = 0
    for start in range(0, IDLE, 100):
        batch = idle[start : start + 100]
        admitted += sum(await asyncio.gather(*(raw.open(port, "d") for raw in batch)))
    pipe = Raw()
    await pipe.open(port, "d2")
    for n in range(PIPELINED):
        pipe.send(_join(n + 1, f"pipelined-{n}"))
    ok = acks = 0
    deadline = time.monotonic() + seconds
    with contextlib.suppress(asyncio.TimeoutError):
        while acks < PIPELINED:
            frame = await asyncio.wait_for(pipe.frame(), max(0.01, deadline - time.monotonic()))
            if frame.startswith(f"43{NS},"):
                acks += 1
                ok += '"ok":true' in frame
    for raw in [*idle, pipe]:
        raw.close()
    return {
        "raw": [*idle, pipe],
        "detail": f"{admitted} of {IDLE} idle connections admitted; "
        f"{ok} of {PIPELINED} pipelined joins admitted ({acks} acknowledged)",
    }


async def probe_big_integers(port: int, seconds: float, log: list[int]) -> dict[str, Any]:
    big = "9" * 101
    raw = Raw()
    await raw.open(port, "e")
    lines = log[0]
    for n in range(BIG_PACKETS):
        raw.send(f'42{NS},["join_conversation",{{"conversationId":{big}}}]')
        if n % 100 == 99:
            await raw.writer.drain()  # type: ignore[union-attr]
    raw.send(_join(1, "e-last"))  # a barrier: its acknowledgement comes after them all
    with contextlib.suppress(asyncio.TimeoutError):
        async with asyncio.timeout(seconds):
            while not (await raw.frame()).startswith(f"43{NS},1"):
                pass
    await asyncio.sleep(0.2)  # the log lines' way to the pipe
    raw.close()
    return {"raw": [raw], "detail": f"{BIG_PACKETS} packets, {log[0] - lines} log lines"}


async def measure(mode: str, name: str, quick: bool) -> dict[str, Any]:
    """One probe against a relay of its own (``mode`` ``on`` or ``off``), so that what one
    probe leaves behind (memory kept by the allocator, queues still draining) does not
    count against the next."""
    seconds = QUICK_PROBE_SECONDS if quick else PROBE_SECONDS
    port = free_port()
    env = dict(os.environ, KERNEL_EXT_SECRET=SECRET)
    relay = await asyncio.create_subprocess_exec(
        sys.executable,
        _SCRIPT,
        "--role",
        "relay",
        "--port",
        str(port),
        "--mode",
        mode,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    log = [0]

    async def count_log() -> None:
        assert relay.stderr is not None
        while line := await relay.stderr.readline():
            log[0] += 1
            if os.environ.get("ABUSE_SLOW_CALLBACKS"):
                sys.stderr.write(line.decode(errors="replace"))

    lags: list[tuple[float, float, float]] = []

    async def read_lags() -> None:
        assert relay.stdout is not None
        while line := await relay.stdout.readline():
            if line.startswith(b"LAG "):
                _, late, busy = line.split()
                lags.append((time.monotonic(), float(late), float(busy)))

    counter = asyncio.get_running_loop().create_task(count_log())
    lagger = asyncio.get_running_loop().create_task(read_lags())
    procs = [relay]
    try:
        await wait_listening_async(port, process=relay, what="relay", timeout=30)
        worker = await _client(port, {"internal": SECRET})
        for stream in range(STREAMS):
            blocks = [
                block(seq, "x" * BLOCK_TEXT, f"task-{stream}", CALL)
                for seq in range(1, PER_STREAM + 1)
            ]
            for start in range(0, len(blocks), 16):
                frame = {"v": 1, "room": ROOM, "blocks": blocks[start : start + 16]}
                await worker.call("kx_blocks", frame, namespace=NS, timeout=30)
        bystander = await spawn(
            _SCRIPT, "--role", "bystander", "--port", str(port), stdin=asyncio.subprocess.PIPE
        )
        procs.append(bystander)
        await read_line(bystander, "READY", 30)

        async def window() -> list[Any]:
            answer: list[Any] = json.loads(await ask(bystander, "P99", "P99", 60))
            return answer

        await asyncio.sleep(BASELINE_SECONDS)  # the baseline's window
        baseline_p99 = (await window())[0]
        probes = {
            "a": lambda: probe_rejoin(port, seconds),
            "b": lambda: probe_tabs(port, seconds),
            "c": lambda: probe_never_reads(port, seconds),
            "d": lambda: probe_idle_and_pipelined(port, seconds),
            "e": lambda: probe_big_integers(port, seconds, log),
        }
        sampler = Sampler(relay.pid)
        began = time.monotonic()
        result = await probes[name]()
        result["growth"] = sampler.stop()
        result["baseline_rss"] = sampler.before
        sent = sum(raw.sent for raw in result["raw"])
        result["amplification"] = sum(raw.received for raw in result["raw"]) / sent
        del result["raw"]
        result["p99"], result["live"], result["in_order"] = await window()
        result["baseline_p99"] = baseline_p99
        result["lag"] = max(((late, busy) for at, late, busy in lags if at >= began), default=None)
        await worker.disconnect()
    finally:
        await end_processes(procs, [proc for proc in procs if proc is not relay])
        counter.cancel()
        lagger.cancel()
    return result


PROBES = {
    "a": f"(a) leave/join loop without have, a {PANE_BYTES / (1 << 20):.1f} MiB pane",
    "b": f"(b) {TABS} tabs of one token joining it within a second",
    "c": f"(c) a 4 KiB reader that never reads, {SLOW_JOINS} joins",
    "d": f"(d) {IDLE:,} idle connections of one token, {PIPELINED:,} pipelined joins",
    "e": f"(e) {BIG_PACKETS:,} packets with an integer of over 100 digits",
}


def run(quick: bool = False) -> list[dict[str, Any]]:
    mib = 1 << 20

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f} ms"

    def lag(value: tuple[float, float] | None) -> str:
        return (
            "n/a" if value is None else f"{value[0]:.0f} ms ({value[1]:.0f} ms of CPU in that turn)"
        )

    def summary(found: dict[str, Any]) -> str:
        return (
            f"{found['amplification']:.1f}× / {found['growth'] / mib:.1f} MiB / {ms(found['p99'])}"
        )

    rows = []
    for key, title in PROBES.items():
        before = asyncio.run(measure("off", key, quick))
        after = asyncio.run(measure("on", key, quick))
        rows.append(
            {
                "name": f"abuse: {title}",
                "value": summary(after),
                "unit": "",
                "target": None,
                "ok": None,
                "detail": f"bounds off: {summary(before)}, {before['detail']}; bounds on: "
                f"{after['detail']}; the bystander got {after['live']} live blocks"
                f"{' in order' if after['in_order'] else ', OUT OF ORDER'} (p99 before the "
                f"probe {ms(after['baseline_p99'])}); the relay's event loop late by at most "
                f"{lag(after['lag'])} (bounds off: {lag(before['lag'])}); its RSS before "
                f"{after['baseline_rss'] / mib:.0f} MiB",
                "profile": False,
            }
        )
    return rows


if __name__ == "__main__":
    if "--role" in sys.argv:
        role = sys.argv[sys.argv.index("--role") + 1]
        port = int(sys.argv[sys.argv.index("--port") + 1])
        if role == "relay":
            role_relay(port, sys.argv[sys.argv.index("--mode") + 1])
        else:
            asyncio.run(role_bystander(port))
    else:
        for line in run("--quick" in sys.argv):
            print(json.dumps(line, ensure_ascii=False))
