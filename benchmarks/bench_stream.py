"""Stream pipeline benchmarks: publish() cost, relay throughput and latency (design.md §7).

Run: ``python benchmarks/bench_stream.py [--quick]``. Prints each figure with its target and
PASS/MISS; :func:`run` returns the figures as a list of dicts for a benchmark runner.

In process (medians of batches of ``BATCH`` calls after a warm-up, inside an active tool
call, a sender draining the hub on the event loop):

* ``publish()`` of a running block from the event-loop thread — target ≤ 2 µs.
* the same from a worker thread while the loop's sender drains — target ≤ 2 µs.
* a dropped block (over the T4 limit of 10/s) — target ≤ 1 µs.
* (info) the consumer-side cost of building one block.

Three processes on this machine (worker → relay → receiver, as a browser would be), each
run measured side by side with a plain python-socketio relay (the worker emits one event per
block; the relay emits it to the room, one emit per message, no validation):

* throughput: ``N`` blocks as fast as the worker can publish them, counted at the receiver
  from the first to the last block; kernel_ext (hub + LoopbackEmitter batching ``kx_blocks``
  frames + ChatRelay validating every block, catch-up on: the default; ``bench_catchup.py``
  compares on with off) vs. plain — target ratio ≥ 1.0 (aim 1.5).
  Rounds alternate plain/kernel_ext; the median rate of each is compared.
* latency: 100 streams × 10 blocks/s for ``SECONDS`` s; latency from the ``publish()`` (or
  plain ``emit``) call to the receiver's handler (the publish time travels in the block's
  text); the median over alternating rounds of kernel_ext's p99 vs. plain's — target ratio
  ≤ 1.5. The T4 throttle is off in
  this run (pacing jitter would otherwise drop blocks of streams running exactly at the
  limit); its cost is in the in-process figures.

Nothing is tuned to pass: the figures are printed as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gc
import json
import logging
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import loads
from loads import NS, SECRET
from processes import (
    cpu_seconds,
    free_port,
    read_line,
    rss_bytes,
    spawn,
    stdin_lines,
    wait_listening_async,
)

ROOM = "bench-room"
CALL_ID = "00f067aa0ba902b7"
BATCH = 200
BATCHES = 300
THROUGHPUT_N = 20_000
QUICK_THROUGHPUT_N = 5_000
ROUNDS = 3
SECONDS = 4.0
QUICK_SECONDS = 2.0
STREAMS = 100
RATE_PER_STREAM = 10
PROCESS_TIMEOUT = 120.0


# ---------------------------------------------------------------------------------------
# In-process: publish() costs
# ---------------------------------------------------------------------------------------


def _median_per_call(fn: Any, batches: int = BATCHES, per: int = BATCH) -> float:
    """Median ns per call over ``batches`` batches of ``per`` calls."""
    results = []
    clock = time.perf_counter_ns
    for _ in range(batches):
        start = clock()
        for _ in range(per):
            fn()
        results.append((clock() - start) / per)
    return statistics.median(results)


async def _publish_costs() -> dict[str, float]:
    from kernel_ext.attribution.tap import Tap
    from kernel_ext.context import ToolCall, use_tool_call
    from kernel_ext.stream import StreamHub

    tap = Tap()
    open_hub = StreamHub(max_running_per_second=None, max_queue=1_000_000, tap=tap)
    throttled_hub = StreamHub(tap=tap)
    drained = 0

    async def drain(hub: StreamHub) -> None:
        nonlocal drained
        consumer = hub.attach_sender()
        while not consumer.closed:
            drained += len(await consumer.get(1024))

    drainers = [asyncio.create_task(drain(open_hub)), asyncio.create_task(drain(throttled_hub))]
    figures: dict[str, float] = {}
    with use_tool_call(ToolCall(CALL_ID, "ask_colleague", ROOM)):
        text = "x" * 64
        publish_open = open_hub.publish
        publish_throttled = throttled_hub.publish

        # from the loop thread: the sender runs between batches
        for _ in range(20):
            publish_open(text, task_id="warm")
        results = []
        clock = time.perf_counter_ns
        for _ in range(BATCHES):
            start = clock()
            for _ in range(BATCH):
                publish_open(text, task_id="loop")
            results.append((clock() - start) / BATCH)
            await asyncio.sleep(0)
        figures["loop"] = statistics.median(results)

        for _ in range(20):
            publish_throttled(text, task_id="full")  # the window is full after 10
        figures["dropped"] = _median_per_call(lambda: publish_throttled(text, task_id="full"))

        ctx = contextvars.copy_context()
        box: dict[str, float] = {}

        def worker() -> None:
            box["thread"] = _median_per_call(lambda: publish_open(text, task_id="thread"))
            box["thread_dropped"] = _median_per_call(
                lambda: publish_throttled(text, task_id="full")
            )

        await asyncio.to_thread(ctx.run, worker)
        figures.update(box)

    # consumer side: build cost per block (no publisher running)
    hub = StreamHub(max_running_per_second=None, max_queue=1_000_000, tap=tap)
    consumer = hub.attach_sender()
    built = 0
    spent = 0
    with use_tool_call(ToolCall(CALL_ID, "ask_colleague", ROOM)):
        for _ in range(100):
            for _ in range(500):
                hub.publish("x" * 64, task_id="build")
            start = time.perf_counter_ns()
            built += len(consumer.take_nowait(1000))
            spent += time.perf_counter_ns() - start
    figures["build"] = spent / max(1, built)
    consumer.close()
    for task in drainers:
        task.cancel()
    await asyncio.gather(*drainers, return_exceptions=True)
    return figures


def bench_publish() -> list[dict[str, Any]]:
    costs = asyncio.run(_publish_costs())
    return [
        _figure("publish() running block, event-loop thread", costs["loop"] / 1000, 2.0),
        _figure("publish() running block, worker thread", costs["thread"] / 1000, 2.0),
        _figure(
            "publish() dropped block (throttled), event-loop thread", costs["dropped"] / 1000, 1.0
        ),
        _figure(
            "publish() dropped block (throttled), worker thread",
            costs["thread_dropped"] / 1000,
            1.0,
        ),
        {
            "name": "consumer-side build of one block (info)",
            "value": round(costs["build"] / 1000, 3),
            "unit": "µs",
            "target": None,
            "ok": None,
            "detail": "queued tuple -> wire dict, off the tool's thread",
        },
    ]


def _figure(name: str, micros: float, target: float) -> dict[str, Any]:
    return {
        "name": name,
        "value": round(micros, 3),
        "unit": "µs",
        "target": target,
        "ok": micros <= target,
        "target_text": f"≤ {target:g} µs median",
        "detail": f"median of {BATCHES} batches of {BATCH}",
        "profile": "publish",
    }


# ---------------------------------------------------------------------------------------
# Three processes: the roles
# ---------------------------------------------------------------------------------------


def plain_relay_app(redis_url: str | None = None) -> Any:
    """The plain contender: python-socketio relaying each ``relay_in`` event with one emit
    to its room, no validation (rooms in Redis when ``redis_url`` is given)."""
    import socketio

    manager = socketio.AsyncRedisManager(redis_url) if redis_url else None
    sio = socketio.AsyncServer(async_mode="asgi", client_manager=manager)

    @sio.on("connect", namespace=NS)  # type: ignore[misc]
    async def connect(sid: str, environ: Any, auth: Any = None) -> bool:
        return True

    @sio.on("join_conversation", namespace=NS)  # type: ignore[misc]
    async def join(sid: str, data: Any) -> dict[str, Any]:
        await sio.enter_room(sid, data["conversationId"], namespace=NS)
        return {"ok": True}

    @sio.on("relay_in", namespace=NS)  # type: ignore[misc]
    async def relay_in(sid: str, data: Any) -> None:
        await sio.emit("tool_event_stream", data["block"], room=data["room"], namespace=NS)

    return socketio.ASGIApp(sio)


def role_plain_relay(port: int) -> None:
    import uvicorn

    uvicorn.run(plain_relay_app(), host="127.0.0.1", port=port, log_level="error", lifespan="off")


def role_kx_relay(
    port: int,
    *,
    catch_up: bool = True,
    back_pressure: bool = True,
    probe: bool = False,
    trace: bool = False,
) -> None:
    """kernel_ext's relay as shipped (``create_app``), catch-up on (its default) or off, and
    back-pressure on (its default) or off (``browser_queue_max=None``).

    With ``probe`` it also reads its standard input: a ``STATS`` line is answered with a
    ``STATS`` line holding the relay's :meth:`~kernel_ext.relay.ChatRelay.stats`, any other
    line with a ``MEASURE`` line (after a full garbage collection) holding those, its traced
    memory (``None`` unless ``trace`` started ``tracemalloc`` first) and its resident memory;
    the end of the input stops it."""
    if trace:
        tracemalloc.start()
    import uvicorn

    from kernel_ext.relay import allow_all, create_app

    off: dict[str, Any] = {} if back_pressure else {"browser_queue_max": None}
    ready = create_app(SECRET, authorize_join=allow_all, catch_up=catch_up, **off)
    config = uvicorn.Config(
        ready.app, host="127.0.0.1", port=port, log_level="error", lifespan="off"
    )
    if not probe:
        uvicorn.Server(config).run()
        return

    async def serve_and_answer() -> None:
        server = uvicorn.Server(config)
        serving = asyncio.ensure_future(server.serve())
        reader = await stdin_lines()
        while line := await reader.readline():
            if line.strip() == b"STATS":
                print("STATS " + json.dumps(ready.relay.stats()), flush=True)
                continue
            gc.collect()
            traced = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None
            answer = {"traced": traced, "rss": rss_bytes(os.getpid()), "stats": ready.relay.stats()}
            print("MEASURE " + json.dumps(answer), flush=True)
        server.should_exit = True
        await serving

    asyncio.run(serve_and_answer())


async def role_receiver(port: int, expected: int, timeout: float) -> None:
    import socketio

    client = socketio.AsyncClient(reconnection=False)
    latencies: list[int] = []
    times: list[int] = []
    done = asyncio.Event()

    def on_block(block: dict[str, Any]) -> None:
        now = time.time_ns()
        times.append(now)
        text = block["envelope"]["payload"]["text"]
        head = text.split(" ", 1)[0]
        if head.isdigit():
            latencies.append(now - int(head))
        if len(times) >= expected:
            done.set()

    client.on("tool_event_stream", on_block, namespace=NS)
    await client.connect(
        f"http://127.0.0.1:{port}", namespaces=[NS], transports=["websocket"], wait_timeout=10
    )
    ack = await client.call("join_conversation", {"conversationId": ROOM}, namespace=NS)
    assert ack == {"ok": True}, ack
    print("READY", flush=True)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(done.wait(), timeout)
    if os.environ.get("KX_BENCH_DEBUG"):
        worst = sorted(range(len(latencies)), key=lambda i: -latencies[i])[:20]
        print(
            "DEBUG " + json.dumps([(i, latencies[i] / 1e6) for i in sorted(worst)]), file=sys.stderr
        )
    latencies.sort()
    result = {
        "count": len(times),
        "elapsed": (times[-1] - times[0]) / 1e9 if len(times) > 1 else 0.0,
        "p50": latencies[len(latencies) // 2] / 1e6 if latencies else None,
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] / 1e6
        if latencies
        else None,
    }
    print("RESULT " + json.dumps(result), flush=True)
    await client.disconnect()


async def _paced(seconds: float, send: Any) -> int:
    """Call ``send(stream, i)`` for 100 streams × 10/s, in 10 ms ticks, for ``seconds``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    ticks = int(seconds * 100)
    per_tick = STREAMS * RATE_PER_STREAM // 100
    sent = 0
    for tick in range(ticks):
        wake = start + tick * 0.01
        delay = wake - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        first = (tick % 10) * per_tick
        for stream in range(first, first + per_tick):
            await send(stream, sent)
            sent += 1
    return sent


