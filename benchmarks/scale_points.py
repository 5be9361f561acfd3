"""The scale benchmark's points (``bench_scale.py``): one arrangement of real processes on
127.0.0.1 (:class:`Setup`), measured under its loads (:func:`measure`, :class:`Load`,
:class:`Point`), the plain relay's and kernel_ext's side by side (:func:`side_by_side`).

The roles are children of this script (``python benchmarks/scale_points.py --role …``): the
relay (``relay``), the processes hosting the browsers (``browsers``) and the worker
(``worker``). Not a ``bench_*`` module: ``benchmarks/run.py`` runs ``bench_scale.py``,
whose curves are made of these points.
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
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench_stream import plain_relay_app
from loads import EVENT, NS, SECRET, block, paced
from processes import (
    RedisServer,
    ask,
    cpu_seconds,
    free_port,
    read_line,
    rss_bytes,
    spawn,
    stdin_lines,
    wait_listening_async,
)

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
    reader = await stdin_lines()
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
            await emit(room, block(seqs[stream], text, task, call_ids[stream]))

        async def end(stream: int) -> None:
            room, task = streams[stream]
            seqs[stream] += 1
            await emit(room, block(seqs[stream], "done", task, call_ids[stream], "done"))

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
        sent = await paced(seconds, len(streams), send, RATE)
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

SCRIPT = os.path.abspath(__file__)
"""This script: the roles above run as its children."""


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    """A role of this script as a child, its stdin piped (the browsers take commands)."""
    return await spawn(SCRIPT, *args, stdin=asyncio.subprocess.PIPE)


async def _ask(proc: asyncio.subprocess.Process, command: str, answer: str) -> str:
    return await ask(proc, command, answer, PROCESS_TIMEOUT)


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
    redis: RedisServer | None,
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
        start_ns = int(await read_line(worker, "START", PROCESS_TIMEOUT))
        done = json.loads(await read_line(worker, "LOADED", PROCESS_TIMEOUT))
        loaded_rss = sum(rss_bytes(p.pid) for p in relays)
        # The same time for both contenders: deliveries up to DRAIN s after the worker has
        # handed the whole load over (a sender that sends in the background, as kernel_ext's
        # do, is not cut short by publishing fast).
        with contextlib.suppress(asyncio.TimeoutError):
            await read_line(worker, "SENT", 60)
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
            await read_line(worker, "DONE", DRAIN)  # its terminals sent; else it is killed
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
        redis = await stack.enter_async_context(RedisServer()) if setup.redis else None
        try:
            ports = [free_port() for _ in range(setup.web_processes)]
            relays = []
            for port in ports:
                args = ["--role", "relay", "--kind", kind, "--port", str(port)]
                if redis is not None:
                    args += ["--redis", redis.url]
                relays.append(await _spawn(*args))
            procs += relays
            for port, relay in zip(ports, relays, strict=True):
                await wait_listening_async(port, process=relay, what="relay", timeout=30)
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
                ready = json.loads(await read_line(proc, "READY", PROCESS_TIMEOUT))
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


def arranged(setup: Setup, quick: bool) -> Setup:
    """``setup`` as a quick run measures it, or as a full run does
    (:meth:`Setup.for_full_run`)."""
    return setup if quick else setup.for_full_run()


def main(argv: list[str] | None = None) -> int:
    """Run one role (``--role``): this script's children."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", required=True, choices=("relay", "browsers", "worker"))
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
    args = parser.parse_args(argv)
    if args.role == "relay":
        role_relay(args.kind, args.port, args.redis)
    elif args.role == "browsers":
        ports = [int(p) for p in args.ports.split(",")]
        asyncio.run(role_browsers(ports, json.loads(args.rooms), args.per_room))
    else:
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


if __name__ == "__main__":
    raise SystemExit(main())
