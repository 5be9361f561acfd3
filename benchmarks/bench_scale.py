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
import asyncio
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import scale_breadth
import scale_fanout
import scale_out
import scale_workers
from figures import print_figures
from scale_report import Pair, Plots, ms, per_block_us, ratio, redis_us, span, us, web_us

QUICK = os.environ.get("KERNEL_EXT_BENCH_QUICK") == "1"
PLOT_DIR_ENV = "KERNEL_EXT_BENCH_PLOTS"
# the runner: a longer limit than the other modules (many processes per point)
TIMEOUT = 1_800.0
CURVES = ("fanout", "breadth", "scaleout", "workers")
"""The curves, each measured by a module of its own: ``scale_fanout.py``,
``scale_breadth.py``, ``scale_out.py`` and ``scale_workers.py`` (their points:
``scale_points.py``, their figures, tables and plots: ``scale_report.py``)."""


class Curves:
    """Every point of the four curves, and what is made of them."""

    def __init__(self) -> None:
        self.fanout: dict[int, Pair] = {}
        self.breadth: dict[int, Pair] = {}
        self.scale_out: dict[str, Pair] = {}
        self.workers: dict[int, Pair] = {}
        self.hub_bytes: dict[int, float] = {}

    def figures(self) -> list[dict[str, Any]]:
        return [
            *scale_fanout.figures(self.fanout),
            *scale_breadth.figures(self.breadth),
            *scale_out.figures(self.scale_out),
            *scale_workers.figures(self.workers, self.hub_bytes),
        ]

    def web_process_curve(self) -> dict[int, Pair]:
        """The scale-out points of the web-process curve, by number of web processes."""
        return scale_out.web_process_curve(self.scale_out)

    def sections(self, plots: dict[str, str]) -> str:
        parts = [
            *scale_fanout.section(self.fanout, plots),
            *scale_breadth.section(self.breadth, plots),
            *scale_out.section(self.scale_out, plots),
            *scale_workers.section(self.workers, self.hub_bytes, plots),
        ]
        capacity = self.capacity()
        if capacity:
            parts += ["#### Capacity (the figures docs/operations.md quotes)", "", *capacity]
        return "\n".join(parts)

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
        cpu = [c for c in (per_block_us(b.relay_cpu, b.delivered) for b in bursts.values()) if c]
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
                f"{most:,} (p99 {ms(paced.p99)} ms) |"
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
                known = [redis_us(p[kind]) for p in self.scale_out.values()]
                spans.append([c for c in known if c is not None])
            if all(spans):
                rows.append(
                    "| redis-server CPU per delivered block (µs; the plain manager's) | "
                    f"{span(spans[0])} ({span(spans[1])}) |"
                )
            curve = self.web_process_curve()
            if 1 in curve and len(curve) > 1:
                most = max(curve)
                found = ratio(web_us(curve[most]["kx"]), web_us(curve[1]["kx"]))
                rows.append(
                    f"| web processes' summed CPU per delivered block, {most} behind Redis vs 1 "
                    f"(room-routed) | {'—' if found is None else f'{found:.2f}×'} |"
                )
                # The same blocks and deliveries over more web processes: without routing
                # (python-socketio's manager, or kernel_ext's beside an older web process)
                # each added process decodes and skips every block of the others' rooms.
                one, many = web_us(curve[1]["plain"]), web_us(curve[most]["plain"])
                skip = None if one is None or many is None else (many - one) / (most - 1)
                rows.append(
                    "| web-process CPU per published block of a room it has no browser in, "
                    f"without routing (µs; the plain Redis manager, 1 to {most} processes) | "
                    f"{us(skip)} |"
                )
        if self.workers:
            most = max(self.workers)
            kp = self.workers[most]["kx"].loads["paced"]
            rows.append(
                f"| worker CPU per published block (µs, {most:,} calls × 10 blocks/s) | "
                f"{us(per_block_us(kp.worker_cpu, kp.sent))} |"
            )
            rows.append(f"| hub memory per live call (B) | {self.hub_bytes.get(most, 0):,.0f} |")
        return rows

    # -- plots -------------------------------------------------------------------------

    def plot(self, directory: Path) -> dict[str, str]:
        """Write one SVG per curve; the file names by curve (empty without matplotlib)."""
        plots = Plots.open(directory)
        if plots is None:
            return {}
        scale_fanout.plot(plots, self.fanout)
        scale_breadth.plot(plots, self.breadth)
        scale_workers.plot(plots, self.workers)
        scale_out.plot(plots, self.scale_out)
        return plots.written


# ---------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------


async def _curves(quick: bool, which: Sequence[str] = CURVES) -> Curves:
    curves = Curves()
    if "fanout" in which:
        curves.fanout = await scale_fanout.measure_curve(quick)
    if "breadth" in which:
        curves.breadth = await scale_breadth.measure_curve(quick)
    if "scaleout" in which:
        curves.scale_out = await scale_out.measure_curve(quick)
    if "workers" in which:
        curves.workers, curves.hub_bytes = await scale_workers.measure_curve(quick)
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
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--curves", default=",".join(CURVES), help="the curves to measure, comma-separated"
    )
    args = parser.parse_args(argv)
    print_figures("scale benchmarks", run(quick=args.quick, only=args.curves.split(",")))
    print(sections())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
