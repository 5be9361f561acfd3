"""Catch-up abuse (issue 36): what a hostile or careless browser costs the real
``kernel-ext relay`` and the other conversations, on 127.0.0.1 (information; no target:
the bounds hold by construction and the tests check them).

One relay process (``python -m kernel_ext.relay --allow-anyone``, its defaults), one worker
(an internal python-socketio connection) that fills a conversation with a held pane of
``PANE_BYTES`` (four live streams of 16 KB blocks, no terminal), and a bystander: a browser
of another conversation that receives ``LIVE_RATE`` live blocks a second from the worker
throughout; its latency is from the worker's send to its handler (both in one process).
Then three probes, one after the other:

* **Re-join loop**: one connection joins the big conversation without ``have``, leaves and
  joins again, as fast as the acknowledgements come: the catch-up bytes it receives per byte
  it sends (the amplification factor; the compact JSON of the blocks received over the
  JSON of the join and leave events sent).
* **A reader that never reads**: a WebSocket client with a 4 KiB receive buffer joins and
  leaves the big conversation ``SLOW_JOINS`` times and reads nothing, for
  ``PROBE_SECONDS``: the relay's resident memory growth at its peak.
* **Many tabs**: ``TABS`` connections join the big conversation at once (each reads): the
  relay's resident memory growth at its peak during the probe, and after, and the seconds
  until every tab holds the whole pane.

Each probe also gives the bystander's p99 latency during it (and before any, the baseline);
the bystander runs in a process of its own, so that the probes' clients do not slow it.
Bounded: about 40 s in all. Run ``python benchmarks/run.py --only abuse``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from typing import Any

from loads import EVENT, NS, SECRET, block
from processes import ask, cpu_seconds, free_port, read_line, rss_bytes, spawn, wait_listening_async

TIMEOUT = 120.0
PROBE_SECONDS = 6.0
QUICK_PROBE_SECONDS = 3.0
STREAMS = 4
BLOCK_TEXT = 16_000
PANE_BYTES = 3_800_000
TABS = 100
SLOW_JOINS = 50
LIVE_RATE = 50
ROOM, LIVE = "abuse-big", "abuse-live"
CALL = "ab05e0000000cafe"
_SCRIPT = os.path.abspath(__file__)


def _compact(data: Any) -> int:
    return len(json.dumps(data, separators=(",", ":")))


async def _client(port: int, auth: Any = None) -> Any:
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
    """The bystander, in a process of its own (this script, ``--role bystander``): a
    browser of ``LIVE`` and a worker sending it ``LIVE_RATE`` live blocks a second; each
    ``P99`` line on stdin answers ``P99 <ms or null>`` over the blocks since the last."""
    from processes import stdin_lines

    worker = await _client(port, auth={"internal": SECRET})
    browser = await _client(port)
    latencies: list[float] = []

    def on_block(data: dict[str, Any]) -> None:
        sent = float(data["envelope"]["payload"]["text"])
        latencies.append((time.perf_counter() - sent) * 1e3)

    browser.on(EVENT, on_block, namespace=NS)
    await browser.call("join_conversation", {"conversationId": LIVE}, namespace=NS)

    async def send() -> None:
        seq = 0
        while True:
            seq += 1
            live = block(seq, repr(time.perf_counter()), "live", CALL)
            await worker.emit("kx_blocks", {"v": 1, "room": LIVE, "blocks": [live]}, namespace=NS)
            await asyncio.sleep(1 / LIVE_RATE)

    sender = asyncio.get_running_loop().create_task(send())
    print("READY", flush=True)
    reader = await stdin_lines()
    while await reader.readline():
        window = sorted(latencies)
        latencies.clear()
        p99 = window[int(len(window) * 0.99) - 1] if len(window) >= 10 else None
        print("P99 " + json.dumps(p99), flush=True)
    sender.cancel()
    await browser.disconnect()
    await worker.disconnect()


async def _fill(worker: Any) -> int:
    """The held pane: ``STREAMS`` live streams of 16 KB blocks, ``PANE_BYTES`` in all."""
    per_stream = PANE_BYTES // STREAMS // (BLOCK_TEXT + 200)
    for stream in range(STREAMS):
        blocks = [
            block(seq, "x" * BLOCK_TEXT, f"task-{stream}", CALL) for seq in range(1, per_stream + 1)
        ]
        for start in range(0, len(blocks), 16):
            frame = {"v": 1, "room": ROOM, "blocks": blocks[start : start + 16]}
            await worker.call("kx_blocks", frame, namespace=NS, timeout=30)
    return per_stream * STREAMS


async def rejoin_loop(port: int, seconds: float) -> tuple[float, int]:
    """The amplification factor of one connection's leave/join loop, and its joins."""
    client = await _client(port)
    received = 0

    def on_block(data: dict[str, Any]) -> None:
        nonlocal received
        received += _compact(data)

    client.on(EVENT, on_block, namespace=NS)
    sent = joins = 0
    join = ["join_conversation", {"conversationId": ROOM}]
    leave = ["leave_conversation", {"conversationId": ROOM}]
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            await client.call(*join, namespace=NS, timeout=60)
            await client.call(*leave, namespace=NS, timeout=60)
            sent += _compact(join) + _compact(leave)
            joins += 1
    finally:
        await client.disconnect()
    return received / sent, joins


