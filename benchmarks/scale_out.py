"""Curve 3 of the scale benchmark (``bench_scale.py``) — scale-out: 1,000 conversations, one
browser each, through one web process without Redis, through 1, 2 and 4 web processes behind
one ``redis-server`` with the worker on the ``RedisEmitter`` path (the web-process curve),
and through two behind Redis with the worker looping back into one; the web processes'
summed CPU and redis-server's per delivered block.

Not a ``bench_*`` module: ``benchmarks/run.py`` does not run it.
"""

from __future__ import annotations

from typing import Any

from scale_points import Setup, arranged, side_by_side
from scale_report import (
    TABLE_HEAD,
    Pair,
    Plots,
    cpu_load,
    load_rows,
    plot_line,
    point_figures,
    ratio,
    redis_us,
    us,
    web_us,
)

SCALE_OUT_ROOMS = 1_000
QUICK_SCALE_OUT_ROOMS = 100
ONE_LOOPBACK = "1 web process, loopback, no Redis"
ONE_REDIS = "1 web process + Redis, RedisEmitter"
TWO_REDIS = "2 web processes + Redis, RedisEmitter"
FOUR_REDIS = "4 web processes + Redis, RedisEmitter"
TWO_LOOPBACK = "2 web processes + Redis, loopback into one"
# The web-process curve: N web processes behind one redis-server, the worker on the
# RedisEmitter path, the same browsers and conversations spread evenly over them.
WEB_PROCESSES = {1: ONE_REDIS, 2: TWO_REDIS, 4: FOUR_REDIS}
# kernel_ext's sum of the web processes' CPU per delivered block at 2 and 4 web processes,
# against its own at one (issue 25): room-routed fan-out keeps it flat.
WEB_CPU_TARGET = 1.2


def web_process_setup(processes: int, rooms: int, burst_n: int) -> Setup:
    """A point of the web-process curve: ``processes`` web processes behind one
    redis-server, the worker on the ``RedisEmitter`` path, one browser per conversation,
    the conversations spread evenly over the web processes."""
    return Setup(
        rooms=rooms, web_processes=processes, redis=True, worker_path="redis", burst_n=burst_n
    )


def scale_out_setups(rooms: int, burst_n: int) -> dict[str, Setup]:
    """The scale-out curve's arrangements by label: one web process without Redis, the
    web-process curve (:data:`WEB_PROCESSES`), and a worker looping back into one of two
    Redis-backed web processes."""
    setups = {ONE_LOOPBACK: Setup(rooms=rooms, burst_n=burst_n)}
    for processes, label in WEB_PROCESSES.items():
        setups[label] = web_process_setup(processes, rooms, burst_n)
    setups[TWO_LOOPBACK] = Setup(rooms=rooms, web_processes=2, redis=True, burst_n=burst_n)
    return setups


async def measure_curve(quick: bool) -> dict[str, Pair]:
    """Each point of the curve, by arrangement."""
    rooms = QUICK_SCALE_OUT_ROOMS if quick else SCALE_OUT_ROOMS
    points: dict[str, Pair] = {}
    for label, setup in scale_out_setups(rooms, 5_000 if quick else 20_000).items():
        points[label] = await side_by_side(arranged(setup, quick))
    return points


def web_process_curve(points: dict[str, Pair]) -> dict[int, Pair]:
    """The scale-out points of the web-process curve, by number of web processes."""
    return {n: points[label] for n, label in WEB_PROCESSES.items() if label in points}


# ---------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------


