"""Scale: how the relay's cost grows with browsers, conversations, web processes and tool
calls (issue 17), each point measured side by side with a plain python-socketio relay.

Run: ``python benchmarks/bench_scale.py [--quick] [--curves scaleout,...]`` (all four curves
unless named). Every point starts real processes on
127.0.0.1: the relay (uvicorn), one or more *browser* processes hosting python-socketio
``AsyncClient`` s (one per browser tab, each joined to its conversation's room, as the web
page's Socket.IO client would be), one worker process and, for the scale-out curve, a real
``redis-server``. The *plain* contender is the relay of ``bench_stream.py``: python-socketio
with one ``emit`` per message to the room and no validation; its worker emits one event per
block (through a python-socketio client, or through a write-only ``AsyncRedisManager``).
kernel_ext's side is the library as shipped: ``StreamHub`` + ``LoopbackEmitter`` (or
``RedisEmitter``) in the worker, ``create_app``'s relay validating every block.

Two loads per point, on the same connected browsers:

* **paced**: every stream publishes 10 running blocks/s (the T4 limit; the throttle itself is
  off so that pacing jitter drops nothing, as in ``bench_stream.py``) for ``SECONDS`` s, in
  10 ms ticks (a full run: long enough for 3,000 deliveries, at most 30 s, so that no p99
  is the maximum of a few hundred). Latency is taken from the time the schedule produced
  the block to the browser's handler (the time travels in the block's text); p50/p99 over
  every delivery.
  A sender whose publish (plain: ``emit``) blocks the producer and falls behind the
  schedule pays for the wait: its blocks are not stamped late (no coordinated omission).
  Blocks still missing ``DRAIN`` s after the worker has handed the whole load to its
  transport count as not delivered. The relay's resident memory is read idle, with the
  browsers connected, and at the end of the load (streams live; deliveries still queued in
  the relay count too, so under saturation this is mostly backlog).
* Each load starts once the relays are idle again (under 5 % of a core) and the browsers
  receive nothing more, so a saturating load's backlog is not counted in the next.
* **burst**: the worker publishes ``N`` blocks round-robin over the streams as fast as it
  can; delivered blocks/s counted at the browsers from the first publish to the last
  delivery (a full run: three bursts, the median kept). This is the capacity figure the
  ≥ 1.0× throughput ratio is held against. The relay's CPU time (user + system) over it,
  divided by the deliveries, is its CPU per delivered block.

The curves: (1) fan-out — one conversation, 10 streams, watched by 1–200 browsers;
(2) breadth — 1–5,000 conversations with one stream and one browser each (the offered load
grows with them, up to and past saturation; what decides the largest point, profiled, is
named in docs/operations.md, "Where it saturates first"); (3) scale-out — 1,000 conversations, one
browser each, through one web process without Redis, through 1, 2 and 4 web processes behind
one ``redis-server`` with the worker on the ``RedisEmitter`` path (the web-process curve:
each web process has an even share of the conversations' browsers; kernel_ext's web
processes run ``RelayRedisManager``, which routes each room's blocks to the web processes
with a browser in it, the plain relay python-socketio's ``AsyncRedisManager``, which sends
every block to every web process, and its worker a write-only one), and through two behind
Redis with the worker looping back into one. Over each burst the CPU time (user + system)
of every web process is summed, and it and redis-server's are divided by the
delivered blocks; kernel_ext's sum at 2 and 4 web processes is held to 1.2× its own at one
(issue 25), the plain relay's growth is reported beside it; (4) workers — one worker
with 10–1,000 concurrent tool calls at 10 blocks/s each: its CPU share, and the hub's memory
per live call (``tracemalloc``, in process). On a 2-core machine the browsers, the worker and
the relay share the cores, so beyond a few thousand deliveries per second every side is
saturated at once; the plots and the capacity guide say which saturates first.

Every point's ratio is held against the plain relay: throughput ≥ 1.0×, p99 ≤ 1.5×. Plots are
written with matplotlib (the ``bench`` extra) beside the report.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import contextvars
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_stream import (
    _free_port,
    _line,
    _stdin_lines,
    _wait_port,
    cpu_seconds,
    plain_relay_app,
    rss_bytes,
)
from bench_stream import _spawn as _spawn_script

SECRET = "bench-internal-secret"
NS = "/chat"
EVENT = "tool_event_stream"
RATE = 10  # blocks/s per stream
SECONDS = 3.0
# A full run paces each point long enough for a p99 over at least MIN_PACED_DELIVERIES
# deliveries (3 s of 10 streams to one browser is 300: its p99 is the third-largest value),
# for at most MAX_SECONDS.
MIN_PACED_DELIVERIES = 3_000
MAX_SECONDS = 30.0
# A full run repeats each burst and keeps the median (single bursts of a shared 2-core
# machine swung 0.88-1.42x between runs at one point).
BURST_REPEATS = 3
DRAIN = 8.0
CONNECT_BATCH = 50
PROCESS_TIMEOUT = 180.0
QUICK = os.environ.get("KERNEL_EXT_BENCH_QUICK") == "1"
PLOT_DIR_ENV = "KERNEL_EXT_BENCH_PLOTS"
# the runner: a longer limit than the other modules (many processes per point)
TIMEOUT = 1_800.0

FANOUT = (1, 10, 50, 200)
BREADTH = (1, 100, 1_000, 5_000)
SCALE_OUT_ROOMS = 1_000
WORKER_CALLS = (10, 100, 1_000)
QUICK_FANOUT = (1, 10)
QUICK_BREADTH = (1, 100)
QUICK_SCALE_OUT_ROOMS = 100
QUICK_WORKER_CALLS = (10, 100)
ONE_LOOPBACK = "1 web process, loopback, no Redis"
ONE_REDIS = "1 web process + Redis, RedisEmitter"
TWO_REDIS = "2 web processes + Redis, RedisEmitter"
FOUR_REDIS = "4 web processes + Redis, RedisEmitter"
TWO_LOOPBACK = "2 web processes + Redis, loopback into one"
# The web-process curve: N web processes behind one redis-server, the worker on the
# RedisEmitter path, the same browsers and conversations spread evenly over them.
WEB_PROCESSES = {1: ONE_REDIS, 2: TWO_REDIS, 4: FOUR_REDIS}
CURVES = ("fanout", "breadth", "scaleout", "workers")
THROUGHPUT_TARGET = 1.0
P99_TARGET = 1.5
# kernel_ext's sum of the web processes' CPU per delivered block at 2 and 4 web processes,
# against its own at one (issue 25): room-routed fan-out keeps it flat.
WEB_CPU_TARGET = 1.2


# ---------------------------------------------------------------------------------------
# Roles (each a child process of this script)
# ---------------------------------------------------------------------------------------


def role_relay(kind: str, port: int, redis_url: str | None) -> None:
    import uvicorn

    if kind == "kx":
        from kernel_ext.relay import allow_all, create_app

        app = create_app(SECRET, authorize_join=allow_all, redis_url=redis_url).app
    else:
        app = plain_relay_app(redis_url)
    profile = os.environ.get("KX_BENCH_PROFILE")  # a path: cProfile the relay (debugging)
    if profile:
        import cProfile
        import signal

        profiler = cProfile.Profile()
        signal.signal(signal.SIGUSR1, lambda *_: profiler.dump_stats(f"{profile}.{kind}.{port}"))
        profiler.enable()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")


async def role_browsers(ports: list[int], rooms: list[str], per_room: int) -> None:
    """Connect ``per_room`` clients to each room (round-robin over the web processes), say
    ``READY`` with how many are connected to each web process, then answer ``MARK`` (start
    counting afresh), ``COUNT`` and ``REPORT`` lines on stdin."""
    import socketio

    state = {"count": 0, "first": 0, "last": 0, "mark": 0}
    latencies = array.array("q")

    def on_block(block: dict[str, Any]) -> None:
        if block.get("state") != "running":
            return  # the worker's closing terminals are not part of the load
        now = time.time_ns()
        published = int(block["envelope"]["payload"]["text"].split(" ", 1)[0])
        if published < state["mark"]:
            return  # a straggler of an earlier load
        if not state["count"]:
            state["first"] = now
        state["count"] += 1
        state["last"] = now
        latencies.append(now - published)

    clients: list[Any] = []
    per_port = [0] * len(ports)

    async def one(index: int, room: str) -> None:
        client = socketio.AsyncClient(reconnection=False)
        client.on(EVENT, on_block, namespace=NS)
        port = ports[index % len(ports)]
        per_port[index % len(ports)] += 1
        await client.connect(
            f"http://127.0.0.1:{port}", namespaces=[NS], transports=["websocket"], wait_timeout=30
        )
        ack = await client.call("join_conversation", {"conversationId": room}, namespace=NS)
        assert ack == {"ok": True}, ack
        clients.append(client)

    wanted = [(i, room) for i, room in enumerate(r for r in rooms for _ in range(per_room))]
    for start in range(0, len(wanted), CONNECT_BATCH):
        await asyncio.gather(*(one(i, room) for i, room in wanted[start : start + CONNECT_BATCH]))
    print(f"READY {json.dumps(per_port)}", flush=True)
    reader = await _stdin_lines()
    while line := (await reader.readline()).decode().strip():
        if line == "MARK":
            state.update(count=0, first=0, last=0, mark=time.time_ns())
            del latencies[:]
            print("MARKED", flush=True)
        elif line == "COUNT":
            print(f"COUNT {state['count']}", flush=True)
        elif line == "REPORT":
            ordered = sorted(latencies)
            # 1,000 quantiles are enough to merge the processes' latencies
            step = max(1, len(ordered) // 1000)
            print("RESULT " + json.dumps({**state, "latencies": ordered[::step]}), flush=True)
        elif line == "QUIT":
            break
    await asyncio.gather(*(c.disconnect() for c in clients), return_exceptions=True)


def _block(seq: int, text: str, task: str, call_id: str, state: str = "running") -> dict[str, Any]:
    return {
        "v": 1,
        "callId": call_id,
        "taskId": task,
        "state": state,
        "ts": time.time_ns() // 1_000_000,
        "envelope": {
            "v": 1,
            "kind": "text",
            "streamKey": task,
            "seq": seq,
            "status": state,
            "payload": {"text": text},
        },
    }


async def _paced(seconds: float, streams: int, send: Any) -> int:
    """Call ``await send(stream, due_ns)`` for every stream ``RATE`` times a second, in 10 ms
    ticks (a tenth of the streams per tick), for ``seconds``; the number of sends.

    ``due_ns`` is when the schedule produced the block (wall clock, ns), and latency counts
    from it: a sender that falls behind the schedule (its publishes block the producer) pays
    for the wait, instead of stamping its blocks late and looking fast (coordinated
    omission)."""
    loop = asyncio.get_running_loop()
    start, origin = loop.time(), time.time_ns()
    sent = 0
    for tick in range(int(seconds * 100)):
        delay = start + tick * 0.01 - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        due = origin + tick * 10_000_000
        slot = tick % (100 // RATE)
        for stream in range(slot, streams, 100 // RATE):
            await send(stream, due)
            sent += 1
    return sent


async def role_worker(
    kind: str,
    target: str,
    rooms: list[str],
    streams_per_room: int,
    mode: str,
    seconds: float,
    n: int,
) -> None:
    """Publish the load; print ``START`` when the first block goes out, ``LOADED`` (with
    the worker's own figures) when the load is published, ``SENT`` once the worker's sender
    has handed all of it to the transport, then ``DONE`` after the terminals."""
    streams = [(room, f"t{i}") for room in rooms for i in range(streams_per_room)]
    # Span ids are random in a real deployment: each load's worker numbers its calls after a
    # random prefix of its own. With the same ids in every load, the relay (rightly) drops a
    # new worker's blocks on streams it ended when an earlier load's worker was gone
    # (``after_worker_aborted``), which the 5,000-conversation point once measured as a slow
    # relay (issue 25).
    prefix = os.urandom(4).hex()
    call_ids = [f"{prefix}{i + 1:08x}" for i in range(len(streams))]
    seqs = [0] * len(streams)
    finish: Any
    if kind == "plain":
        import socketio

        if target.startswith("redis://"):
            manager = socketio.AsyncRedisManager(target, write_only=True)

            async def emit(room: str, block: dict[str, Any]) -> None:
                await manager.emit(EVENT, block, room=room, namespace=NS)

            async def handed_over() -> None:
                return None  # each publish was awaited

            async def finish() -> None:
                return None
        else:
            client = socketio.AsyncClient(reconnection=False)
            await client.connect(target, namespaces=[NS], transports=["websocket"])

            async def emit(room: str, block: dict[str, Any]) -> None:
                await client.emit("relay_in", {"room": room, "block": block}, namespace=NS)

            async def handed_over() -> None:
                # a call round trip: everything emitted before it is on the wire
                await client.call("join_conversation", {"conversationId": "-"}, namespace=NS)

            async def finish() -> None:
                await handed_over()
                await client.disconnect()

        async def send(stream: int, due: int | None = None) -> None:
            room, task = streams[stream]
            seqs[stream] += 1
            text = f"{due or time.time_ns()} progress of {task}"
            await emit(room, _block(seqs[stream], text, task, call_ids[stream]))

        async def end(stream: int) -> None:
            room, task = streams[stream]
            seqs[stream] += 1
            await emit(room, _block(seqs[stream], "done", task, call_ids[stream], "done"))

    else:
        from kernel_ext.attribution.tap import Tap
        from kernel_ext.context import ToolCall, set_tool_call
        from kernel_ext.emit import LoopbackEmitter, RedisEmitter
        from kernel_ext.stream import StreamHub

        hub = StreamHub(max_running_per_second=None, max_queue=max(100_000, n), tap=Tap())
        emitter: Any
        if target.startswith("redis://"):
            emitter = RedisEmitter(target, hub=hub)
        else:
            emitter = LoopbackEmitter(target, SECRET, hub=hub)
        await emitter.start()
        await emitter._ready()  # the first connection attempt is over
        contexts = []
        for (room, _), call_id in zip(streams, call_ids, strict=True):
            ctx = contextvars.copy_context()
            ctx.run(set_tool_call, ToolCall(call_id, "ask_colleague", room))
            contexts.append(ctx)
        publish = hub.publish

        async def send(stream: int, due: int | None = None) -> None:
            contexts[stream].run(
                publish,
                f"{due or time.time_ns()} progress of {streams[stream][1]}",
                task_id=streams[stream][1],
            )

        async def end(stream: int) -> None:
            contexts[stream].run(publish, "done", task_id=streams[stream][1], state="done")

        async def handed_over() -> None:
            await emitter.flush(60)  # the sender sends in the background: until it is done

        async def finish() -> None:
            await emitter.flush(60)
            await emitter.stop(timeout=10)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    print(f"START {time.time_ns()}", flush=True)
    if mode == "burst":
        for i in range(n):
            await send(i % len(streams))
            if i % 200 == 199:
                await asyncio.sleep(0)
        sent = n
    else:
        sent = await _paced(seconds, len(streams), send)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    print(
        "LOADED " + json.dumps({"sent": sent, "cpu": cpu1 - cpu0, "wall": wall1 - wall0}),
        flush=True,
    )
    await handed_over()
    print("SENT", flush=True)
    for stream in range(len(streams)):
        await end(stream)
    await finish()
    print("DONE", flush=True)


# ---------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------

_SCRIPT = os.path.abspath(__file__)


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    """A role of this script as a child, its stdin piped (the browsers take commands)."""
    return await _spawn_script(*args, script=_SCRIPT, stdin=asyncio.subprocess.PIPE)


async def _ask(proc: asyncio.subprocess.Process, command: str, answer: str) -> str:
    assert proc.stdin is not None
    proc.stdin.write(f"{command}\n".encode())
    await proc.stdin.drain()
    return await _line(proc, answer, PROCESS_TIMEOUT)


class Redis:
    """A real redis-server on 127.0.0.1 for one point."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="kx-bench-redis-")
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def __aenter__(self) -> Redis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt package redis-server)")
        self.proc = await asyncio.create_subprocess_exec(
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await _wait_port(self.port, self.proc)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Setup:
    """One point's arrangement."""

    rooms: int
    per_room: int = 1
    streams_per_room: int = 1
    web_processes: int = 1
    redis: bool = False
    worker_path: str = "loopback"  # or "redis"
    burst_n: int = 20_000
    seconds: float = SECONDS
    burst_repeats: int = 1

    def for_full_run(self) -> Setup:
        """This setup as a full run measures it: paced for ``MIN_PACED_DELIVERIES``
        deliveries (at least ``SECONDS``, at most ``MAX_SECONDS``), the burst
        ``BURST_REPEATS`` times."""
        per_second = self.rooms * self.streams_per_room * self.per_room * RATE
        self.seconds = min(MAX_SECONDS, max(SECONDS, MIN_PACED_DELIVERIES / per_second))
        self.burst_repeats = BURST_REPEATS
        return self


@dataclass
class Load:
    """What one load (paced or burst) delivered."""

    sent: int = 0
    expected: int = 0
    delivered: int = 0
    rate: float = 0.0
    p50: float | None = None
    p99: float | None = None
    relay_cpu: float = 0.0
    redis_cpu: float = 0.0
    worker_cpu: float = 0.0
    worker_wall: float = 0.0
    relay_rss_loaded: int = 0


@dataclass
class Point:
    kind: str
    setup: Setup
    relay_rss_idle: int = 0
    relay_rss_connected: int = 0
    browsers_per_process: list[int] = field(default_factory=list)  # by web process
    loads: dict[str, Load] = field(default_factory=dict)


def _browser_processes(browsers: int) -> int:
    return 1 if browsers < 50 else min(4, max(2, math.ceil(browsers / 1_250)))


def _quantile(values: Sequence[int], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(len(values) * q))] / 1e6


