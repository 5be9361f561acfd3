"""Stopping a call from its pane (issue 35): how long a browser waits from its ``stop_call``
to the stopped terminal of that call, and what the feature costs the live path.

Run: ``python benchmarks/run.py --only stop`` (or this file directly, ``--quick``). Every
figure starts real processes on 127.0.0.1: web processes as ``kernel-ext relay`` starts them
(``--allow-anyone``), a worker of this file whose tool calls run under the wrapped runtime
(``begin_scope`` + ``run_stoppable``, as the pydantic-ai and OpenAI Agents integrations run
them; async, each publishing through a ``StreamHub``), and browsers that are python-socketio
clients in this process.

* **Stop request → stopped terminal at that browser**, p50 and p99 (target p99 ≤ 100 ms on
  the loopback path, ≤ 250 ms via Redis, on the 2-core machine). The worker opens
  ``SAMPLES`` calls, ``PER_ROOM`` per conversation, each having published one running block
  and then waiting to be stopped; one browser per conversation has joined it. One stop at a
  time: a browser emits ``stop_call`` ``{v: 1, room, callId}`` (with an acknowledgement,
  not waited for) and the time runs until the ``aborted`` block of that call whose payload
  says ``stopped`` reaches that browser. A browser sends at most ``PER_ROOM`` stops, within
  the relay's per-connection burst (5): none is refused for its rate. Every answer must be
  ``stopping`` (checked). *Loopback*: one web process, the worker's ``LoopbackEmitter``
  connected to it; the path is browser → relay → ``kx_stop`` on the worker's connection →
  ``kernel_ext.stop_call`` → the call's task cancelled → its terminal → relay → browser.
  *Redis*: a real redis-server, two web processes on it, a write-only worker
  (``RedisEmitter``: it is connected to no web process), the browsers alternately on either;
  the path is browser → relay → the worker's stop channel on Redis → the worker → its
  terminal published on Redis → every web process → browser.
* **The live path, the feature on vs off** (target: within 5 %). What the feature adds to the path
  of blocks, honestly counted: nothing per block in the relay (its ``stop_call`` handler runs only
  when a browser asks; the open streams' owners it looks up were tracked before, for gone workers)
  and nothing per block in the worker (its ``kx_stop`` handler is one Socket.IO handler, called only
  when asked); per *call*, the worker registers each wrapped call by its callId at its start and
  removes it at its end (``kernel_ext.stop``'s registry), and an async call records its task. So
  *off* is the same worker with that registry's ``register`` / ``note_end`` / ``take_running``
  replaced by no-ops, in the same process and on the same connection; *on* is as shipped. A burst of
  ``BURST_CALLS`` concurrent wrapped calls of ``BURST_BLOCKS`` running blocks each, through one web
  process to one browser, timed from the command to the browser's last terminal (every block checked
  delivered); ``ROUNDS`` rounds, on and off alternating (the first of each pair swapped every
  round), after a warm-up of each; the figure is the median over the rounds of the ratio of on's
  blocks per second to off's. With it, for information, the same ratio of the CPU time the worker
  and the web process spent per delivered block: on a machine shared with other work the wall clock
  of a burst moves with that work, their CPU time much less.

Nothing is tuned to pass: the figures are printed as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from figures import print_figures
from loads import EVENT, NS, SECRET
from processes import (
    RedisServer,
    ask,
    cpu_seconds,
    end_processes,
    free_port,
    read_line,
    spawn,
    stdin_lines,
    wait_listening_async,
)

SAMPLES = 200
QUICK_SAMPLES = 30
PER_ROOM = 5  # the relay's per-connection burst of stop requests: none refused for its rate
BURST_CALLS = 100
BURST_BLOCKS = 50
QUICK_BURST_CALLS = 50
QUICK_BURST_BLOCKS = 40
ROUNDS = 25  # short bursts, many rounds: the median of pairs shrugs off the machine's other work
QUICK_ROUNDS = 2
LOOPBACK_TARGET_MS = 100.0
REDIS_TARGET_MS = 250.0
THROUGHPUT_TARGET = 0.95
STOP_TIMEOUT = 30.0
PROCESS_TIMEOUT = 120.0
TOOL = "ask_colleague"
TASK = "task-1"
_SCRIPT = os.path.abspath(__file__)


# ---------------------------------------------------------------------------------------
# The worker (a child process of this script)
# ---------------------------------------------------------------------------------------


async def role_worker(url: str | None, redis_url: str | None) -> None:
    """A worker whose tool calls run under the wrapped runtime, answering lines on stdin:

    * ``OPEN <prefix> <calls> <per room>`` opens that many calls in conversations
      ``<prefix>-0``, ``<prefix>-1`` …, each publishing one running block and then waiting
      until it is stopped; answers ``OPENED [callId, …]`` once its sender handed them over;
    * ``BURST <on|off> <room> <calls> <blocks>`` runs that many calls at once in ``room``,
      each publishing ``blocks`` running blocks and returning, with the stop registry as
      shipped (``on``) or replaced by no-ops (``off``); answers ``BURST {...}`` once its
      sender handed everything over.

    The end of its input stops it."""
    from opentelemetry.sdk.trace import TracerProvider

    import kernel_ext.instrument._call as runtime
    from kernel_ext import ToolDescription
    from kernel_ext.attribution.tap import Tap
    from kernel_ext.emit import LoopbackEmitter, RedisEmitter
    from kernel_ext.instrument._call import begin_scope, run_stoppable
    from kernel_ext.stream import StreamHub

    hub = StreamHub(max_running_per_second=None, max_queue=1_000_000, tap=Tap())
    emitter: Any
    if redis_url is not None:
        emitter = RedisEmitter(redis_url, hub=hub)
    else:
        assert url is not None
        emitter = LoopbackEmitter(url, SECRET, hub=hub)
    await emitter.start()
    provider = TracerProvider()
    shipped = (runtime.register, runtime.note_end, runtime.take_running)
    no_ops = (lambda call_id, life: None, lambda call_id: None, lambda call_id, default: True)
    open_calls: list[asyncio.Task[Any]] = []
    print("READY", flush=True)

    async def call(room: str, blocks: int, wait: bool, started: list[str]) -> Any:
        active = begin_scope(ToolDescription(TOOL, room), provider, hub)
        assert active is not None
        assert active.call is not None
        started.append(active.call.call_id)

        async def body() -> str:
            for seq in range(blocks):
                hub.publish(f"step {seq}", task_id=TASK)
            if wait:
                await asyncio.Event().wait()  # until stopped
            return "done"

        return await run_stoppable(active, body)

    reader = await stdin_lines()
    while words := (await reader.readline()).decode().split():
        if words[0] == "OPEN":
            prefix, calls, per_room = words[1], int(words[2]), int(words[3])
            ids: list[str] = []
            for i in range(calls):
                room = f"{prefix}-{i // per_room}"
                open_calls.append(asyncio.ensure_future(call(room, 1, True, ids)))
            await asyncio.sleep(0)  # the calls start
            flushed = await emitter.flush(PROCESS_TIMEOUT / 2)
            print("OPENED " + json.dumps({"calls": ids, "flushed": flushed}), flush=True)
        elif words[0] == "BURST":
            setting, room, calls, blocks = words[1], words[2], int(words[3]), int(words[4])
            runtime.register, runtime.note_end, runtime.take_running = (  # type: ignore[assignment]
                shipped if setting == "on" else no_ops
            )
            ids = []
            results = await asyncio.gather(*(call(room, blocks, False, ids) for _ in range(calls)))
            runtime.register, runtime.note_end, runtime.take_running = shipped  # type: ignore[assignment]
            flushed = await emitter.flush(PROCESS_TIMEOUT / 2)
            done = sum(1 for r in results if r == "done")
            print("BURST " + json.dumps({"done": done, "flushed": flushed}), flush=True)
    for task in open_calls:
        task.cancel()
    await asyncio.gather(*open_calls, return_exceptions=True)
    await emitter.stop(timeout=5)


# ---------------------------------------------------------------------------------------
# Browsers (in this process)
# ---------------------------------------------------------------------------------------


class Browser:
    """A python-socketio client joined to one conversation: when each call's stopped
    terminal arrived, and how many blocks and terminals arrived."""

    def __init__(self) -> None:
        import socketio

        self.client = socketio.AsyncClient(reconnection=False)
        self.stopped_at: dict[str, float] = {}
        self.terminals = 0
        self.blocks = 0
        self.changed = asyncio.Event()
        self.client.on(EVENT, self._on_block, namespace=NS)

    def _on_block(self, block: Any) -> None:
        now = time.perf_counter()
        for b in block if isinstance(block, list) else [block]:
            self.blocks += 1
            if b.get("state") == "running":
                continue
            self.terminals += 1
            payload = (b.get("envelope") or {}).get("payload") or {}
            if b.get("state") == "aborted" and payload.get("stopped") is True:
                self.stopped_at.setdefault(b["callId"], now)
        self.changed.set()

    async def connect(self, port: int, room: str) -> None:
        await self.client.connect(
            f"http://127.0.0.1:{port}", namespaces=[NS], transports=["websocket"], wait_timeout=10
        )
        ack = await self.client.call(
            "join_conversation", {"conversationId": room}, namespace=NS, timeout=30
        )
        if not isinstance(ack, dict) or ack.get("ok") is not True:
            raise RuntimeError(f"join refused: {ack}")

    async def until(self, done: Any, timeout: float) -> None:
        """Wait until ``done()`` holds (checked after every block)."""
        async with asyncio.timeout(timeout):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        await self.client.disconnect()


# ---------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------


async def web_process(redis_url: str | None = None) -> tuple[asyncio.subprocess.Process, int]:
    """``kernel-ext relay`` on a free port (on ``redis_url`` when given), listening."""
    port = free_port()
    args = ["--port", str(port), "--allow-anyone", "--log-level", "error"]
    if redis_url is not None:
        args += ["--redis-url", redis_url]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kernel_ext",
        "relay",
        *args,
        env={**os.environ, "KERNEL_EXT_SECRET": SECRET},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,  # its start-up line; an exit is noticed below
        stdin=asyncio.subprocess.DEVNULL,
    )
    await wait_listening_async(port, process=proc, what="web process", timeout=30)
    return proc, port


async def worker(*args: str) -> asyncio.subprocess.Process:
    proc = await spawn(_SCRIPT, "--role", "worker", *args, stdin=asyncio.subprocess.PIPE)
    await read_line(proc, "READY", 30)
    return proc


# ---------------------------------------------------------------------------------------
# Stop → terminal
# ---------------------------------------------------------------------------------------


async def stop_latencies(
    proc: asyncio.subprocess.Process, ports: Sequence[int], samples: int, prefix: str
) -> dict[str, Any]:
    """Open ``samples`` calls and stop them one at a time, each from the browser of its
    conversation (on ``ports`` in turn); the latencies (ms) and the answers."""
    rooms = (samples + PER_ROOM - 1) // PER_ROOM
    browsers = [Browser() for _ in range(rooms)]
    try:
        for i, browser in enumerate(browsers):
            await browser.connect(ports[i % len(ports)], f"{prefix}-{i}")
        opened = json.loads(await ask(proc, f"OPEN {prefix} {samples} {PER_ROOM}", "OPENED", 60))
        calls: list[str] = opened["calls"]
        if not opened["flushed"] or len(calls) != samples:
            raise RuntimeError(f"the worker did not open its calls: {opened}")
        # Every browser has its calls' running blocks: the relays know the streams.
        for i, browser in enumerate(browsers):
            expected = len(calls[i * PER_ROOM : (i + 1) * PER_ROOM])
            await browser.until(lambda b=browser, n=expected: b.blocks >= n, STOP_TIMEOUT)
        answers: dict[str, int] = {}
        latencies: list[float] = []
        for index, call_id in enumerate(calls):
            room = index // PER_ROOM
            browser = browsers[room]
            acked: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            start = time.perf_counter()
            await browser.client.emit(
                "stop_call",
                {"v": 1, "room": f"{prefix}-{room}", "callId": call_id},
                namespace=NS,
                callback=lambda ack=None, f=acked: f.done() or f.set_result(ack),
            )
            await browser.until(lambda b=browser, c=call_id: c in b.stopped_at, STOP_TIMEOUT)
            latencies.append((browser.stopped_at[call_id] - start) * 1000)
            ack = await asyncio.wait_for(acked, STOP_TIMEOUT)
            answer = ack.get("answer") if isinstance(ack, dict) else repr(ack)
            answers[str(answer)] = answers.get(str(answer), 0) + 1
        return {"latencies": latencies, "answers": answers}
    finally:
        for browser in browsers:
            await browser.close()


async def until_worker_listens(proc: asyncio.subprocess.Process, port: int) -> None:
    """Behind Redis the worker subscribes to its stop channel after it starts: stop one call
    until the answer is ``stopping`` (a warm-up, not measured)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    for attempt in range(1_000):
        result = await stop_latencies(proc, [port], 1, f"warm-{attempt}")
        if result["answers"].get("stopping") == 1:
            return
        if loop.time() > deadline:
            raise TimeoutError(f"the worker never answered stopping: {result['answers']}")
        await asyncio.sleep(0.1)  # polling with a deadline


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def loopback_stops(samples: int) -> dict[str, Any]:
    web, port = await web_process()
    proc = await worker("--url", f"http://127.0.0.1:{port}")
    try:
        await stop_latencies(proc, [port], PER_ROOM, "warm")
        return await stop_latencies(proc, [port], samples, "loop")
    finally:
        await end_processes([web, proc], [proc])