def figures(points: dict[str, Pair]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for label, pair in points.items():
        out += point_figures("scale-out", label, pair)
    return out + _web_process_figures(points)


def _web_process_figures(points: dict[str, Pair]) -> list[dict[str, Any]]:
    """Each contender's sum of the web processes' CPU per delivered block at N web
    processes against its own at one: held to ``WEB_CPU_TARGET`` for kernel_ext, for
    information for the plain manager; redis-server's CPU per block at the most."""
    curve = web_process_curve(points)
    if 1 not in curve or len(curve) < 2:
        return []
    out: list[dict[str, Any]] = []
    for kind, who in (("kx", "kernel_ext"), ("plain", "plain Redis manager")):
        one = web_us(curve[1][kind])
        base = cpu_load(curve[1][kind])
        for n, pair in curve.items():
            if n == 1:
                continue
            value, load = web_us(pair[kind]), cpu_load(pair[kind])
            found = ratio(value, one)
            judged = kind == "kx"
            out.append(
                {
                    "name": f"scale-out, {n} web processes vs 1: sum of the web processes' "
                    f"CPU per delivered block, {who}" + ("" if judged else " (info)"),
                    "value": round(found, 2) if found is not None else None,
                    "unit": "×",
                    "target": WEB_CPU_TARGET if judged else None,
                    "target_text": f"≤ {WEB_CPU_TARGET:.1f}×" if judged else None,
                    "profile": False,
                    "ok": (found is not None and found <= WEB_CPU_TARGET) if judged else None,
                    "detail": f"{us(value)} vs {us(one)} µs per delivered block (burst; "
                    f"delivered {load.delivered:,}/{load.expected:,} vs "
                    f"{base.delivered:,}/{base.expected:,}); redis-server "
                    f"{us(redis_us(pair[kind]))} vs {us(redis_us(curve[1][kind]))} µs",
                }
            )
    most = max(curve)
    kx, plain = (redis_us(curve[most][kind]) for kind in ("kx", "plain"))
    out.append(
        {
            "name": f"scale-out, {most} web processes: redis-server CPU per delivered "
            "block, kernel_ext (info)",
            "value": round(kx, 1) if kx is not None else None,
            "unit": "µs",
            "target": None,
            "ok": None,
            "detail": f"plain Redis manager {us(plain)} µs (burst)",
        }
    )
    return out


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------


def section(points: dict[str, Pair], plots: dict[str, str]) -> list[str]:
    """The curve's tables (loads; CPU behind Redis) and plots (markdown lines; none without
    points)."""
    if not points:
        return []
    rooms = next(iter(points.values()))["kx"].setup.rooms
    parts = [
        f"#### Curve 3 — scale-out: {rooms:,} conversations, one "
        "browser each, 1 to 4 web processes",
        "",
        TABLE_HEAD.format(what="arrangement"),
    ]
    parts += [load_rows(label, p) for label, p in points.items()]
    parts += plot_line(plots, "scaleout")
    parts += _web_process_table(points)
    parts += plot_line(plots, "processes")
    return parts


def _web_process_table(points: dict[str, Pair]) -> list[str]:
    """The web processes' summed CPU and redis-server's CPU per delivered block of every
    arrangement behind Redis (burst), with the web-process curve's ratios to its own
    one-process point."""
    redis = {label: pair for label, pair in points.items() if pair["kx"].setup.redis}
    if not redis:
        return []
    curve = web_process_curve(points)
    by_label = {WEB_PROCESSES[n]: n for n in curve}
    rows = [
        "Behind Redis: the sum of the web processes' CPU (user + system) and "
        "redis-server's CPU per delivered block over the burst; × 1: against the same "
        "contender with one web process.",
        "",
        "| arrangement | delivered (burst), kernel_ext | plain | web processes' CPU µs per "
        "delivered block, kernel_ext | × 1 | plain | × 1 | redis-server CPU µs per "
        "delivered block, kernel_ext | plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, pair in redis.items():
        cells = []
        for kind in ("kx", "plain"):
            load = cpu_load(pair[kind])
            cells.append(f"{load.delivered:,}/{load.expected:,}")
        for kind in ("kx", "plain"):
            value = web_us(pair[kind])
            one = web_us(curve[1][kind]) if label in by_label and 1 in curve else None
            found = ratio(value, one)
            cells += [us(value), "—" if found is None else f"{found:.2f}×"]
        cells += [us(redis_us(pair[kind])) for kind in ("kx", "plain")]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------


def plot(plots: Plots, points: dict[str, Pair]) -> None:
    """The arrangements' delivered blocks/s (``scaleout``) and the web-process curve's CPU
    per delivered block (``processes``)."""
    plt = plots.plt
    if points:
        labels = list(points)
        fig, axis = plt.subplots(figsize=(10, 3.6))
        width = 0.38
        for offset, (kind, label) in enumerate((("kx", "kernel_ext"), ("plain", "plain relay"))):
            axis.bar(
                [i + (offset - 0.5) * width for i in range(len(labels))],
                [p[kind].loads["burst"].rate for p in points.values()],
                width,
                label=label,
            )
        axis.set_xticks(range(len(labels)), labels, fontsize=8)
        axis.set_ylabel("delivered blocks/s (burst)")
        axis.legend()
        axis.grid(True, axis="y", alpha=0.3)
        plots.save(fig, "scaleout")
    curve = web_process_curve(points)
    if curve:
        xs = list(curve)
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
        for kind, label, style in (
            ("kx", "kernel_ext (routed)", "o-"),
            ("plain", "plain Redis manager", "s--"),
        ):
            left.plot(xs, [web_us(p[kind]) or 0 for p in curve.values()], style, label=label)
            right.plot(xs, [redis_us(p[kind]) or 0 for p in curve.values()], style, label=label)
        left.set_ylabel("web processes' CPU µs per delivered block")
        right.set_ylabel("redis-server CPU µs per delivered block")
        for axis in (left, right):
            axis.set_xticks(xs)
            axis.set_xlabel("web processes behind one redis-server")
            axis.set_ylim(bottom=0)
            axis.grid(True, alpha=0.3)
            axis.legend()
        plots.save(fig, "processes")