async def _load(
    kind: str,
    setup: Setup,
    mode: str,
    rooms: list[str],
    target: str,
    relays: list[asyncio.subprocess.Process],
    browsers: list[asyncio.subprocess.Process],
    redis: Redis | None,
) -> Load:
    for proc in browsers:
        await _ask(proc, "MARK", "MARKED")
    cpu_before = sum(cpu_seconds(p.pid) for p in relays)
    redis_before = cpu_seconds(redis.proc.pid) if redis and redis.proc else 0.0
    worker = await _spawn(
        "--role",
        "worker",
        "--kind",
        kind,
        "--target",
        target,
        "--rooms",
        json.dumps(rooms),
        "--streams-per-room",
        str(setup.streams_per_room),
        "--mode",
        mode,
        "--seconds",
        str(setup.seconds),
        "--n",
        str(setup.burst_n),
    )
    loop = asyncio.get_running_loop()
    try:
        start_ns = int(await _line(worker, "START", PROCESS_TIMEOUT))
        done = json.loads(await _line(worker, "LOADED", PROCESS_TIMEOUT))
        loaded_rss = sum(rss_bytes(p.pid) for p in relays)
        # The same time for both contenders: deliveries up to DRAIN s after the worker has
        # handed the whole load over (a sender that sends in the background, as kernel_ext's
        # do, is not cut short by publishing fast).
        with contextlib.suppress(asyncio.TimeoutError):
            await _line(worker, "SENT", 60)
        expected = done["sent"] * setup.per_room
        deadline = loop.time() + DRAIN
        while loop.time() < deadline:
            delivered = 0
            for proc in browsers:
                delivered += int(await _ask(proc, "COUNT", "COUNT"))
            if delivered >= expected:
                break
            await asyncio.sleep(0.1)  # polling for the stragglers, bounded by DRAIN
        relay_cpu = sum(cpu_seconds(p.pid) for p in relays) - cpu_before
        redis_cpu = (cpu_seconds(redis.proc.pid) - redis_before) if redis and redis.proc else 0.0
        results = [json.loads(await _ask(p, "REPORT", "RESULT")) for p in browsers]
        with contextlib.suppress(asyncio.TimeoutError, RuntimeError):
            await _line(worker, "DONE", DRAIN)  # its terminals sent; else it is killed
    finally:
        if worker.returncode is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(worker.wait(), 5)
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
    delivered = sum(r["count"] for r in results)
    last = max((r["last"] for r in results if r["count"]), default=start_ns)
    merged = sorted(x for r in results for x in r["latencies"])
    return Load(
        sent=done["sent"],
        expected=expected,
        delivered=delivered,
        rate=delivered / ((last - start_ns) / 1e9) if last > start_ns else 0.0,
        p50=_quantile(merged, 0.5),
        p99=_quantile(merged, 0.99),
        relay_cpu=relay_cpu,
        redis_cpu=redis_cpu,
        worker_cpu=done["cpu"],
        worker_wall=done["wall"],
        relay_rss_loaded=loaded_rss,
    )


