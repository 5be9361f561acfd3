"""Catch-up (issue 24): what the relay's memory of the conversations' streams costs the live
path, how much memory a live stream takes, and how long a joining browser waits.

Run: ``python benchmarks/run.py --only catchup`` (or this file directly, ``--quick``). Every
figure but the last ones starts real processes on 127.0.0.1, with the roles of
``bench_stream.py``: its relay (``create_app``, catch-up on — the default — or off), its
receiver (a python-socketio client, as a browser) and its worker (``StreamHub`` +
``LoopbackEmitter``), plus, for the held streams, a worker of this file that keeps its calls
open.

* **The live path, catch-up on vs off** (target: within 5 %). The relay rows of
  ``bench_stream.py`` with two relays side by side in each run, one with catch-up on and one
  with it off, each with its receiver, fed the same load at once by one worker (every block
  to both, the relay served first alternating), so that whatever else runs on the machine
  hits both alike; ``ROUNDS`` runs per load, the order of the two swapped every run. Each
  figure is the median over the runs of the ratio on / off within a run. Throughput:
  ``THROUGHPUT_N`` blocks over 100 streams of one conversation as fast as the worker
  publishes them, counted at each receiver — on / off ≥ 0.95. The blocks fill the
  conversation's default bound (4 MiB of wire bytes) about four fifths of the way through,
  so the last ones make the oldest give way: that cost is in. Latency: 100 streams × 10
  blocks/s for ``LATENCY_SECONDS`` s, from ``publish()`` to the receiver's handler — p99
  on / off ≤ 1.05. CPU: the relay's CPU time (user + system) per delivered block over the
  throughput runs — on / off ≤ 1.05. The throughput of three processes sharing two cores is
  bounded by the receiver as much as by the relay, so it hides part of the relay's cost; its
  CPU per block does not (the issue's "the live path pays for catch-up only in memory").
* **Join → caught up**, for panes of 100 and 1,000 blocks (information: how long a reload
  waits; the reference renderer's time to draw them is measured in Chromium, on the
  renderer's side). A relay with catch-up on; a worker process that has published one live
  stream of that many running blocks of about ``BLOCK_BYTES`` bytes and keeps its call open;
  then a python-socketio client (a browser) connects and emits ``join_conversation`` with
  ``have: []``. Timed from the emit to the acknowledgement, by when every block of the
  catch-up has arrived (checked: they come first); the median of ``SAMPLES`` joins, each on
  a new connection, after ``WARMUP``.
* **Relay memory per live stream**, catch-up on and off. A relay process that reports its
  memory after a full garbage collection; a worker publishes one warm-up stream, the memory
  is read, then ``MEMORY_STREAMS`` live streams (one call each, 5 per conversation) of 600
  running blocks of about ``BLOCK_BYTES`` bytes (10 blocks/s for 60 s worth; no terminal),
  ``MEMORY_STEP`` blocks per stream at a time, each step emitted by the relay before the
  next (so that no backlog builds up whose peak would stay in the resident memory), and the
  memory is read again; the growth per stream. Two relay runs per setting: one with
  ``tracemalloc`` (what Python allocated), one without (resident memory). With catch-up on:
  the growth per held block, and its ratio to the wire bytes the bounds count
  (``replay_bytes``): ``replay_total_bytes`` × that ratio is what the held streams can take
  of the relay's memory. Nothing gives way (checked).
* **In process** (information, µs): ``ReplayMemory.add`` of one such block (parsed from JSON,
  as the relay holds it; 100 streams of one conversation) below the bounds and at the
  conversation's bound (each add makes one give way), ``block_size`` of it alone (the JSON
  encode ``add`` does per block), and the relay's validation (``decode``) of it, which every
  block pays with catch-up on or off. Medians of batches. And the CPU of a full garbage
  collection with ``GC_HELD`` such blocks held and with none (held blocks are dicts that
  every full collection traverses).

Nothing is tuned to pass: the figures are printed as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import loads
from bench_stream import SCRIPT as STREAM_SCRIPT
from bench_stream import SECONDS, THROUGHPUT_N, side_by_side
from figures import print_figures
from loads import EVENT, NS, SECRET
from processes import (
    ask,
    end_processes,
    free_port,
    read_line,
    spawn,
    stdin_lines,
    wait_listening_async,
)

# the runner: longer than the common limit (about 80 processes in a full run)
TIMEOUT = 1_200.0

ROUNDS = 7
QUICK_ROUNDS = 2
QUICK_THROUGHPUT_N = 5_000
LATENCY_SECONDS = 8.0  # 8,000 latencies per run: a p99 is not the maximum of a few
QUICK_LATENCY_SECONDS = SECONDS / 2
PANES = (100, 1_000)
SAMPLES = 20
QUICK_SAMPLES = 5
WARMUP = 3
MEMORY_STREAMS = 50
QUICK_MEMORY_STREAMS = 10
STREAMS_PER_CONVERSATION = 5
BLOCKS_PER_STREAM = 600  # 10 blocks/s for 60 s
MEMORY_STEP = 10  # blocks per stream the worker publishes before the relay has emitted them
BLOCK_BYTES = 300
ADD_STREAMS = 100
BATCH = 200
BATCHES = 100
THROUGHPUT_TARGET = 0.95
P99_TARGET = 1.05
CPU_TARGET = 1.05
GC_HELD = 20_000  # blocks held while a full garbage collection is timed
PROCESS_TIMEOUT = 180.0
CALL_BASE = 0xC0FFEE00000000
TASK = "task-1"
TOOL = "ask_colleague"
_SCRIPT = os.path.abspath(__file__)

Found = dict[tuple[str, bool], dict[str, Any]]
"""Per (catch-up setting, traced or not), the growth a memory run measured."""


# ---------------------------------------------------------------------------------------
# The blocks
# ---------------------------------------------------------------------------------------


FILLER = "reading the colleague's answer, line by line; " * 4


def text_of(seq: int, stream: int) -> str:
    """A running block's text: the block's wire size is about ``BLOCK_BYTES`` (the other
    fields of a text block take about 195 bytes)."""
    head = f"step {seq} of stream {stream}: "
    return head + FILLER[: max(0, BLOCK_BYTES - 195 - len(head))]


def wire_block(call: int, seq: int) -> dict[str, Any]:
    """A running block as the relay holds it: parsed from its JSON."""
    block = loads.block(seq, text_of(seq, call), TASK, f"{CALL_BASE + call:016x}")
    parsed: dict[str, Any] = json.loads(json.dumps(block))
    return parsed


# ---------------------------------------------------------------------------------------
# The worker that keeps its streams live (a child process of this script)
# ---------------------------------------------------------------------------------------


async def role_streams_worker(port: int) -> None:
    """A ``LoopbackEmitter`` worker answering lines on stdin: ``PUBLISH <prefix> <streams>
    <per conversation> <blocks>`` publishes that many more running blocks per stream
    (round-robin; one call per stream, made by the first ``PUBLISH`` of ``prefix``, in
    conversations ``<prefix>-0``, ``<prefix>-1`` …), waits until its sender has handed them
    over, and answers ``SENT {...}``; the end of the input stops it (its calls end only
    then: until then every stream is live)."""
    from kernel_ext.attribution.tap import Tap
    from kernel_ext.context import ToolCall, use_tool_call
    from kernel_ext.emit import LoopbackEmitter
    from kernel_ext.stream import StreamHub

    hub = StreamHub(max_running_per_second=None, max_queue=1_000_000, tap=Tap())
    emitter = LoopbackEmitter(f"http://127.0.0.1:{port}", SECRET, hub=hub)
    await emitter.start()
    await emitter._ready()  # the first connection attempt is over
    print("READY", flush=True)
    reader = await stdin_lines()
    made: dict[str, list[ToolCall]] = {}
    while words := (await reader.readline()).decode().split():
        prefix, streams, per_room, blocks = words[1], *(int(w) for w in words[2:5])
        calls = made.get(prefix)
        if calls is None:
            first = sum(map(len, made.values()))
            calls = made[prefix] = [
                ToolCall(f"{CALL_BASE + first + i:016x}", TOOL, f"{prefix}-{i // per_room}")
                for i in range(streams)
            ]
        published = 0
        for _ in range(blocks):
            for index, call in enumerate(calls):
                with use_tool_call(call):
                    hub.publish(text_of(published // len(calls), index), task_id=TASK)
                published += 1
                if published % BATCH == 0:
                    await asyncio.sleep(0)  # let the sender drain
        flushed = await emitter.flush(PROCESS_TIMEOUT / 2)
        print("SENT " + json.dumps({"blocks": published, "flushed": flushed}), flush=True)
    await emitter.stop(timeout=5)


# ---------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------


class Processes:
    """A relay (``bench_stream.py``'s, with ``relay_args``, probed) and a streams worker,
    stopped on exit."""

    def __init__(self, relay_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.relay_args = relay_args
        self.procs: list[asyncio.subprocess.Process] = []
        self.emitted = 0

    async def __aenter__(self) -> Processes:
        self.relay = await spawn(
            STREAM_SCRIPT,
            "--role",
            "kx-relay",
            "--port",
            str(self.port),
            "--probe",
            *self.relay_args,
            stdin=asyncio.subprocess.PIPE,
        )
        self.procs.append(self.relay)
        await wait_listening_async(self.port, process=self.relay, what="relay", timeout=30)
        self.worker = await spawn(
            _SCRIPT,
            "--role",
            "streams-worker",
            "--port",
            str(self.port),
            stdin=asyncio.subprocess.PIPE,
        )
        self.procs.append(self.worker)
        await read_line(self.worker, "READY", 30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await end_processes(self.procs, [self.worker])  # the worker given time to stop

    async def publish(self, prefix: str, streams: int, per_room: int, blocks: int) -> None:
        """Have the worker publish, and wait until the relay has emitted every block (its
        sender does not wait for the acknowledgement of running blocks)."""
        command = f"PUBLISH {prefix} {streams} {per_room} {blocks}"
        sent = json.loads(await ask(self.worker, command, "SENT", PROCESS_TIMEOUT))
        if not sent["flushed"] or sent["blocks"] != streams * blocks:
            raise RuntimeError(f"the worker did not hand everything over: {sent}")
        self.emitted += sent["blocks"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PROCESS_TIMEOUT
        while (await self.stats()).get("blocks_emitted", 0) < self.emitted:
            if loop.time() > deadline:
                raise TimeoutError(f"the relay did not emit {self.emitted} blocks in time")
            await asyncio.sleep(0.05)  # polling with a deadline

    async def stats(self) -> dict[str, int]:
        stats: dict[str, int] = json.loads(await ask(self.relay, "STATS", "STATS", 60))
        return stats

    async def measure(self) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(await ask(self.relay, "MEASURE", "MEASURE", 60))
        return answer


# ---------------------------------------------------------------------------------------
# The live path, on vs off
# ---------------------------------------------------------------------------------------


def _order(round_: int) -> tuple[str, str]:
    """on, off | off, on | on, off …: drift hits both settings alike."""
    return ("on", "off") if round_ % 2 == 0 else ("off", "on")


async def live_path(
    n: int, seconds: float, rounds: int, option: str = "--catch-up"
) -> dict[str, dict[str, list[Any]]]:
    """Per mode and setting, the receivers' results of ``rounds`` runs, each with a relay
    of either setting (of the relay role's ``option``) fed the same load at once."""
    runs: dict[str, dict[str, list[Any]]] = {
        mode: {"on": [], "off": []} for mode in ("burst", "paced")
    }
    for mode in ("burst", "paced"):
        for round_ in range(rounds):
            order = _order(round_)
            relays = [(option, setting) for setting in order]
            results = await side_by_side("kx", mode, n, seconds, relays)
            for setting, result in zip(order, results, strict=True):
                runs[mode][setting].append(result)
    return runs


def _paired(on: Sequence[float | None], off: Sequence[float | None]) -> list[float]:
    """on / off of each run (the two relays of one run), where both were measured."""
    return [a / b for a, b in zip(on, off, strict=True) if a is not None and b]


def _per_run(runs: list[dict[str, Any]], figure: Callable[[dict[str, Any]], Any]) -> list[Any]:
    return [figure(r) for r in runs]


def live_figures(
    runs: dict[str, dict[str, list[Any]]], n: int, what: str = "catch-up"
) -> list[dict[str, Any]]:
    """The ratios on / off (of ``what``): each the median over the runs of the two relays of
    one run."""
    burst, paced = runs["burst"], runs["paced"]

    def rate(r: dict[str, Any]) -> float | None:
        return r["count"] / r["elapsed"] if r["elapsed"] else None

    def cpu(r: dict[str, Any]) -> float | None:
        return r["relay_cpu"] / r["count"] * 1e6 if r["count"] else None

    rates = {s: _per_run(burst[s], rate) for s in burst}
    cpus = {s: _per_run(burst[s], cpu) for s in burst}
    p99s = {s: _per_run(paced[s], lambda r: r["p99"]) for s in paced}
    p50s = {s: _per_run(paced[s], lambda r: r["p50"]) for s in paced}
    ratios = {
        "rate": _paired(rates["on"], rates["off"]),
        "cpu": _paired(cpus["on"], cpus["off"]),
        "p99": _paired(p99s["on"], p99s["off"]),
    }
    value = {key: statistics.median(v) if v else None for key, v in ratios.items()}
    lost = {s: [r["expected"] - r["count"] for r in burst[s]] for s in burst}
    received = {s: [f"{r['count']}/{r['expected']}" for r in paced[s]] for s in paced}
    runs_text = f"median of the ratios of {len(burst['on'])} runs"

    def medians(values: dict[str, list[Any]], digits: int) -> str:
        found = {s: [v for v in values[s] if v is not None] for s in values}
        shown = {s: statistics.median(v) if v else math.nan for s, v in found.items()}
        return f"{shown['on']:,.{digits}f} vs {shown['off']:,.{digits}f}"

    def figure(name: str, key: str, target: float, text: str, detail: str) -> dict[str, Any]:
        found = value[key]
        floor = key == "rate"  # throughput: on / off at least the target; the rest at most
        return {
            "name": f"live path, {what} on vs off: {name}",
            "value": _round(found),
            "unit": "×",
            "target": target,
            "target_text": text,
            "ok": found is not None and (found >= target if floor else found <= target),
            "detail": f"{runs_text}; ratios {_rounded(ratios[key], 3)}; {detail}",
            "profile": "add",
        }

    return [
        figure(
            "relay throughput",
            "rate",
            THROUGHPUT_TARGET,
            "≥ 0.95× (within 5 %)",
            f"{medians(rates, 0)} blocks/s (medians; each run both relays side by side, "
            f"{n:,} blocks over 100 streams of one conversation); not received: {lost}",
        ),
        figure(
            "latency p99 at 100 streams × 10/s",
            "p99",
            P99_TARGET,
            "≤ 1.05× (within 5 %)",
            f"p99 {medians(p99s, 2)} ms, p50 {medians(p50s, 2)} ms (medians); received {received}",
        ),
        figure(
            "relay CPU per delivered block",
            "cpu",
            CPU_TARGET,
            "≤ 1.05× (pays only in memory)",
            f"{medians(cpus, 1)} µs of the relay's CPU (user + system) per block over "
            "the throughput runs (medians)",
        ),
    ]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _rounded(values: Sequence[float], digits: int = 0) -> list[float]:
    return [round(v, digits) for v in values]


# ---------------------------------------------------------------------------------------
# Join -> caught up
# ---------------------------------------------------------------------------------------


async def _join_once(port: int, room: str, blocks: int) -> float:
    """Seconds from the join's emit to its acknowledgement with every block of the
    catch-up in, on a new connection."""
    import socketio

    client = socketio.AsyncClient(reconnection=False)
    got: list[float] = []

    def on_block(block: dict[str, Any]) -> None:
        got.append(time.perf_counter())

    client.on(EVENT, on_block, namespace=NS)
    await client.connect(
        f"http://127.0.0.1:{port}", namespaces=[NS], transports=["websocket"], wait_timeout=10
    )
    try:
        start = time.perf_counter()
        ack = await client.call(
            "join_conversation", {"conversationId": room, "have": []}, namespace=NS, timeout=60
        )
        acked = time.perf_counter()
        replay = ack.get("replay") if isinstance(ack, dict) else None
        if not replay or replay["blocks"] != blocks or replay["missing"] or len(got) != blocks:
            raise RuntimeError(f"not caught up: {len(got)} of {blocks} blocks before {ack}")
        return max(acked, got[-1]) - start
    finally:
        await client.disconnect()


async def join_times(panes: Sequence[int], samples: int) -> dict[int, list[float]]:
    """Per pane size, the join → caught-up times (seconds) of ``samples`` joins."""
    times: dict[int, list[float]] = {}
    async with Processes() as procs:
        for blocks in panes:
            await procs.publish(f"pane{blocks}", 1, 1, blocks)
            room = f"pane{blocks}-0"
            for _ in range(WARMUP):
                await _join_once(procs.port, room, blocks)
            times[blocks] = [await _join_once(procs.port, room, blocks) for _ in range(samples)]
    return times


def join_figures(times: dict[int, list[float]]) -> list[dict[str, Any]]:
    wire = {n: sum(_size(wire_block(0, seq)) for seq in range(1, n + 1)) for n in times}
    figures = []
    for blocks, values in times.items():
        ordered = sorted(values)
        median = statistics.median(ordered)
        p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
        figures.append(
            {
                "name": f"join → caught up, pane of {blocks:,} blocks (info)",
                "value": round(median * 1e3, 2),
                "unit": "ms",
                "target": None,
                "ok": None,
                "detail": (
                    f"median of {len(values)} joins (p90 {p90 * 1e3:.2f} ms, fastest "
                    f"{ordered[0] * 1e3:.2f} ms); {blocks / median:,.0f} blocks/s, "
                    f"{wire[blocks] / median / 1e6:.1f} MB/s of wire bytes "
                    f"({wire[blocks]:,} bytes in all); emit of join_conversation (have: []) → "
                    "its acknowledgement, every block in"
                ),
            }
        )
    return figures


def _size(block: dict[str, Any]) -> int:
    from kernel_ext.protocol import block_size

    return block_size(block)


# ---------------------------------------------------------------------------------------
# Memory per live stream
# ---------------------------------------------------------------------------------------


async def memory_growth(setting: str, trace: bool, streams: int) -> dict[str, Any]:
    """The relay's memory before and after ``streams`` live streams of
    ``BLOCKS_PER_STREAM`` blocks (one warm-up stream before both readings)."""
    args = ["--catch-up", setting, *(["--trace-memory"] if trace else [])]
    async with Processes(args) as procs:
        await procs.publish("warm", 1, 1, BLOCKS_PER_STREAM)
        before = await procs.measure()
        # In steps that the relay emits before the next: no backlog of frames grows in the
        # relay, whose peak would stay in its resident memory.
        for _ in range(BLOCKS_PER_STREAM // MEMORY_STEP):
            await procs.publish("mem", streams, STREAMS_PER_CONVERSATION, MEMORY_STEP)
        after = await procs.measure()
    emitted = after["stats"].get("blocks_emitted", 0) - before["stats"].get("blocks_emitted", 0)
    if emitted != streams * BLOCKS_PER_STREAM:
        raise RuntimeError(f"the relay emitted {emitted} of {streams * BLOCKS_PER_STREAM}")
    gave_way = after["stats"].get("replay_gave_way", 0)
    if gave_way:
        raise RuntimeError(f"{gave_way} blocks gave way: the bounds were reached")
    key = "traced" if trace else "rss"
    return {
        "growth": after[key] - before[key],
        "held_bytes": after["stats"].get("replay_bytes", 0)
        - before["stats"].get("replay_bytes", 0),
        "held_streams": after["stats"].get("replay_streams", 0),
    }


async def memory(streams: int) -> Found:
    return {
        (setting, trace): await memory_growth(setting, trace, streams)
        for trace in (True, False)
        for setting in ("on", "off")
    }


def memory_figures(
    found: dict[tuple[str, bool], dict[str, Any]], streams: int
) -> list[dict[str, Any]]:
    blocks = streams * BLOCKS_PER_STREAM
    on, off = found[("on", True)], found[("off", True)]
    rss_on, rss_off = found[("on", False)], found[("off", False)]
    held = on["held_bytes"]
    per_stream = {key: value["growth"] / streams for key, value in found.items()}
    python = on["growth"] - off["growth"]  # what holding the blocks takes
    python_rss = rss_on["growth"] - rss_off["growth"]
    load = (
        f"{streams} live streams (one call each, {STREAMS_PER_CONVERSATION} per conversation) "
        f"of {BLOCKS_PER_STREAM} running blocks of {held / blocks:.0f} wire bytes on average"
        if held
        else f"{streams} live streams of {BLOCKS_PER_STREAM} blocks"
    )
    figures = [
        {
            "name": f"relay memory per live stream of {BLOCKS_PER_STREAM} blocks, catch-up "
            f"{setting} (info)",
            "value": round(per_stream[(setting, True)]),
            "unit": "bytes",
            "target": None,
            "ok": None,
            "detail": (
                f"tracemalloc growth / streams; resident memory "
                f"{per_stream[(setting, False)]:,.0f} bytes per stream (a run without "
                f"tracing); {load}"
            ),
        }
        for setting in ("on", "off")
    ]
    if held:
        figures += [
            {
                "name": "relay memory per held block, catch-up on (info)",
                "value": round(python / blocks),
                "unit": "bytes",
                "target": None,
                "ok": None,
                "detail": (
                    f"(growth on − growth off) / blocks held, tracemalloc; resident memory "
                    f"{python_rss / blocks:,.0f} bytes; {held / blocks:.0f} wire bytes each "
                    f"(replay_bytes / blocks)"
                ),
            },
            {
                "name": "relay memory per wire byte held (replay_bytes), catch-up on (info)",
                "value": round(python / held, 2),
                "unit": "×",
                "target": None,
                "ok": None,
                "detail": (
                    f"tracemalloc; {python_rss / held:.2f}× in resident memory; "
                    f"{python:,} of Python memory for {held:,} wire bytes: the default "
                    f"replay_total_bytes (64 MiB) can take about {64 * python / held:,.0f} MiB"
                ),
            },
        ]
    return figures


# ---------------------------------------------------------------------------------------
# In process: ReplayMemory.add per block
# ---------------------------------------------------------------------------------------


def _median_per_call(fn: Callable[[Any], Any], items: Sequence[Any]) -> float:
    """Median ns per call of ``fn(item)`` over batches of ``BATCH`` consecutive items."""
    clock = time.perf_counter_ns
    results = []
    for start in range(0, len(items) - BATCH + 1, BATCH):
        batch = items[start : start + BATCH]
        begin = clock()
        for item in batch:
            fn(item)
        results.append((clock() - begin) / BATCH)
    return statistics.median(results)


def _round_robin(streams: int, seqs: range) -> list[dict[str, Any]]:
    return [wire_block(call, seq) for seq in seqs for call in range(streams)]


def add_costs() -> dict[str, float]:
    """ns per ``ReplayMemory.add`` (below the bounds; at the conversation's bound), per
    ``block_size`` and per ``decode`` of a typical block; then :func:`gc_costs`."""
    costs = _add_timings()  # its blocks are gone when the collections are timed
    costs.update(gc_costs())
    return costs


def _add_timings() -> dict[str, float]:
    from kernel_ext.protocol import block_size, decode
    from kernel_ext.relay.replay import ReplayMemory

    count = BATCH * BATCHES
    per_stream = count // ADD_STREAMS
    below = _round_robin(ADD_STREAMS, range(1, per_stream + 1))
    memory = ReplayMemory()
    costs = {"below": _median_per_call(lambda b: memory.add("room", b), below)}
    # At the bound: a conversation bound that the first blocks fill; every later add makes
    # the oldest running block give way.
    full = ReplayMemory(stream_bytes=1 << 20, conversation_bytes=1 << 20)
    filler = _round_robin(ADD_STREAMS, range(1, per_stream + 1))
    for block in filler:
        full.add("room", block)
    more = _round_robin(ADD_STREAMS, range(per_stream + 1, 2 * per_stream + 1))
    costs["at_bound"] = _median_per_call(lambda b: full.add("room", b), more)
    costs["block_size"] = _median_per_call(block_size, below)
    costs["decode"] = _median_per_call(decode, below)
    costs["bytes"] = statistics.mean(block_size(b) for b in below)
    return costs


def _full_collection() -> float:
    """The median CPU seconds of a full garbage collection in this process."""
    times = []
    for _ in range(5):
        start = time.process_time()
        gc.collect()
        times.append(time.process_time() - start)
    return statistics.median(times)


def gc_costs() -> dict[str, float]:
    """A full garbage collection's CPU seconds with ``GC_HELD`` blocks held (of 100 streams,
    within the bounds) and with none."""
    from kernel_ext.relay.replay import ReplayMemory

    memory = ReplayMemory(conversation_bytes=64 << 20)
    for block in _round_robin(ADD_STREAMS, range(1, GC_HELD // ADD_STREAMS + 1)):
        memory.add("room", block)
    held = memory.sizes()["replay_bytes"]
    with_held = _full_collection()
    del memory
    return {"gc_held": with_held, "gc_empty": _full_collection(), "gc_bytes": held}


def _live_adds() -> None:
    """What catch-up adds to the relay in the throughput runs: ``THROUGHPUT_N`` blocks of
    100 streams of one conversation into a ``ReplayMemory`` with the default bounds."""
    from kernel_ext.relay.replay import ReplayMemory

    blocks = _round_robin(ADD_STREAMS, range(1, THROUGHPUT_N // ADD_STREAMS + 1))
    for _ in range(3):
        memory = ReplayMemory()
        for block in blocks:
            memory.add("room", block)


def add_figures(costs: dict[str, float]) -> list[dict[str, Any]]:
    return [
        {
            "name": "ReplayMemory.add of a running block (info)",
            "value": round(costs["below"] / 1000, 3),
            "unit": "µs",
            "target": None,
            "ok": None,
            "detail": (
                f"median of {BATCHES} batches of {BATCH}, blocks of {costs['bytes']:.0f} wire "
                f"bytes, {ADD_STREAMS} streams of one conversation, below the bounds; at the "
                f"conversation's bound (each add makes one give way) "
                f"{costs['at_bound'] / 1000:.3f} µs"
            ),
        },
        {
            "name": f"a full garbage collection with {GC_HELD:,} blocks held (info)",
            "value": round(costs["gc_held"] * 1e3, 1),
            "unit": "ms",
            "target": None,
            "ok": None,
            "detail": (
                f"CPU; {costs['gc_empty'] * 1e3:.1f} ms with none held, in the same process: "
                f"{(costs['gc_held'] - costs['gc_empty']) / GC_HELD * 1e6:.2f} µs per held "
                f"block each time a full collection runs (held blocks are dicts the collector "
                f"traverses; {costs['gc_bytes']:,} wire bytes held)"
            ),
        },
        {
            "name": "block_size() of the same block, inside add (info)",
            "value": round(costs["block_size"] / 1000, 3),
            "unit": "µs",
            "target": None,
            "ok": None,
            "detail": (
                f"its compact JSON encode; the relay's validation (decode) of the same block, "
                f"on or off: {costs['decode'] / 1000:.3f} µs"
            ),
        },
    ]


def profile_target(name: str) -> Callable[[], Any] | None:
    """The in-process path that catch-up adds to the live path (``ReplayMemory.add`` of the
    throughput load, with its garbage collections), for the runner's profiler: the relay
    figures themselves are measured in child processes."""
    return _live_adds if name else None


# ---------------------------------------------------------------------------------------
# The figures
# ---------------------------------------------------------------------------------------


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Measure every figure; each dict has name, value, unit, target, ok, detail."""
    n = QUICK_THROUGHPUT_N if quick else THROUGHPUT_N
    seconds = QUICK_LATENCY_SECONDS if quick else LATENCY_SECONDS
    rounds = QUICK_ROUNDS if quick else ROUNDS
    streams = QUICK_MEMORY_STREAMS if quick else MEMORY_STREAMS
    samples = QUICK_SAMPLES if quick else SAMPLES
    live = asyncio.run(live_path(n, seconds, rounds))
    joins = asyncio.run(join_times(PANES, samples))
    held = asyncio.run(memory(streams))
    return [
        *live_figures(live, n),
        *join_figures(joins),
        *memory_figures(held, streams),
        *add_figures(add_costs()),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "streams-worker":
        import logging

        logging.getLogger("kernel_ext").setLevel(logging.ERROR)  # quiet shutdown
        asyncio.run(role_streams_worker(args.port))
        return 0
    print_figures("catch-up benchmarks", run(quick=args.quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