async def redis_stops(samples: int) -> dict[str, Any]:
    async with RedisServer() as redis:
        webs = [await web_process(redis.url) for _ in range(2)]
        proc = await worker("--redis", redis.url)
        try:
            await until_worker_listens(proc, webs[1][1])
            return await stop_latencies(proc, [port for _, port in webs], samples, "redis")
        finally:
            await end_processes([*(p for p, _ in webs), proc], [proc])


def stop_figures(loopback: dict[str, Any], redis: dict[str, Any]) -> list[dict[str, Any]]:
    figures = []
    for path, result, target in (
        ("loopback", loopback, LOOPBACK_TARGET_MS),
        ("via Redis", redis, REDIS_TARGET_MS),
    ):
        latencies = result["latencies"]
        p50, p99 = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
        every_stopping = set(result["answers"]) == {"stopping"}
        detail = (
            f"{len(latencies)} stops, one at a time; p50 {p50:.1f} ms, max "
            f"{max(latencies):.1f} ms; answers {result['answers']}"
        )
        figures.append(
            {
                "name": f"stop_call → stopped terminal at the browser, {path}: p50",
                "value": round(p50, 1),
                "unit": "ms",
                "target": None,
                "ok": None,
                "detail": detail,
                "profile": False,
            }
        )
        figures.append(
            {
                "name": f"stop_call → stopped terminal at the browser, {path}: p99",
                "value": round(p99, 1),
                "unit": "ms",
                "target": target,
                "target_text": f"≤ {target:g} ms",
                "ok": p99 <= target and every_stopping,
                "detail": detail,
                "profile": False,
            }
        )
    return figures