def _turns(items: Sequence[Any]) -> list[list[Any]]:
    """``items`` in each rotation: block ``i`` goes to the relays in ``turns[i % len]``
    order, so that no relay is always served first."""
    return [[*items[k:], *items[:k]] for k in range(len(items))]


async def role_worker(ports: Sequence[int], kind: str, mode: str, n: int, seconds: float) -> None:
    """Publish the load to the relay at each of ``ports`` (every block to each, the first one
    rotating), through python-socketio clients (``plain``) or a hub and ``LoopbackEmitter``
    each (``kx``)."""
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    if kind == "plain":
        import socketio

        clients = [socketio.AsyncClient(reconnection=False) for _ in urls]
        for client, url in zip(clients, urls, strict=True):
            await client.connect(url, namespaces=[NS], transports=["websocket"], wait_timeout=10)
        turns = _turns(clients)

        async def send(stream: int, i: int) -> None:
            for client in turns[i % len(turns)]:
                text = f"{time.time_ns()} progress of stream {stream}"
                block = loads.block(i + 1, text, f"t{stream}", CALL_ID)
                await client.emit("relay_in", {"room": ROOM, "block": block}, namespace=NS)

        if mode == "burst":
            for i in range(n):
                await send(i % STREAMS, i)
                if i % 200 == 199:
                    await asyncio.sleep(0)
        else:
            await _paced(seconds, send)
        for client in clients:
            flush = {"conversationId": "__flush__"}
            await client.call("join_conversation", flush, namespace=NS)
        await asyncio.sleep(0.5)
        for client in clients:
            await client.disconnect()
        return

    from kernel_ext.attribution.tap import Tap
    from kernel_ext.context import ToolCall, use_tool_call
    from kernel_ext.emit import LoopbackEmitter
    from kernel_ext.stream import StreamHub

    hubs = [
        StreamHub(max_running_per_second=None, max_queue=max(10_000, n), tap=Tap()) for _ in urls
    ]
    emitters = [LoopbackEmitter(url, SECRET, hub=hub) for url, hub in zip(urls, hubs, strict=True)]
    for emitter in emitters:
        await emitter.start()
        await emitter._ready()  # the first connection attempt is over
    turns = _turns([hub.publish for hub in hubs])
    with use_tool_call(ToolCall(CALL_ID, "ask_colleague", ROOM)):

        async def send_kx(stream: int, i: int) -> None:
            for publish in turns[i % len(turns)]:
                publish(f"{time.time_ns()} progress of stream {stream}", task_id=f"t{stream}")

        if mode == "burst":
            for i in range(n):
                for publish in turns[i % len(turns)]:
                    publish(
                        f"{time.time_ns()} progress of stream {i % STREAMS}",
                        task_id=f"t{i % STREAMS}",
                    )
                if i % 200 == 199:
                    await asyncio.sleep(0)
        else:
            await _paced(seconds, send_kx)
    for emitter in emitters:
        await emitter.flush(60)
    await asyncio.sleep(0.5)
    for emitter in emitters:
        await emitter.stop(timeout=5)


