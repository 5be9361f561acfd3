"""Back-pressure (issue 25): the relay's memory per stream when a worker publishes faster
than the relay delivers, with back-pressure on and off, side by side in one run; and what
back-pressure costs the live path.

Two processes on 127.0.0.1: a relay (``create_app`` under uvicorn, catch-up off so that its
bounded memory, at most 1 MiB per stream, does not hide the queues; in a process of its
own whose resident memory is read from ``/proc`` while the load runs), and this one
as the worker (the real ``LoopbackEmitter`` and ``StreamHub``, throttle off, default queue
bound) and the browsers (a real python-socketio client in each stream's room, 20 streams).
First the relay's capacity is measured: blocks delivered per second to the browsers while
the worker publishes as fast as it can. Then the worker publishes at 2× and 5× that rate
for a few seconds, against a relay with back-pressure on (``browser_queue_max`` at its
default) and off (``None``: the relay before back-pressure, to which the sender sends as
before), and ends every stream. Per point: the relay's peak resident memory above its
level before the load, per stream; blocks published, delivered and dropped (by reason,
counted by the hub); the sender's waits on a full window; whether every terminal arrived,
once. Memory per stream with back-pressure on is held against the same figure at 2×: it
must not grow with the overload (≤ 1.25× it, or within 0.1 MB of it: the resident memory's
noise over 20 streams).

The live path, back-pressure on vs off: ``bench_catchup.py``'s live-path rows (its
processes, loads, rounds and targets: throughput, p99 latency at 100 streams × 10 blocks/s
and the relay's CPU per block, each the median of the on / off ratios of runs with both
relays fed the same load at once), with the relay's back-pressure as the setting (the
worker's sender paces itself on the relay that says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

from bench_catchup import (
    LATENCY_SECONDS,
    QUICK_LATENCY_SECONDS,
    QUICK_ROUNDS,
    QUICK_THROUGHPUT_N,
    ROUNDS,
    live_figures,
    live_path,
)
from bench_stream import THROUGHPUT_N
from processes import free_port, rss_bytes, spawn, wait_listening_async

SECRET = "bench-backpressure-secret"
TIMEOUT = 900.0  # run.py: longer than the common limit (about 70 processes in a full run)
STREAMS = 20
SECONDS = 4.0
QUICK_SECONDS = 2.0
TEXT = "y" * 400
FACTORS = (2, 5)
GROWTH_TARGET = 1.25
NOISE_MB = 0.1
_SCRIPT = os.path.abspath(__file__)


def role_relay(port: int, paced: bool) -> None:
    """The relay: back-pressure on (the default) or off."""
    import uvicorn

    from kernel_ext.relay import allow_all, create_app

    options: dict[str, Any] = {"catch_up": False}
    if not paced:
        options["browser_queue_max"] = None
    ready = create_app(SECRET, authorize_join=allow_all, **options)
    uvicorn.run(ready.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


async def _browsers(port: int, got: list[int], ended: list[int], done: asyncio.Event) -> list[Any]:
    """One real python-socketio client in each stream's room, counting what reaches it."""
    import socketio

    def receiver(i: int) -> Any:
        def on_block(block: dict[str, Any]) -> None:
            got[i] += 1
            if block["state"] != "running":
                ended[i] += 1
                if all(ended):
                    done.set()

        return on_block

    clients = []
    for i in range(STREAMS):
        client = socketio.AsyncClient(reconnection=False)
        client.on("tool_event_stream", receiver(i), namespace="/chat")
        clients.append(client)
        await client.connect(
            f"http://127.0.0.1:{port}", namespaces=["/chat"], transports=["websocket"]
        )
        await client.call("join_conversation", {"conversationId": f"c{i}"}, namespace="/chat")
    return clients


