"""Curve 2 of the scale benchmark (``bench_scale.py``) — breadth: 1 to 5,000 conversations
with one stream × 10 blocks/s and one browser each, and the relay's memory per browser and
per live stream.

Not a ``bench_*`` module: ``benchmarks/run.py`` does not run it.
"""

from __future__ import annotations

from typing import Any

from scale_points import Setup, arranged, side_by_side
from scale_report import (
    TABLE_HEAD,
    Pair,
    Plots,
    burst_rate,
    curve_plot,
    kib,
    load_rows,
    plot_line,
    point_figures,
)

BREADTH = (1, 100, 1_000, 5_000)
QUICK_BREADTH = (1, 100)


async def measure_curve(quick: bool) -> dict[int, Pair]:
    """Each point of the curve, by conversations."""
    points: dict[int, Pair] = {}
    for rooms in QUICK_BREADTH if quick else BREADTH:
        setup = Setup(rooms=rooms, burst_n=5_000 if quick else 20_000)
        points[rooms] = await side_by_side(arranged(setup, quick))
    return points


def figures(points: dict[int, Pair]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rooms, pair in points.items():
        out += point_figures("breadth", f"{rooms:,} conversations", pair)
    return out


def section(points: dict[int, Pair], plots: dict[str, str]) -> list[str]:
    """The curve's tables (loads; the relay's memory) and plot (markdown lines; none
    without points)."""
    if not points:
        return []
    parts = [
        "#### Curve 2 — breadth: N conversations, one stream × 10 blocks/s and one browser each",
        "",
        TABLE_HEAD.format(what="conversations"),
    ]
    parts += [load_rows(f"{r:,}", p) for r, p in points.items()]
    parts += [
        "",
        "| conversations | relay memory per browser (KiB), kernel_ext | plain | relay "
        "memory growth per live stream under load, backlog included (KiB), "
        "kernel_ext | plain |",
        "|---|---|---|---|---|",
    ]
    for rooms, pair in points.items():
        cells = []
        for kind in ("kx", "plain"):
            point = pair[kind]
            cells.append(
                kib((point.relay_rss_connected - point.relay_rss_idle) / rooms)
                if rooms >= 100
                else "—"
            )
        for kind in ("kx", "plain"):
            point = pair[kind]
            loaded = point.loads["paced"].relay_rss_loaded
            cells.append(kib((loaded - point.relay_rss_connected) / rooms) if rooms >= 100 else "—")
        parts.append(f"| {rooms:,} | " + " | ".join(cells) + " |")
    parts += plot_line(plots, "breadth")
    return parts


def plot(plots: Plots, points: dict[int, Pair]) -> None:
    curve_plot(
        plots,
        "breadth",
        points,
        "live conversations (one browser each)",
        burst_rate,
        "delivered blocks/s",
    )