# ---------------------------------------------------------------------------------------
# Three processes: orchestration (the plumbing is processes.py's)
# ---------------------------------------------------------------------------------------

SCRIPT = os.path.abspath(__file__)
"""This script: the roles above run as its children (``bench_catchup.py`` and
``bench_backpressure.py`` start its relay role too)."""


async def _one_run(kind: str, mode: str, n: int, seconds: float) -> dict[str, Any]:
    """Relay, receiver and worker as three processes; the receiver's result."""
    (result,) = await side_by_side(kind, mode, n, seconds, ((),))
    return result


async def side_by_side(
    kind: str, mode: str, n: int, seconds: float, relays: Sequence[Sequence[str]]
) -> list[dict[str, Any]]:
    """A relay and a receiver per entry of ``relays`` (the relay started with its arguments
    too) and one worker that publishes the load to each relay at once (every block to each,
    the first one rotating), so that whatever else runs on the machine hits them alike; the
    receivers' results, in order, each with ``relay_cpu``: its relay's CPU seconds from the
    receivers' joins to the receiver's result."""
    ports = [free_port() for _ in relays]
    procs: list[asyncio.subprocess.Process] = []
    try:
        servers = []
        for port, args in zip(ports, relays, strict=True):
            servers.append(
                await spawn(SCRIPT, "--role", f"{kind}-relay", "--port", str(port), *args)
            )
            procs.append(servers[-1])
        for port, relay in zip(ports, servers, strict=True):
            await wait_listening_async(port, process=relay, what="relay", timeout=30)
        expected = n if mode == "burst" else int(seconds * STREAMS * RATE_PER_STREAM)
        receivers = []
        for port in ports:
            receivers.append(
                await spawn(
                    SCRIPT,
                    "--role",
                    "receiver",
                    "--port",
                    str(port),
                    "--n",
                    str(expected),
                    "--timeout",
                    str(PROCESS_TIMEOUT / 2),
                )
            )
            procs.append(receivers[-1])
        for receiver in receivers:
            await read_line(receiver, "READY", 30)
        cpu = [cpu_seconds(relay.pid) for relay in servers]
        also = [arg for port in ports[1:] for arg in ("--also-port", str(port))]
        worker = await spawn(
            SCRIPT,
            "--role",
            "worker",
            "--port",
            str(ports[0]),
            *also,
            "--kind",
            kind,
            "--mode",
            mode,
            "--n",
            str(n),
            "--seconds",
            str(seconds),
        )
        procs.append(worker)
        results = []
        for receiver, relay, before in zip(receivers, servers, cpu, strict=True):
            result: dict[str, Any] = json.loads(
                await read_line(receiver, "RESULT", PROCESS_TIMEOUT)
            )
            result["relay_cpu"] = cpu_seconds(relay.pid) - before
            result["expected"] = expected
            results.append(result)
        return results
    finally:
        for proc in reversed(procs):  # the worker, the receivers, then the relays
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def _relay_figures(n: int, seconds: float, rounds: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"plain": [], "kx": []}
    counts: dict[str, list[int]] = {"plain": [], "kx": []}
    for _ in range(rounds):
        for kind in ("plain", "kx"):
            result = await _one_run(kind, "burst", n, seconds)
            counts[kind].append(result["count"])
            rates[kind].append(result["count"] / result["elapsed"] if result["elapsed"] else 0.0)
    latency: dict[str, list[dict[str, Any]]] = {"plain": [], "kx": []}
    for _ in range(rounds):
        for kind in ("plain", "kx"):
            latency[kind].append(await _one_run(kind, "paced", n, seconds))
    return {"rates": rates, "counts": counts, "latency": latency}


