"""Memory after many finished calls, and the CPU share of a flooding peer (design.md §7).

Run: ``python benchmarks/run.py --only memory`` (or this file directly). :func:`run` returns
the figures as a list of dicts for the runner (``benchmarks/run.py``).

* **Memory after 100,000 finished calls vs. before** (target: ≤ 1 MB = 1,000,000 bytes of
  growth). One call is the whole worker-side path: a real ``execute_tool`` span
  (:func:`kernel_ext.instrument.tool_call_scope` on an SDK ``TracerProvider`` whose only
  processor is :class:`~kernel_ext.attribution.processor.ToolSpanProcessor`, feeding a
  :class:`~kernel_ext.attribution.tap.Tap` and the :class:`~kernel_ext.stream.StreamHub`), inside it
  three running blocks and the ``done`` terminal through :func:`kernel_ext.stream.publish`,
  each call in a conversation of its own, with the default T4 throttle; a sender on the same
  event loop drains the hub (every 256 calls the loop waits until it has caught up) into a
  no-op counting sink. After a warm-up of ``WARMUP`` calls (which fills the bounded
  memories: the closed-stream marks, the processor's ended-span ids) and a full garbage
  collection, memory is read; then the calls run; after draining and collecting it is read
  again. Two passes of the same calls: one reading the resident set size
  (``/proc/self/statm``) without tracing, one with ``tracemalloc`` (started before the
  warm-up, so replaced bounded state counts as freed; the difference of its traced size is
  what the calls left allocated). The hub's and tap's sizes after the run are shown too.
* **CPU of a flooding peer**: one stream gets ``FLOOD_RATE`` running blocks per second (an
  envelope mapping each, as a peer's adapter would pass them) for ``FLOOD_SECONDS``,
  published from a task on the event loop in 10 ms ticks, through the hub (T4 default:
  10 running blocks/s) and a :class:`~kernel_ext.testing.MemoryEmitter`; then the terminal.
  Reported: the process's CPU share (CPU seconds / wall seconds, 1.0 = one core) against the
  same pacing loop that builds the same envelopes but does not publish them, the CPU per
  flooded block, the blocks let through and dropped, and whether the terminal still
  arrived (it must).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from figures import print_figures
from opentelemetry.sdk.trace import TracerProvider

from kernel_ext import ToolDescription
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import Emitter
from kernel_ext.instrument import tool_call_scope
from kernel_ext.stream import Outgoing, OutgoingBlock, StreamHub, publish, set_default_hub
from kernel_ext.testing import MemoryEmitter

CALLS = 100_000
QUICK_CALLS = 20_000
WARMUP = 5_000
BLOCKS_PER_CALL = 3
DRAIN_EVERY = 256
LIMIT_BYTES = 1_000_000

FLOOD_RATE = 10_000
FLOOD_SECONDS = 3.0
QUICK_FLOOD_SECONDS = 1.0
TICK = 0.010


class _Sink(Emitter):
    """A sender that only counts what it is handed."""

    def __init__(self, *, hub: StreamHub) -> None:
        super().__init__(hub=hub)
        self.blocks = 0
        self.terminals = 0
        self.caught_up = asyncio.Event()
        self.want = 0

    async def _send(self, items: list[Outgoing]) -> None:
        n = 0
        for item in items:
            if isinstance(item, OutgoingBlock):
                n += 1
                self.terminals += item.terminal
        self.blocks += n
        if n:
            self.hub.record_delivered(n)
        if self.terminals >= self.want:
            self.caught_up.set()


def _rss_bytes() -> int:
    """Current resident set size (Linux ``/proc``; elsewhere the peak, from ``resource``)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class _Pipeline:
    """Tracer provider + processor + tap + hub + sender, installed as the default hub."""

    def __init__(self) -> None:
        self.tap = Tap()
        self.hub = StreamHub(tap=self.tap)
        self.provider = TracerProvider()
        self.provider.add_span_processor(ToolSpanProcessor(tap=self.tap, sink=self.hub))
        self.sink = _Sink(hub=self.hub)
        self._previous: StreamHub | None = None
        self._ids = itertools.count()
        self.calls = 0

    async def __aenter__(self) -> _Pipeline:
        self._previous = set_default_hub(self.hub)
        await self.sink.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sink.stop(timeout=5.0)
        set_default_hub(self._previous)
        self.provider.shutdown()

    def one_call(self) -> None:
        description = ToolDescription("ask_colleague", f"conv-{next(self._ids)}")
        with tool_call_scope(description, tracer_provider=self.provider, sink=self.hub):
            for step in range(BLOCKS_PER_CALL):
                publish(f"working, step {step}")
            publish("final answer", state="done")
        self.calls += 1

    async def drain(self) -> None:
        sink = self.sink
        sink.want = self.calls
        if sink.terminals < sink.want:
            sink.caught_up.clear()
            await asyncio.wait_for(sink.caught_up.wait(), 30.0)

    async def calls_run(self, n: int) -> None:
        for i in range(n):
            self.one_call()
            if i % DRAIN_EVERY == DRAIN_EVERY - 1:
                await self.drain()
        await self.drain()