QUIET_CPU = 0.05  # cores: a relay below this is idle
QUIET_TIMEOUT = 180.0


async def _quiet(
    relays: Sequence[asyncio.subprocess.Process], browsers: Sequence[asyncio.subprocess.Process]
) -> None:
    """Wait until the relays use under ``QUIET_CPU`` of a core over half a second and the
    browsers received nothing more meanwhile (a relay waiting on full sockets is idle but
    still holds a backlog), polling, at most ``QUIET_TIMEOUT`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + QUIET_TIMEOUT

    async def received() -> int:
        return sum([int(await _ask(proc, "COUNT", "COUNT")) for proc in browsers])

    while loop.time() < deadline:
        before, got = sum(cpu_seconds(p.pid) for p in relays), await received()
        await asyncio.sleep(0.5)  # polling /proc and the browsers with a deadline
        idle = sum(cpu_seconds(p.pid) for p in relays) - before < QUIET_CPU * 0.5
        if idle and await received() == got:
            return


async def measure(kind: str, setup: Setup, modes: Sequence[str] = ("paced", "burst")) -> Point:
    """Start the processes of one point, run its loads, stop everything."""
    point = Point(kind, setup)
    rooms = [f"conv-{i}" for i in range(setup.rooms)]
    procs: list[asyncio.subprocess.Process] = []
    browsers: list[asyncio.subprocess.Process] = []
    async with contextlib.AsyncExitStack() as stack:
        redis = await stack.enter_async_context(Redis()) if setup.redis else None
        try:
            ports = [_free_port() for _ in range(setup.web_processes)]
            relays = []
            for port in ports:
                args = ["--role", "relay", "--kind", kind, "--port", str(port)]
                if redis is not None:
                    args += ["--redis", redis.url]
                relays.append(await _spawn(*args))
            procs += relays
            for port, relay in zip(ports, relays, strict=True):
                await _wait_port(port, relay)
            point.relay_rss_idle = sum(rss_bytes(p.pid) for p in relays)
            count = _browser_processes(setup.rooms * setup.per_room)
            for i in range(count):
                share = rooms[i::count]
                browsers.append(
                    await _spawn(
                        "--role",
                        "browsers",
                        "--ports",
                        ",".join(map(str, ports)),
                        "--rooms",
                        json.dumps(share),
                        "--per-room",
                        str(setup.per_room),
                    )
                )
            procs += browsers
            point.browsers_per_process = [0] * len(ports)
            for proc in browsers:
                ready = json.loads(await _line(proc, "READY", PROCESS_TIMEOUT))
                for i, connected in enumerate(ready):
                    point.browsers_per_process[i] += connected
            point.relay_rss_connected = sum(rss_bytes(p.pid) for p in relays)
            if setup.worker_path == "redis":
                assert redis is not None
                target = redis.url
            else:
                target = f"http://127.0.0.1:{ports[0]}"
            for mode in modes:
                repeats = setup.burst_repeats if mode == "burst" else 1
                loads = []
                for _ in range(repeats):
                    # each load starts on idle relays: a saturating load's backlog (still
                    # being delivered after its window) is not the next load's
                    await _quiet(relays, browsers)
                    loads.append(
                        await _load(kind, setup, mode, rooms, target, relays, browsers, redis)
                    )
                loads.sort(key=lambda load: load.rate)
                point.loads[mode] = loads[len(loads) // 2]  # the median by delivered blocks/s
            for proc in browsers:
                assert proc.stdin is not None
                proc.stdin.write(b"QUIT\n")
                with contextlib.suppress(ConnectionError):
                    await proc.stdin.drain()
        finally:
            for proc in reversed(procs):  # the browsers (asked to quit), then the relays
                if proc not in browsers and proc.returncode is None:
                    if os.environ.get("KX_BENCH_PROFILE"):
                        proc.send_signal(signal.SIGUSR1)
                        await asyncio.sleep(1)  # debugging only: time to write the profile
                    proc.terminate()  # uvicorn stops gracefully
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), 10)
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    return point


async def side_by_side(setup: Setup, modes: Sequence[str] = ("paced", "burst")) -> dict[str, Point]:
    """The plain relay's point, then kernel_ext's, on the same arrangement."""
    return {kind: await measure(kind, setup, modes) for kind in ("plain", "kx")}


# ---------------------------------------------------------------------------------------
# Worker: hub memory per live call (in process)
# ---------------------------------------------------------------------------------------


async def hub_memory_per_call(calls: int) -> float:
    """Bytes the hub holds per live call with one open stream (``tracemalloc``; the
    ``ToolCall`` records are the kernel's, made before the count starts)."""
    from kernel_ext.attribution.tap import Tap
    from kernel_ext.context import ToolCall, use_tool_call
    from kernel_ext.stream import StreamHub

    hub = StreamHub(max_running_per_second=None, max_queue=1_000_000, tap=Tap())
    consumer = hub.consumer()
    records = [ToolCall(f"{i + 1:016x}", "ask_colleague", f"conv-{i % 10}") for i in range(calls)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for call in records:
            with use_tool_call(call):
                hub.publish("progress", task_id="t0")
        consumer.take_nowait(calls + 10)  # sent: what stays is the streams' state
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        consumer.close()
    return max(0.0, (after - before) / calls)


# ---------------------------------------------------------------------------------------
# Figures, tables, plots
# ---------------------------------------------------------------------------------------


def _ratio(kx: float | None, plain: float | None) -> float | None:
    if kx is None or not plain:
        return None
    return kx / plain


def _ratio_figure(name: str, ratio: float | None, floor: bool, detail: str) -> dict[str, Any]:
    """A point's ratio to the plain relay, held against the floor (throughput, ≥) or the
    ceiling (p99, ≤) of issue 17; measured in other processes, so never profiled."""
    target = THROUGHPUT_TARGET if floor else P99_TARGET
    ok = None if ratio is None else (ratio >= target if floor else ratio <= target)
    return {
        "name": name,
        "value": round(ratio, 2) if ratio is not None else None,
        "unit": "×",
        "target": target,
        "target_text": f"{'≥' if floor else '≤'} {target:.1f}×",
        "profile": False,
        "ok": ok,
        "detail": detail,
    }


def _point_figures(curve: str, label: str, pair: dict[str, Point]) -> list[dict[str, Any]]:
    plain, kx = pair["plain"], pair["kx"]
    figures = []
    if "burst" in kx.loads:
        pb, kb = plain.loads["burst"], kx.loads["burst"]
        figures.append(
            _ratio_figure(
                f"{curve}, {label}: throughput vs plain relay",
                _ratio(kb.rate, pb.rate),
                True,
                f"{kb.rate:,.0f} vs {pb.rate:,.0f} delivered blocks/s (burst; delivered "
                f"{kb.delivered:,}/{kb.expected:,} vs {pb.delivered:,}/{pb.expected:,})",
            )
        )
    pp, kp = plain.loads["paced"], kx.loads["paced"]
    figures.append(
        _ratio_figure(
            f"{curve}, {label}: p99 latency vs plain relay",
            _ratio(kp.p99, pp.p99),
            False,
            f"p99 {_ms(kp.p99)} vs {_ms(pp.p99)} ms, p50 {_ms(kp.p50)} vs {_ms(pp.p50)} ms "
            f"(paced; delivered {kp.delivered:,}/{kp.expected:,} vs "
            f"{pp.delivered:,}/{pp.expected:,})",
        )
    )
    return figures


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _per_block_us(cpu: float, blocks: int) -> float | None:
    return cpu / blocks * 1e6 if blocks else None


def _cpu_load(point: Point) -> Load:
    """The load a point's CPU per block is taken from: the burst (saturated) when measured."""
    return point.loads.get("burst") or point.loads["paced"]


def _web_us(point: Point) -> float | None:
    """The sum of the web processes' CPU per delivered block (µs)."""
    load = _cpu_load(point)
    return _per_block_us(load.relay_cpu, load.delivered)


def _redis_us(point: Point) -> float | None:
    """redis-server's CPU per delivered block (µs), ``None`` without Redis."""
    load = _cpu_load(point)
    return _per_block_us(load.redis_cpu, load.delivered) if point.setup.redis else None


def _kib(value: float | None) -> str:
    return "—" if value is None else f"{value / 1024:,.1f}"


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


class Curves:
    """Every point of the four curves, and what is made of them."""

    def __init__(self) -> None:
        self.fanout: dict[int, dict[str, Point]] = {}
        self.breadth: dict[int, dict[str, Point]] = {}
        self.scale_out: dict[str, dict[str, Point]] = {}
        self.workers: dict[int, dict[str, Point]] = {}
        self.hub_bytes: dict[int, float] = {}

    def figures(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for browsers, pair in self.fanout.items():
            out += _point_figures("fan-out", f"{browsers:,} browsers", pair)
        for rooms, pair in self.breadth.items():
            out += _point_figures("breadth", f"{rooms:,} conversations", pair)
        for label, pair in self.scale_out.items():
            out += _point_figures("scale-out", label, pair)
        out += self._web_process_figures()
        for calls, pair in self.workers.items():
            out += _point_figures("workers", f"{calls:,} calls", pair)
            kp, pp = pair["kx"].loads["paced"], pair["plain"].loads["paced"]
            out.append(
                {
                    "name": f"workers, {calls:,} calls: worker CPU share (info)",
                    "value": round(kp.worker_cpu / kp.worker_wall, 3),
                    "unit": "cores",
                    "target": None,
                    "ok": None,
                    "detail": f"plain worker {pp.worker_cpu / pp.worker_wall:.3f} cores; "
                    f"hub memory {self.hub_bytes.get(calls, 0):,.0f} B per live call",
                }
            )
        return out

    def web_process_curve(self) -> dict[int, dict[str, Point]]:
        """The scale-out points of the web-process curve, by number of web processes."""
        return {
            n: self.scale_out[label]
            for n, label in WEB_PROCESSES.items()
            if label in self.scale_out
        }

    def _web_process_figures(self) -> list[dict[str, Any]]:
        """Each contender's sum of the web processes' CPU per delivered block at N web
        processes against its own at one: held to ``WEB_CPU_TARGET`` for kernel_ext, for
        information for the plain manager; redis-server's CPU per block at the most."""
        curve = self.web_process_curve()
        if 1 not in curve or len(curve) < 2:
            return []
        out: list[dict[str, Any]] = []
        for kind, who in (("kx", "kernel_ext"), ("plain", "plain Redis manager")):
            one = _web_us(curve[1][kind])
            base = _cpu_load(curve[1][kind])
            for n, pair in curve.items():
                if n == 1:
                    continue
                value, load = _web_us(pair[kind]), _cpu_load(pair[kind])
                ratio = _ratio(value, one)
                judged = kind == "kx"
                out.append(
                    {
                        "name": f"scale-out, {n} web processes vs 1: sum of the web processes' "
                        f"CPU per delivered block, {who}" + ("" if judged else " (info)"),
                        "value": round(ratio, 2) if ratio is not None else None,
                        "unit": "×",
                        "target": WEB_CPU_TARGET if judged else None,
                        "target_text": f"≤ {WEB_CPU_TARGET:.1f}×" if judged else None,
                        "profile": False,
                        "ok": (ratio is not None and ratio <= WEB_CPU_TARGET) if judged else None,
                        "detail": f"{_us(value)} vs {_us(one)} µs per delivered block (burst; "
                        f"delivered {load.delivered:,}/{load.expected:,} vs "
                        f"{base.delivered:,}/{base.expected:,}); redis-server "
                        f"{_us(_redis_us(pair[kind]))} vs {_us(_redis_us(curve[1][kind]))} µs",
                    }
                )
        most = max(curve)
        kx, plain = (_redis_us(curve[most][kind]) for kind in ("kx", "plain"))
        out.append(
            {
                "name": f"scale-out, {most} web processes: redis-server CPU per delivered "
                "block, kernel_ext (info)",
                "value": round(kx, 1) if kx is not None else None,
                "unit": "µs",
                "target": None,
                "ok": None,
                "detail": f"plain Redis manager {_us(plain)} µs (burst)",
            }
        )
        return out

    # -- tables ------------------------------------------------------------------------

    def _load_rows(self, label: str, pair: dict[str, Point]) -> str:
        kp, pp = pair["kx"].loads["paced"], pair["plain"].loads["paced"]
        kb, pb = pair["kx"].loads.get("burst"), pair["plain"].loads.get("burst")
        burst = (
            f"{kb.rate:,.0f} | {pb.rate:,.0f} | {_ratio(kb.rate, pb.rate) or 0:.2f}×"
            if kb and pb
            else "— | — | —"
        )
        return (
            f"| {label} | {burst} | {_ms(kp.p99)} | {_ms(pp.p99)} | "
            f"{_ratio(kp.p99, pp.p99) or 0:.2f}× | {kp.delivered:,}/{kp.expected:,} | "
            f"{pp.delivered:,}/{pp.expected:,} | "
            f"{_us(_web_us(pair['kx']))} | {_us(_web_us(pair['plain']))} |"
        )

    _HEAD = (
        "| {what} | kernel_ext blocks/s (burst) | plain blocks/s | ratio | kernel_ext p99 ms "
        "(paced) | plain p99 ms | ratio | delivered, paced: kernel_ext | plain | relay CPU "
        "µs per delivered block (burst): kernel_ext | plain |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )

    def sections(self, plots: dict[str, str]) -> str:
        parts: list[str] = []
        if self.fanout:
            parts += [
                "#### Curve 1 — fan-out: one conversation, 10 streams × 10 blocks/s, watched by "
                "N browsers",
                "",
                self._HEAD.format(what="browsers"),
            ]
            parts += [self._load_rows(f"{b:,}", p) for b, p in self.fanout.items()]
            parts += _plot_line(plots, "fanout")
        if self.breadth:
            parts += [
                "#### Curve 2 — breadth: N conversations, one stream × 10 blocks/s and one "
                "browser each",
                "",
                self._HEAD.format(what="conversations"),
            ]
            parts += [self._load_rows(f"{r:,}", p) for r, p in self.breadth.items()]
            parts += [
                "",
                "| conversations | relay memory per browser (KiB), kernel_ext | plain | relay "
                "memory growth per live stream under load, backlog included (KiB), "
                "kernel_ext | plain |",
                "|---|---|---|---|---|",
            ]
            for rooms, pair in self.breadth.items():
                cells = []
                for kind in ("kx", "plain"):
                    point = pair[kind]
                    cells.append(
                        _kib((point.relay_rss_connected - point.relay_rss_idle) / rooms)
                        if rooms >= 100
                        else "—"
                    )
                for kind in ("kx", "plain"):
                    point = pair[kind]
                    loaded = point.loads["paced"].relay_rss_loaded
                    cells.append(
                        _kib((loaded - point.relay_rss_connected) / rooms) if rooms >= 100 else "—"
                    )
                parts.append(f"| {rooms:,} | " + " | ".join(cells) + " |")
            parts += _plot_line(plots, "breadth")
        if self.scale_out:
            parts += [
                f"#### Curve 3 — scale-out: {self._scale_rooms():,} conversations, one "
                "browser each, 1 to 4 web processes",
                "",
                self._HEAD.format(what="arrangement"),
            ]
            parts += [self._load_rows(label, p) for label, p in self.scale_out.items()]
            parts += _plot_line(plots, "scaleout")
            parts += self._web_process_table()
            parts += _plot_line(plots, "processes")
        if self.workers:
            parts += [
                "#### Curve 4 — workers: one worker, N concurrent tool calls × 10 blocks/s",
                "",
                "| calls | worker CPU share, kernel_ext (cores) | plain worker | worker CPU µs "
                "per block, kernel_ext | plain | hub memory per live call (B) | delivered "
                "kernel_ext | p99 ms kernel_ext | plain p99 ms |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for calls, pair in self.workers.items():
                kp, pp = pair["kx"].loads["paced"], pair["plain"].loads["paced"]
                parts.append(
                    f"| {calls:,} | {kp.worker_cpu / kp.worker_wall:.3f} | "
                    f"{pp.worker_cpu / pp.worker_wall:.3f} | "
                    f"{_us(_per_block_us(kp.worker_cpu, kp.sent))} | "
                    f"{_us(_per_block_us(pp.worker_cpu, pp.sent))} | "
                    f"{self.hub_bytes.get(calls, 0):,.0f} | {kp.delivered:,}/{kp.expected:,} | "
                    f"{_ms(kp.p99)} | {_ms(pp.p99)} |"
                )
            parts += _plot_line(plots, "workers")
        capacity = self.capacity()
        if capacity:
            parts += ["#### Capacity (the figures docs/operations.md quotes)", "", *capacity]
        return "\n".join(parts)

    def _web_process_table(self) -> list[str]:
        """The web processes' summed CPU and redis-server's CPU per delivered block of every
        arrangement behind Redis (burst), with the web-process curve's ratios to its own
        one-process point."""
        redis = {label: pair for label, pair in self.scale_out.items() if pair["kx"].setup.redis}
        if not redis:
            return []
        curve = self.web_process_curve()
        by_label = {WEB_PROCESSES[n]: n for n in curve}
        rows = [
            "Behind Redis: the sum of the web processes' CPU (user + system) and "
            "redis-server's CPU per delivered block over the burst; × 1: against the same "
            "contender with one web process.",
            "",
            "| arrangement | delivered (burst), kernel_ext | plain | web processes' CPU µs per "
            "delivered block, kernel_ext | × 1 | plain | × 1 | redis-server CPU µs per "
            "delivered block, kernel_ext | plain |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for label, pair in redis.items():
            cells = []
            for kind in ("kx", "plain"):
                load = _cpu_load(pair[kind])
                cells.append(f"{load.delivered:,}/{load.expected:,}")
            for kind in ("kx", "plain"):
                value = _web_us(pair[kind])
                one = _web_us(curve[1][kind]) if label in by_label and 1 in curve else None
                ratio = _ratio(value, one)
                cells += [_us(value), "—" if ratio is None else f"{ratio:.2f}×"]
            cells += [_us(_redis_us(pair[kind])) for kind in ("kx", "plain")]
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
        return rows

    def _scale_rooms(self) -> int:
        first = next(iter(self.scale_out.values()))
        return first["kx"].setup.rooms

    def capacity(self) -> list[str]:
        """The capacity guide's table: one web process's measured limits on this machine
        (docs/operations.md quotes these rows; tests/package/test_docs.py holds it to them)."""
        if not (self.breadth and self.fanout):
            return []
        rows = ["| quantity (one web process, this machine) | measured |", "|---|---|"]
        bursts = {rooms: p["kx"].loads["burst"] for rooms, p in self.breadth.items()}
        best = max(bursts.values(), key=lambda load: load.rate)
        rows.append(
            f"| blocks/s delivered to one browser per conversation, saturated (best of 1 to "
            f"{max(bursts):,} conversations) | {best.rate:,.0f} |"
        )
        fan = max(p["kx"].loads["burst"].rate for p in self.fanout.values())
        rows.append(
            f"| deliveries/s to the browsers of one conversation, saturated (up to "
            f"{max(self.fanout):,} browsers) | {fan:,.0f} |"
        )
        cpu = [c for c in (_per_block_us(b.relay_cpu, b.delivered) for b in bursts.values()) if c]
        if cpu:
            rows.append(
                f"| relay CPU per delivered block, saturated (µs; 1 to {max(bursts):,} "
                f"conversations) | {min(cpu):,.0f}–{max(cpu):,.0f} |"
            )
        carried = [
            rooms
            for rooms, p in self.breadth.items()
            if p["kx"].loads["paced"].delivered == p["kx"].loads["paced"].expected
        ]
        if carried:
            most = max(carried)
            paced = self.breadth[most]["kx"].loads["paced"]
            rows.append(
                f"| live streams at 10 blocks/s with every block delivered (largest point) | "
                f"{most:,} (p99 {_ms(paced.p99)} ms) |"
            )
        big = max(self.breadth)
        pair = self.breadth[big]["kx"]
        rows.append(
            f"| relay memory per connected browser (KiB, {big:,} browsers) | "
            f"{(pair.relay_rss_connected - pair.relay_rss_idle) / big / 1024:,.1f} |"
        )
        loaded = pair.loads["paced"]
        rows.append(
            f"| relay memory growth per live stream under load, backlog included (KiB, "
            f"{big:,} streams) | "
            f"{(loaded.relay_rss_loaded - pair.relay_rss_connected) / big / 1024:,.1f} |"
        )
        rows.append(
            f"| paced load delivered at {big:,} conversations × 10 blocks/s | "
            f"{loaded.delivered / max(1, loaded.expected):.0%} |"
        )
        if self.scale_out:
            spans = []
            for kind in ("kx", "plain"):
                known = [_redis_us(p[kind]) for p in self.scale_out.values()]
                spans.append([c for c in known if c is not None])
            if all(spans):
                rows.append(
                    "| redis-server CPU per delivered block (µs; the plain manager's) | "
                    f"{_span(spans[0])} ({_span(spans[1])}) |"
                )
            curve = self.web_process_curve()
            if 1 in curve and len(curve) > 1:
                most = max(curve)
                ratio = _ratio(_web_us(curve[most]["kx"]), _web_us(curve[1]["kx"]))
                rows.append(
                    f"| web processes' summed CPU per delivered block, {most} behind Redis vs 1 "
                    f"(room-routed) | {'—' if ratio is None else f'{ratio:.2f}×'} |"
                )
                # The same blocks and deliveries over more web processes: without routing
                # (python-socketio's manager, or kernel_ext's beside an older web process)
                # each added process decodes and skips every block of the others' rooms.
                one, many = _web_us(curve[1]["plain"]), _web_us(curve[most]["plain"])
                skip = None if one is None or many is None else (many - one) / (most - 1)
                rows.append(
                    "| web-process CPU per published block of a room it has no browser in, "
                    f"without routing (µs; the plain Redis manager, 1 to {most} processes) | "
                    f"{_us(skip)} |"
                )
        if self.workers:
            most = max(self.workers)
            kp = self.workers[most]["kx"].loads["paced"]
            rows.append(
                f"| worker CPU per published block (µs, {most:,} calls × 10 blocks/s) | "
                f"{_us(_per_block_us(kp.worker_cpu, kp.sent))} |"
            )
            rows.append(f"| hub memory per live call (B) | {self.hub_bytes.get(most, 0):,.0f} |")
        return rows

    # -- plots -------------------------------------------------------------------------

    def plot(self, directory: Path) -> dict[str, str]:
        """Write one SVG per curve; the file names by curve (empty without matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return {}
        directory.mkdir(parents=True, exist_ok=True)
        written: dict[str, str] = {}
        plt.rcParams["svg.hashsalt"] = "kernel_ext"  # reproducible ids in the SVG

        def save(fig: Any, name: str) -> None:
            path = directory / f"scale-{name}.svg"
            fig.tight_layout()
            fig.savefig(path, format="svg", metadata={"Date": None})
            plt.close(fig)
            written[name] = f"{directory.name}/{path.name}"

        for name, data, xlabel in (
            ("fanout", self.fanout, "browsers watching one conversation"),
            ("breadth", self.breadth, "live conversations (one browser each)"),
            ("workers", self.workers, "concurrent tool calls in one worker"),
        ):
            if not data:
                continue
            xs = list(data)
            fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
            for kind, label, style in (("kx", "kernel_ext", "o-"), ("plain", "plain relay", "s--")):
                if name == "workers":
                    left.plot(
                        xs,
                        [
                            p[kind].loads["paced"].worker_cpu / p[kind].loads["paced"].worker_wall
                            for p in data.values()
                        ],
                        style,
                        label=label,
                    )
                else:
                    left.plot(
                        xs, [p[kind].loads["burst"].rate for p in data.values()], style, label=label
                    )
                right.plot(
                    xs, [p[kind].loads["paced"].p99 or 0 for p in data.values()], style, label=label
                )
            left.set_ylabel("worker CPU (cores)" if name == "workers" else "delivered blocks/s")
            right.set_ylabel("p99 latency (ms), paced")
            for axis in (left, right):
                axis.set_xscale("log")
                axis.set_xlabel(xlabel)
                axis.grid(True, alpha=0.3)
                axis.legend()
            save(fig, name)
        if self.scale_out:
            labels = list(self.scale_out)
            fig, axis = plt.subplots(figsize=(10, 3.6))
            width = 0.38
            for offset, (kind, label) in enumerate(
                (("kx", "kernel_ext"), ("plain", "plain relay"))
            ):
                axis.bar(
                    [i + (offset - 0.5) * width for i in range(len(labels))],
                    [p[kind].loads["burst"].rate for p in self.scale_out.values()],
                    width,
                    label=label,
                )
            axis.set_xticks(range(len(labels)), labels, fontsize=8)
            axis.set_ylabel("delivered blocks/s (burst)")
            axis.legend()
            axis.grid(True, axis="y", alpha=0.3)
            save(fig, "scaleout")
        curve = self.web_process_curve()
        if curve:
            xs = list(curve)
            fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
            for kind, label, style in (
                ("kx", "kernel_ext (routed)", "o-"),
                ("plain", "plain Redis manager", "s--"),
            ):
                left.plot(xs, [_web_us(p[kind]) or 0 for p in curve.values()], style, label=label)
                right.plot(
                    xs, [_redis_us(p[kind]) or 0 for p in curve.values()], style, label=label
                )
            left.set_ylabel("web processes' CPU µs per delivered block")
            right.set_ylabel("redis-server CPU µs per delivered block")
            for axis in (left, right):
                axis.set_xticks(xs)
                axis.set_xlabel("web processes behind one redis-server")
                axis.set_ylim(bottom=0)
                axis.grid(True, alpha=0.3)
                axis.legend()
            save(fig, "processes")
        return written


def _span(values: Sequence[float]) -> str:
    """``low–high`` of ``values`` to the µs, or one figure when they round alike."""
    low, high = f"{min(values):,.0f}", f"{max(values):,.0f}"
    return low if low == high else f"{low}–{high}"


def _plot_line(plots: dict[str, str], name: str) -> list[str]:
    if name in plots:
        return ["", f"![{name}]({plots[name]})", ""]
    return ["", "(no plot: matplotlib is not installed; `pip install -e .[bench]`)", ""]


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------


def web_process_setup(processes: int, rooms: int, burst_n: int) -> Setup:
    """A point of the web-process curve: ``processes`` web processes behind one
    redis-server, the worker on the ``RedisEmitter`` path, one browser per conversation,
    the conversations spread evenly over the web processes."""
    return Setup(
        rooms=rooms, web_processes=processes, redis=True, worker_path="redis", burst_n=burst_n
    )


def scale_out_setups(rooms: int, burst_n: int) -> dict[str, Setup]:
    """The scale-out curve's arrangements by label: one web process without Redis, the
    web-process curve (:data:`WEB_PROCESSES`), and a worker looping back into one of two
    Redis-backed web processes."""
    setups = {ONE_LOOPBACK: Setup(rooms=rooms, burst_n=burst_n)}
    for processes, label in WEB_PROCESSES.items():
        setups[label] = web_process_setup(processes, rooms, burst_n)
    setups[TWO_LOOPBACK] = Setup(rooms=rooms, web_processes=2, redis=True, burst_n=burst_n)
    return setups


async def _curves(quick: bool, which: Sequence[str] = CURVES) -> Curves:
    curves = Curves()

    def arranged(setup: Setup) -> Setup:
        return setup if quick else setup.for_full_run()

    for browsers in (QUICK_FANOUT if quick else FANOUT) if "fanout" in which else ():
        # about 40,000 deliveries per burst (10,000 quick), whatever the fan-out
        setup = Setup(
            rooms=1,
            per_room=browsers,
            streams_per_room=10,
            burst_n=max(400, (10_000 if quick else 40_000) // browsers),
        )
        curves.fanout[browsers] = await side_by_side(arranged(setup))
    for rooms in (QUICK_BREADTH if quick else BREADTH) if "breadth" in which else ():
        setup = Setup(rooms=rooms, burst_n=5_000 if quick else 20_000)
        curves.breadth[rooms] = await side_by_side(arranged(setup))
    if "scaleout" in which:
        rooms = QUICK_SCALE_OUT_ROOMS if quick else SCALE_OUT_ROOMS
        for label, setup in scale_out_setups(rooms, 5_000 if quick else 20_000).items():
            curves.scale_out[label] = await side_by_side(arranged(setup))
    for calls in (QUICK_WORKER_CALLS if quick else WORKER_CALLS) if "workers" in which else ():
        setup = Setup(rooms=1, streams_per_room=calls)
        curves.workers[calls] = await side_by_side(arranged(setup), modes=("paced",))
        curves.hub_bytes[calls] = await hub_memory_per_call(calls)
    return curves


_LAST: list[str] = []


def run(quick: bool = False, only: Sequence[str] = CURVES) -> list[dict[str, Any]]:
    """Measure the four curves (or those of :data:`CURVES` named in ``only``); the figures
    (each point's ratios), and the tables and plots as :func:`sections` returns them."""
    quick = quick or QUICK
    unknown = set(only) - set(CURVES)
    if unknown:
        raise ValueError(f"no such curve: {', '.join(sorted(unknown))} (have: {', '.join(CURVES)})")
    curves = asyncio.run(_curves(quick, only))
    plot_dir = Path(os.environ.get(PLOT_DIR_ENV) or tempfile.mkdtemp(prefix="kx-plots-"))
    _LAST[:] = [curves.sections(curves.plot(plot_dir))]
    return curves.figures()


def sections() -> str:
    """The tables, plot links and capacity table of the last :func:`run` (markdown)."""
    return _LAST[0] if _LAST else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role")
    parser.add_argument("--kind", default="kx")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ports", default="")
    parser.add_argument("--redis")
    parser.add_argument("--target", default="")
    parser.add_argument("--rooms", default="[]")
    parser.add_argument("--per-room", type=int, default=1)
    parser.add_argument("--streams-per-room", type=int, default=1)
    parser.add_argument("--mode", default="paced")
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--curves", default=",".join(CURVES), help="the curves to measure, comma-separated"
    )
    args = parser.parse_args(argv)
    if args.role == "relay":
        role_relay(args.kind, args.port, args.redis)
        return 0
    if args.role == "browsers":
        ports = [int(p) for p in args.ports.split(",")]
        asyncio.run(role_browsers(ports, json.loads(args.rooms), args.per_room))
        return 0
    if args.role == "worker":
        import logging

        logging.getLogger("kernel_ext").setLevel(logging.ERROR)
        asyncio.run(
            role_worker(
                args.kind,
                args.target,
                json.loads(args.rooms),
                args.streams_per_room,
                args.mode,
                args.seconds,
                args.n,
            )
        )
        return 0
    print(f"kernel_ext scale benchmarks — Python {sys.version.split()[0]}")
    for figure in run(quick=args.quick, only=args.curves.split(",")):
        verdict = "info" if figure["ok"] is None else ("PASS" if figure["ok"] else "MISS")
        print(
            f"  {verdict:4}  {figure['name']:<70} {figure['value']}{figure['unit']}  "
            f"{figure['detail']}"
        )
    print(sections())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