def bench_relay(quick: bool = False) -> list[dict[str, Any]]:
    n = QUICK_THROUGHPUT_N if quick else THROUGHPUT_N
    seconds = QUICK_SECONDS if quick else SECONDS
    figures = asyncio.run(_relay_figures(n, seconds, 1 if quick else ROUNDS))
    plain_rate = statistics.median(figures["rates"]["plain"])
    kx_rate = statistics.median(figures["rates"]["kx"])
    ratio = kx_rate / plain_rate if plain_rate else 0.0
    lat = {
        kind: {
            key: statistics.median(r[key] for r in runs if r[key] is not None)
            if any(r[key] is not None for r in runs)
            else None
            for key in ("p50", "p99", "count", "expected")
        }
        for kind, runs in figures["latency"].items()
    }
    p99s = {kind: [r["p99"] for r in runs] for kind, runs in figures["latency"].items()}
    plain_p99, kx_p99 = lat["plain"]["p99"], lat["kx"]["p99"]
    lat_ratio = kx_p99 / plain_p99 if plain_p99 and kx_p99 else float("inf")
    lost = {k: [n - c for c in v] for k, v in figures["counts"].items()}
    return [
        {
            "name": "relay throughput, kernel_ext vs plain python-socketio relay",
            "value": round(ratio, 2),
            "unit": "×",
            "target": 1.0,
            "target_text": "≥ 1.0×, aim 1.5×",
            "ok": ratio >= 1.0,
            "detail": (
                f"{kx_rate:,.0f} vs {plain_rate:,.0f} blocks/s (median of "
                f"{len(figures['rates']['kx'])}; {n} blocks; aim 1.5×; not received: "
                f"{lost})"
            ),
        },
        {
            "name": "latency p99 at 100 streams × 10/s, kernel_ext vs plain relay",
            "value": round(lat_ratio, 2),
            "unit": "×",
            "target": 1.5,
            "target_text": "≤ 1.5× plain p99",
            "ok": lat_ratio <= 1.5,
            "detail": (
                f"p99 {kx_p99:.2f} ms vs {plain_p99:.2f} ms (medians of runs {p99s}); "
                f"p50 {lat['kx']['p50']:.2f} vs {lat['plain']['p50']:.2f} ms; received "
                f"{lat['kx']['count']:.0f}/{lat['kx']['expected']:.0f} vs "
                f"{lat['plain']['count']:.0f}/{lat['plain']['expected']:.0f} (medians)"
            )
            if plain_p99 and kx_p99
            else f"no latency measured: {lat}",
        },
    ]