def _settle() -> None:
    for _ in range(3):
        gc.collect()


async def _memory_pass(calls: int, traced: bool) -> tuple[int, str]:
    if traced:
        # Traced from before the warm-up, so that bounded state replaced during the run
        # (closed-stream marks, ended-span ids) is counted as freed as well as allocated.
        tracemalloc.start(1)
    async with _Pipeline() as pipeline:
        await pipeline.calls_run(WARMUP)
        _settle()
        if traced:
            before = tracemalloc.get_traced_memory()[0]
            snapshot_before = tracemalloc.take_snapshot()
        else:
            before = _rss_bytes()
        await pipeline.calls_run(calls)
        _settle()
        top = ""
        if traced:
            after = tracemalloc.get_traced_memory()[0]
            snapshot = tracemalloc.take_snapshot().compare_to(snapshot_before, "lineno")
            tracemalloc.stop()
            top = "; ".join(
                f"{stat.traceback[0].filename.rsplit('/', 1)[-1]}:{stat.traceback[0].lineno} "
                f"{stat.size_diff:+,} B"
                for stat in snapshot[:3]
            )
        else:
            after = _rss_bytes()
        stats = pipeline.hub.stats()
        sizes = (
            f"after: tap {len(pipeline.tap)}, hub streams {stats.streams}, calls {stats.calls}, "
            f"closed marks {stats.closed}, queue {stats.queue}; "
            f"blocks sent {pipeline.sink.blocks:,}, dropped {sum(_drops(stats.counts)):,}"
        )
    return after - before, sizes + (f"; largest growth: {top}" if top else "")


def _drops(counts: dict[str, int]) -> list[int]:
    return [v for k, v in counts.items() if k not in ("admitted", "delivered", "degraded")]


