"""Curve 1 of the scale benchmark (``bench_scale.py``) — fan-out: one conversation, 10
streams × 10 blocks/s, watched by 1 to 200 browsers.

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
    load_rows,
    plot_line,
    point_figures,
)

FANOUT = (1, 10, 50, 200)
QUICK_FANOUT = (1, 10)


async def measure_curve(quick: bool) -> dict[int, Pair]:
    """Each point of the curve, by browsers."""
    points: dict[int, Pair] = {}
    for browsers in QUICK_FANOUT if quick else FANOUT:
        # about 40,000 deliveries per burst (10,000 quick), whatever the fan-out
        setup = Setup(
            rooms=1,
            per_room=browsers,
            streams_per_room=10,
            burst_n=max(400, (10_000 if quick else 40_000) // browsers),
        )
        points[browsers] = await side_by_side(arranged(setup, quick))
    return points


def figures(points: dict[int, Pair]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for browsers, pair in points.items():
        out += point_figures("fan-out", f"{browsers:,} browsers", pair)
    return out


def section(points: dict[int, Pair], plots: dict[str, str]) -> list[str]:
    """The curve's table and plot (markdown lines; none without points)."""
    if not points:
        return []
    return [
        "#### Curve 1 — fan-out: one conversation, 10 streams × 10 blocks/s, watched by N browsers",
        "",
        TABLE_HEAD.format(what="browsers"),
        *(load_rows(f"{b:,}", p) for b, p in points.items()),
        *plot_line(plots, "fanout"),
    ]


def plot(plots: Plots, points: dict[int, Pair]) -> None:
    curve_plot(
        plots,
        "fanout",
        points,
        "browsers watching one conversation",
        burst_rate,
        "delivered blocks/s",
    )