def profile_target(name: str) -> Any:
    """The in-process path behind a figure, for the runner's profiler (the relay figures
    live in three child processes: ``None``)."""
    if "publish" in name:
        return lambda: asyncio.run(_publish_costs())
    return None


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Measure every figure; each dict has name, value, unit, target, ok, detail."""
    return [*bench_publish(), *bench_relay(quick)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--also-port", type=int, action="append", default=[])
    parser.add_argument("--kind", default="kx")
    parser.add_argument("--mode", default="burst")
    parser.add_argument("--n", type=int, default=THROUGHPUT_N)
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--timeout", type=float, default=PROCESS_TIMEOUT)
    parser.add_argument("--catch-up", choices=("on", "off"), default="on")
    parser.add_argument("--back-pressure", choices=("on", "off"), default="on")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--trace-memory", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "plain-relay":
        role_plain_relay(args.port)
        return 0
    if args.role == "kx-relay":
        role_kx_relay(
            args.port,
            catch_up=args.catch_up == "on",
            back_pressure=args.back_pressure == "on",
            probe=args.probe,
            trace=args.trace_memory,
        )
        return 0
    if args.role == "receiver":
        asyncio.run(role_receiver(args.port, args.n, args.timeout))
        return 0
    if args.role == "worker":
        logging.getLogger("kernel_ext").setLevel(logging.ERROR)  # quiet shutdown
        ports = [args.port, *args.also_port]
        asyncio.run(role_worker(ports, args.kind, args.mode, args.n, args.seconds))
        return 0
    print(f"kernel_ext stream benchmarks — Python {sys.version.split()[0]}")
    for figure in run(quick=args.quick):
        if figure["ok"] is None:
            verdict, target = "info", ""
        else:
            verdict = "PASS" if figure["ok"] else "MISS"
            op = "≥" if figure["unit"] == "×" and "throughput" in figure["name"] else "≤"
            target = f"(target {op} {figure['target']}{figure['unit']})"
        print(
            f"  {verdict:4}  {figure['name']:<64} {figure['value']:>8}{figure['unit']:<2} "
            f"{target:<18} {figure['detail']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
