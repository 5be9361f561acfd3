"""Curve 4 of the scale benchmark (``bench_scale.py``) — workers: one worker with 10 to
1,000 concurrent tool calls at 10 blocks/s each: its CPU share, and the hub's memory per
live call (``tracemalloc``, in process).

Not a ``bench_*`` module: ``benchmarks/run.py`` does not run it.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

from scale_points import Point, Setup, arranged, side_by_side
from scale_report import Pair, Plots, curve_plot, ms, per_block_us, plot_line, point_figures, us

WORKER_CALLS = (10, 100, 1_000)
QUICK_WORKER_CALLS = (10, 100)


async def hub_memory_per_call(calls: int) -> float:
    """Bytes the hub holds per live call with one open stream (``tracemalloc``; the
    ``ToolCall`` records are the kernel's, made before the count starts)."""
    from kernel_ext.attribution.tap import Tap
    from kernel_ext.context import ToolCall, use_tool_call
    from kernel_ext.stream import StreamHub

    hub = StreamHub(max_running_per_second=None, max_queue=1_000_000, tap=Tap())
    consumer = hub.attach_sender()
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


async def measure_curve(quick: bool) -> tuple[dict[int, Pair], dict[int, float]]:
    """Each point of the curve (paced only), and the hub's bytes per live call, by calls."""
    points: dict[int, Pair] = {}
    hub_bytes: dict[int, float] = {}
    for calls in QUICK_WORKER_CALLS if quick else WORKER_CALLS:
        setup = Setup(rooms=1, streams_per_room=calls)
        points[calls] = await side_by_side(arranged(setup, quick), modes=("paced",))
        hub_bytes[calls] = await hub_memory_per_call(calls)
    return points, hub_bytes


def figures(points: dict[int, Pair], hub_bytes: dict[int, float]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for calls, pair in points.items():
        out += point_figures("workers", f"{calls:,} calls", pair)
        kp, pp = pair["kx"].loads["paced"], pair["plain"].loads["paced"]
        out.append(
            {
                "name": f"workers, {calls:,} calls: worker CPU share (info)",
                "value": round(kp.worker_cpu / kp.worker_wall, 3),
                "unit": "cores",
                "target": None,
                "ok": None,
                "detail": f"plain worker {pp.worker_cpu / pp.worker_wall:.3f} cores; "
                f"hub memory {hub_bytes.get(calls, 0):,.0f} B per live call",
            }
        )
    return out


def section(
    points: dict[int, Pair], hub_bytes: dict[int, float], plots: dict[str, str]
) -> list[str]:
    """The curve's table and plot (markdown lines; none without points)."""
    if not points:
        return []
    parts = [
        "#### Curve 4 — workers: one worker, N concurrent tool calls × 10 blocks/s",
        "",
        "| calls | worker CPU share, kernel_ext (cores) | plain worker | worker CPU µs "
        "per block, kernel_ext | plain | hub memory per live call (B) | delivered "
        "kernel_ext | p99 ms kernel_ext | plain p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for calls, pair in points.items():
        kp, pp = pair["kx"].loads["paced"], pair["plain"].loads["paced"]
        parts.append(
            f"| {calls:,} | {kp.worker_cpu / kp.worker_wall:.3f} | "
            f"{pp.worker_cpu / pp.worker_wall:.3f} | "
            f"{us(per_block_us(kp.worker_cpu, kp.sent))} | "
            f"{us(per_block_us(pp.worker_cpu, pp.sent))} | "
            f"{hub_bytes.get(calls, 0):,.0f} | {kp.delivered:,}/{kp.expected:,} | "
            f"{ms(kp.p99)} | {ms(pp.p99)} |"
        )
    parts += plot_line(plots, "workers")
    return parts


def _worker_cpu_share(point: Point) -> float:
    paced = point.loads["paced"]
    return paced.worker_cpu / paced.worker_wall


def plot(plots: Plots, points: dict[int, Pair]) -> None:
    curve_plot(
        plots,
        "workers",
        points,
        "concurrent tool calls in one worker",
        _worker_cpu_share,
        "worker CPU (cores)",
    )