async def _point(paced: bool, rate: float | None, seconds: float) -> dict[str, Any]:
    """One run: ``rate`` blocks/s over all streams (``None``: as fast as the sender takes
    them), for ``seconds``, then every stream's terminal."""
    from kernel_ext.context import ToolCall, use_tool_call
    from kernel_ext.emit import LoopbackEmitter
    from kernel_ext.stream import StreamHub

    port = free_port()
    proc = await spawn(_SCRIPT, "relay", str(port), "1" if paced else "0")
    clients: list[Any] = []
    got, ended = [0] * STREAMS, [0] * STREAMS
    done = asyncio.Event()
    try:
        await wait_listening_async(port, process=proc, what="relay", timeout=30)
        clients = await _browsers(port, got, ended, done)
        hub = StreamHub(max_running_per_second=None)
        connected = asyncio.Event()
        emitter = LoopbackEmitter(
            f"http://127.0.0.1:{port}",
            SECRET,
            hub=hub,
            on_health=lambda up: connected.set() if up else None,
        )
        await emitter.start()
        await asyncio.wait_for(connected.wait(), 10)
        loop = asyncio.get_running_loop()
        base = peak = rss_bytes(proc.pid)
        calls = [ToolCall(f"{i + 1:016x}", "ask_colleague", f"c{i}") for i in range(STREAMS)]
        start = loop.time()
        published = 0
        while (now := loop.time()) - start < seconds:
            # Paced: what the rate owes by now; unpaced: whatever the sender took meanwhile.
            target = published + STREAMS * 10 if rate is None else int(rate * (now - start))
            if rate is None and hub.queue_size:
                target = published
            for n in range(published, target):
                with use_tool_call(calls[n % STREAMS]):
                    hub.publish(TEXT, task_id="t")
            published = max(published, target)
            peak = max(peak, rss_bytes(proc.pid))
            await asyncio.sleep(0.005 if rate is not None else 0)  # the publisher's pace
        elapsed = loop.time() - start
        for call in calls:
            with use_tool_call(call):
                hub.publish("answer", task_id="t", state="done")
        deadline = loop.time() + 120
        while not done.is_set() and loop.time() < deadline:
            peak = max(peak, rss_bytes(proc.pid))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 0.05)
        drained = loop.time() - start
        await emitter.stop(10)
        counts = hub.stats().counts
        return {
            "published": published,
            "rate": round(published / elapsed),
            "browser_blocks_per_s": round((sum(got) - sum(ended)) / drained),
            "delivered": counts.get("delivered", 0),
            "dropped": {
                k: v for k, v in counts.items() if k not in ("admitted", "delivered", "degraded")
            },
            "mb_per_stream": (peak - base) / STREAMS / 1e6,
            "terminals_once": sum(1 for e in ended if e == 1),
            "window_full": emitter.counts["window_full"],
            "ack_timeouts": emitter.counts["ack_timeouts"],
        }
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.disconnect(), 5)
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


def _detail(row: dict[str, Any]) -> str:
    dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(row["dropped"].items())) or "none"
    return (
        f"published {row['published']:,} at {row['rate']:,}/s; delivered {row['delivered']:,}; "
        f"dropped: {dropped}; terminals once {row['terminals_once']}/{STREAMS}; "
        f"window full {row['window_full']}×; ack timeouts {row['ack_timeouts']}"
    )


async def _all(quick: bool) -> list[dict[str, Any]]:
    seconds = QUICK_SECONDS if quick else SECONDS
    capacity = (await _point(True, None, seconds))["browser_blocks_per_s"]
    figures: list[dict[str, Any]] = [
        {
            "name": "back-pressure: the relay's capacity (blocks/s to 20 browsers)",
            "value": capacity,
            "unit": "blocks/s",
            "target": None,
            "ok": None,
            "detail": "the worker publishing as fast as the sender takes blocks",
            "profile": False,
        }
    ]
    on_at_2x = None
    for factor in FACTORS:
        for paced in (False, True):
            row = await _point(paced, capacity * factor, seconds)
            all_ended = row["terminals_once"] == STREAMS
            name = f"back-pressure {'on' if paced else 'off'}: relay memory per stream at {factor}×"
            figure: dict[str, Any] = {
                "name": name,
                "value": round(row["mb_per_stream"], 2),
                "unit": "MB",
                "target": None,
                "ok": all_ended if not paced else None,
                "detail": _detail(row),
                "profile": False,
            }
            if paced:
                if on_at_2x is None:
                    on_at_2x = row["mb_per_stream"]
                    figure["ok"] = all_ended
                else:
                    limit = max(on_at_2x * GROWTH_TARGET, on_at_2x + NOISE_MB)
                    figure["target"] = round(limit, 2)
                    figure["target_text"] = (
                        f"≤ {GROWTH_TARGET}× the 2× figure (or + {NOISE_MB} MB), every terminal"
                    )
                    figure["ok"] = row["mb_per_stream"] <= limit and all_ended
            figures.append(figure)
    return figures


async def _live(quick: bool) -> list[dict[str, Any]]:
    n = QUICK_THROUGHPUT_N if quick else THROUGHPUT_N
    seconds = QUICK_LATENCY_SECONDS if quick else LATENCY_SECONDS
    runs = await live_path(n, seconds, QUICK_ROUNDS if quick else ROUNDS, "--back-pressure")
    figures = live_figures(runs, n, "back-pressure")
    for figure in figures:
        figure["profile"] = False  # the path runs in other processes
    return figures


def run(quick: bool = False) -> list[dict[str, Any]]:
    figures = asyncio.run(_all(quick))
    return figures + asyncio.run(_live(quick))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "relay":
        role_relay(int(sys.argv[2]), sys.argv[3] == "1")
    else:
        began = time.perf_counter()
        for result in run(quick="--quick" in sys.argv):
            print(result)
        print(f"({time.perf_counter() - began:.0f} s)")