# ---------------------------------------------------------------------------------------
# The live path, on vs off
# ---------------------------------------------------------------------------------------


async def live_path(calls: int, blocks: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per setting, the blocks per second at the browser of its bursts and the CPU seconds
    the worker and the web process spent per delivered block, ``rounds`` each."""
    web, port = await web_process()
    proc = await worker("--url", f"http://127.0.0.1:{port}")
    found: dict[str, dict[str, list[float]]] = {
        "rate": {"on": [], "off": []},
        "cpu": {"on": [], "off": []},
    }
    try:
        for round_ in range(-1, rounds):  # round -1: the warm-up of each setting
            order = ("on", "off") if round_ % 2 == 0 else ("off", "on")
            for setting in order:
                room = f"burst-{setting}-{round_}"
                browser = Browser()
                await browser.connect(port, room)
                try:
                    cpu = cpu_seconds(proc.pid) + cpu_seconds(web.pid)
                    start = time.perf_counter()
                    command = f"BURST {setting} {room} {calls} {blocks}"
                    sent = json.loads(await ask(proc, command, "BURST", PROCESS_TIMEOUT))
                    if sent["done"] != calls or not sent["flushed"]:
                        raise RuntimeError(f"the burst did not run: {sent}")
                    await browser.until(lambda b=browser: b.terminals >= calls, PROCESS_TIMEOUT)
                    elapsed = time.perf_counter() - start
                    cpu = cpu_seconds(proc.pid) + cpu_seconds(web.pid) - cpu
                finally:
                    await browser.close()
                delivered = calls * (blocks + 1)
                if browser.blocks != delivered:
                    raise RuntimeError(f"{browser.blocks} of {delivered} blocks delivered")
                if round_ >= 0:
                    found["rate"][setting].append(delivered / elapsed)
                    found["cpu"][setting].append(cpu / delivered)
    finally:
        await end_processes([web, proc], [proc])
    return found


def live_figures(
    found: dict[str, dict[str, list[float]]], calls: int, blocks: int
) -> list[dict[str, Any]]:
    """The ratios on / off, each the median over the rounds of the two bursts of a round."""
    rates, cpus = found["rate"], found["cpu"]
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    cpu_ratios = [on / off for on, off in zip(cpus["on"], cpus["off"], strict=True)]
    ratio, cpu_ratio = statistics.median(ratios), statistics.median(cpu_ratios)
    burst = (
        f"bursts of {calls} concurrent wrapped calls × {blocks} running blocks + terminal, "
        "through one web process to one browser"
    )
    return [
        {
            "name": "live path throughput, the feature on vs off (the worker's stop registry)",
            "value": round(ratio, 3),
            "unit": "×",
            "target": THROUGHPUT_TARGET,
            "target_text": "≥ 0.95× (within 5 %)",
            "ok": ratio >= THROUGHPUT_TARGET,
            "detail": (
                f"median over {len(ratios)} rounds of on / off; {burst}; on "
                f"{statistics.median(rates['on']):,.0f} blocks/s, off "
                f"{statistics.median(rates['off']):,.0f} blocks/s (medians); ratios "
                f"{[round(r, 3) for r in ratios]}"
            ),
            "profile": False,
        },
        {
            "name": "CPU of the worker and the web process per delivered block, on vs off",
            "value": round(cpu_ratio, 3),
            "unit": "×",
            "target": None,
            "ok": None,
            "detail": (
                f"median over {len(cpu_ratios)} rounds of on / off, the same bursts; on "
                f"{statistics.median(cpus['on']) * 1e6:.1f} µs, off "
                f"{statistics.median(cpus['off']) * 1e6:.1f} µs per block (medians): what "
                "the machine's other work does not move as it moves the wall clock"
            ),
            "profile": False,
        },
    ]


# ---------------------------------------------------------------------------------------


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Measure every figure; each dict has name, value, unit, target, ok, detail."""
    samples = QUICK_SAMPLES if quick else SAMPLES
    calls = QUICK_BURST_CALLS if quick else BURST_CALLS
    blocks = QUICK_BURST_BLOCKS if quick else BURST_BLOCKS
    rounds = QUICK_ROUNDS if quick else ROUNDS
    loopback = asyncio.run(loopback_stops(samples))
    redis = asyncio.run(redis_stops(samples))
    found = asyncio.run(live_path(calls, blocks, rounds))
    return [*stop_figures(loopback, redis), *live_figures(found, calls, blocks)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role")
    parser.add_argument("--url")
    parser.add_argument("--redis")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "worker":
        import logging

        logging.getLogger("kernel_ext").setLevel(logging.ERROR)  # quiet shutdown
        asyncio.run(role_worker(args.url, args.redis))
        return 0
    print_figures("stop benchmarks", run(quick=args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