def bench_memory(calls: int) -> list[dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    for label, traced in (("RSS", False), ("tracemalloc", True)):
        grown, sizes = asyncio.run(_memory_pass(calls, traced))
        figures.append(
            {
                "name": f"memory growth after {calls:,} finished calls ({label})",
                "value": round(grown / 1e6, 3),
                "unit": "MB",
                "target": LIMIT_BYTES / 1e6,
                "ok": grown <= LIMIT_BYTES,
                "detail": f"{grown:+,} B; {sizes}",
                "profile": "memory",
            }
        )
    return figures


async def _flood(seconds: float, publishing: bool) -> dict[str, Any]:
    hub = StreamHub(tap=Tap())
    emitter = MemoryEmitter(hub=hub)
    previous = set_default_hub(hub)
    provider = TracerProvider()
    provider.add_span_processor(ToolSpanProcessor(tap=Tap(), sink=hub))
    per_tick = int(FLOOD_RATE * TICK)
    sink: Callable[..., None] = publish if publishing else (lambda item, **kw: None)
    loop = asyncio.get_running_loop()
    await emitter.start()
    try:
        with tool_call_scope(
            ToolDescription("ask_colleague", "conv-flood"), tracer_provider=provider, sink=hub
        ):
            seq = 0
            ticks = int(seconds / TICK)
            wall = time.perf_counter()
            cpu = time.process_time()
            deadline = loop.time()
            for _ in range(ticks):
                for _ in range(per_tick):
                    seq += 1
                    sink(
                        {
                            "v": 1,
                            "kind": "text",
                            "streamKey": "task-1",
                            "seq": seq,
                            "status": "running",
                            "payload": {"text": "the colleague is working"},
                        },
                        task_id="task-1",
                    )
                deadline += TICK
                await asyncio.sleep(max(0.0, deadline - loop.time()))
            cpu = time.process_time() - cpu
            wall = time.perf_counter() - wall
            sent_at = time.perf_counter()
            sink("the colleague's answer", task_id="task-1", state="done")
        arrived = False
        latency = float("nan")
        if publishing:
            try:
                await emitter.wait_for(
                    lambda records: any(b["state"] == "done" for _, b in records), 5.0
                )
                arrived = True
                latency = time.perf_counter() - sent_at
            except TimeoutError:
                arrived = False
        stats = hub.stats()
        terminals = len(emitter.terminals())
    finally:
        await emitter.stop(timeout=5.0)
        set_default_hub(previous)
        provider.shutdown()
    return {
        "share": cpu / wall,
        "cpu": cpu,
        "wall": wall,
        "blocks": seq,
        "running_sent": len(emitter.blocks()) - terminals,
        "throttled": stats["throttled"],
        "terminals": terminals,
        "arrived": arrived,
        "latency": latency,
    }


def bench_flood(seconds: float) -> list[dict[str, Any]]:
    base = asyncio.run(_flood(seconds, publishing=False))
    flood = asyncio.run(_flood(seconds, publishing=True))
    extra = flood["cpu"] - base["cpu"]
    per_block_us = extra / flood["blocks"] * 1e6
    return [
        {
            "name": f"flooding peer, {FLOOD_RATE:,} running blocks/s into one stream: CPU share",
            "value": round(flood["share"], 3),
            "unit": "cores",
            "target": None,
            "ok": None,
            "detail": (
                f"{flood['share']:.1%} of one core vs {base['share']:.1%} for the same pacing "
                f"loop without publish(); kernel_ext adds {per_block_us:.2f} µs CPU per flooded "
                f"block; {flood['blocks']:,} blocks in {flood['wall']:.2f} s, "
                f"{flood['running_sent']} running let through, {flood['throttled']:,} throttled"
            ),
            "profile": "flood",
        },
        {
            "name": "flooding peer: the terminal still arrives, exactly once",
            "value": flood["terminals"],
            "unit": "",
            "target": None,  # a yes/no figure: no numeric margin
            "target_text": "arrives, once",
            "ok": bool(flood["arrived"] and flood["terminals"] == 1),
            "detail": (
                f"{flood['terminals']} terminal(s) at the sender, "
                f"{flood['latency'] * 1000:.1f} ms after publish(done)"
            ),
        },
    ]


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Measure every figure; each dict has name, value, unit, target, ok, detail."""
    calls = QUICK_CALLS if quick else CALLS
    seconds = QUICK_FLOOD_SECONDS if quick else FLOOD_SECONDS
    return [*bench_memory(calls), *bench_flood(seconds)]


def profile_target(name: str) -> Callable[[], object] | None:
    """The path behind a figure, for the runner's profiler."""
    if "flood" in name:
        return lambda: asyncio.run(_flood(QUICK_FLOOD_SECONDS, publishing=True))
    if "memory" in name:

        async def calls() -> None:
            async with _Pipeline() as pipeline:
                await pipeline.calls_run(QUICK_CALLS)

        return lambda: asyncio.run(calls())
    return None


def main() -> int:
    quick = "--quick" in sys.argv
    print_figures("memory and flood benchmarks", run(quick=quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