async def many_tabs(port: int, pid: int, blocks: int) -> tuple[int, int, float]:
    """Relay memory growth at its peak and after ``TABS`` tabs joined at once, and the
    seconds until every tab held the whole pane."""
    before = rss_bytes(pid)
    peak = before
    tabs = [await _client(port) for _ in range(TABS)]
    counts = [0] * TABS
    for index, tab in enumerate(tabs):

        def on_block(data: dict[str, Any], index: int = index) -> None:
            counts[index] += 1

        tab.on(EVENT, on_block, namespace=NS)
    start = time.monotonic()
    joins = asyncio.gather(
        *(
            tab.call("join_conversation", {"conversationId": ROOM}, namespace=NS, timeout=120)
            for tab in tabs
        )
    )
    while not joins.done() or min(counts) < blocks:
        peak = max(peak, rss_bytes(pid))
        await asyncio.sleep(0.05)  # sampling the relay's memory
    caught_up = time.monotonic() - start
    await joins
    for tab in tabs:
        await tab.disconnect()
    return peak - before, rss_bytes(pid) - before, caught_up


async def never_reads(port: int, pid: int, seconds: float) -> int:
    """Relay memory growth while a client that never reads joins and leaves."""
    from websockets.asyncio.client import connect

    before = rss_bytes(pid)
    peak = before
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    url = f"ws://127.0.0.1:{port}/socket.io/?EIO=4&transport=websocket"
    ws = await connect(url, sock=sock, max_queue=1, ping_interval=None, compression=None)
    try:
        await ws.recv()
        await ws.send(f"40{NS},{{}}")
        await ws.recv()
        for n in range(SLOW_JOINS):
            join = json.dumps(["join_conversation", {"conversationId": ROOM}])
            await ws.send(f"42{NS},{2 * n + 1}{join}")
            leave = json.dumps(["leave_conversation", {"conversationId": ROOM}])
            await ws.send(f"42{NS},{2 * n + 2}{leave}")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            peak = max(peak, rss_bytes(pid))
            await asyncio.sleep(0.05)  # sampling the relay's memory
    finally:
        ws.transport.abort()
    return peak - before


async def measure(quick: bool) -> dict[str, Any]:
    seconds = QUICK_PROBE_SECONDS if quick else PROBE_SECONDS
    port = free_port()
    env = dict(os.environ, KERNEL_EXT_SECRET=SECRET)
    relay = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kernel_ext.relay",
        "--port",
        str(port),
        "--allow-anyone",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    procs = [relay]
    found: dict[str, Any] = {}
    try:
        await wait_listening_async(port, process=relay, what="relay", timeout=30)
        worker = await _client(port, auth={"internal": SECRET})
        blocks = await _fill(worker)
        bystander = await spawn(
            _SCRIPT,
            "--role",
            "bystander",
            "--port",
            str(port),
            stdin=asyncio.subprocess.PIPE,
        )
        procs.append(bystander)
        await read_line(bystander, "READY", 30)

        async def p99() -> float | None:
            value: float | None = json.loads(await ask(bystander, "P99", "P99", 60))
            return value

        await asyncio.sleep(seconds / 2)  # the baseline's window
        found["baseline_p99"] = await p99()
        found["amplification"], found["rejoins"] = await rejoin_loop(port, seconds)
        found["rejoin_p99"] = await p99()
        found["slow_growth"] = await never_reads(port, relay.pid, seconds)
        found["slow_p99"] = await p99()
        cpu = cpu_seconds(relay.pid)
        found["tabs_peak"], found["tabs_after"], found["tabs_seconds"] = await many_tabs(
            port, relay.pid, blocks
        )
        found["tabs_cpu"] = cpu_seconds(relay.pid) - cpu
        found["tabs_p99"] = await p99()
        await worker.disconnect()
    finally:
        for proc in reversed(procs):
            if proc is not relay and proc.stdin is not None:
                proc.stdin.close()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), 10)
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    return found


def run(quick: bool = False) -> list[dict[str, Any]]:
    found = asyncio.run(measure(quick))
    mib = 1 << 20

    def p99(key: str) -> str:
        value = found[key]
        return "n/a" if value is None else f"{value:.1f} ms"

    def figure(name: str, value: Any, unit: str, detail: str) -> dict[str, Any]:
        return {
            "name": f"abuse: {name}",
            "value": value,
            "unit": unit,
            "target": None,
            "ok": None,
            "detail": detail,
            "profile": False,
        }

    return [
        figure(
            "re-join loop without have, bytes sent per byte received",
            round(found["amplification"], 1),
            "×",
            f"{found['rejoins']} joins of a {PANE_BYTES / mib:.1f} MiB pane in the probe; "
            f"bystander p99 {p99('rejoin_p99')} (baseline {p99('baseline_p99')})",
        ),
        figure(
            f"{TABS} tabs joining at once, relay memory growth at the peak",
            round(found["tabs_peak"] / mib, 1),
            "MiB",
            f"{found['tabs_after'] / mib:.1f} MiB after; every tab caught up in "
            f"{found['tabs_seconds']:.1f} s, the relay busy {found['tabs_cpu']:.1f} s of CPU "
            f"meanwhile; bystander p99 {p99('tabs_p99')}",
        ),
        figure(
            f"a reader that never reads, {SLOW_JOINS} joins: relay memory growth",
            round(found["slow_growth"] / mib, 1),
            "MiB",
            f"bystander p99 {p99('slow_p99')}",
        ),
    ]


if __name__ == "__main__":
    if "--role" in sys.argv:
        asyncio.run(role_bystander(int(sys.argv[sys.argv.index("--port") + 1])))
    else:
        for line in run("--quick" in sys.argv):
            print(json.dumps(line))
