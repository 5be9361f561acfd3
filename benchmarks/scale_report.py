"""What the scale benchmark (``bench_scale.py``) makes of its points, shared by its curves
(``scale_fanout.py``, ``scale_breadth.py``, ``scale_out.py``, ``scale_workers.py``): each
point's figures against the plain relay, the CPU per delivered block, the cells and rows of
the tables, and the plots.

Not a ``bench_*`` module: ``benchmarks/run.py`` does not run it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scale_points import Load, Point

THROUGHPUT_TARGET = 1.0
P99_TARGET = 1.5

Pair = dict[str, Point]
"""A point measured side by side: by contender (``plain``, ``kx``)."""


# ---------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------


def ratio(kx: float | None, plain: float | None) -> float | None:
    if kx is None or not plain:
        return None
    return kx / plain


def ratio_figure(name: str, value: float | None, floor: bool, detail: str) -> dict[str, Any]:
    """A point's ratio to the plain relay, held against the floor (throughput, ≥) or the
    ceiling (p99, ≤) of issue 17; measured in other processes, so never profiled."""
    target = THROUGHPUT_TARGET if floor else P99_TARGET
    ok = None if value is None else (value >= target if floor else value <= target)
    return {
        "name": name,
        "value": round(value, 2) if value is not None else None,
        "unit": "×",
        "target": target,
        "target_text": f"{'≥' if floor else '≤'} {target:.1f}×",
        "profile": False,
        "ok": ok,
        "detail": detail,
    }


def point_figures(curve: str, label: str, pair: Pair) -> list[dict[str, Any]]:
    plain, kx = pair["plain"], pair["kx"]
    figures = []
    if "burst" in kx.loads:
        pb, kb = plain.loads["burst"], kx.loads["burst"]
        figures.append(
            ratio_figure(
                f"{curve}, {label}: throughput vs plain relay",
                ratio(kb.rate, pb.rate),
                True,
                f"{kb.rate:,.0f} vs {pb.rate:,.0f} delivered blocks/s (burst; delivered "
                f"{kb.delivered:,}/{kb.expected:,} vs {pb.delivered:,}/{pb.expected:,})",
            )
        )
    pp, kp = plain.loads["paced"], kx.loads["paced"]
    figures.append(
        ratio_figure(
            f"{curve}, {label}: p99 latency vs plain relay",
            ratio(kp.p99, pp.p99),
            False,
            f"p99 {ms(kp.p99)} vs {ms(pp.p99)} ms, p50 {ms(kp.p50)} vs {ms(pp.p50)} ms "
            f"(paced; delivered {kp.delivered:,}/{kp.expected:,} vs "
            f"{pp.delivered:,}/{pp.expected:,})",
        )
    )
    return figures


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def per_block_us(cpu: float, blocks: int) -> float | None:
    return cpu / blocks * 1e6 if blocks else None


def cpu_load(point: Point) -> Load:
    """The load a point's CPU per block is taken from: the burst (saturated) when measured."""
    return point.loads.get("burst") or point.loads["paced"]


def web_us(point: Point) -> float | None:
    """The sum of the web processes' CPU per delivered block (µs)."""
    load = cpu_load(point)
    return per_block_us(load.relay_cpu, load.delivered)


def redis_us(point: Point) -> float | None:
    """redis-server's CPU per delivered block (µs), ``None`` without Redis."""
    load = cpu_load(point)
    return per_block_us(load.redis_cpu, load.delivered) if point.setup.redis else None


def burst_rate(point: Point) -> float:
    """A point's delivered blocks/s under the burst."""
    return point.loads["burst"].rate


def kib(value: float | None) -> str:
    return "—" if value is None else f"{value / 1024:,.1f}"


def us(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------


def load_rows(label: str, pair: Pair) -> str:
    """A row of a curve's table of loads (:data:`TABLE_HEAD`): the point ``label``."""
    kp, pp = pair["kx"].loads["paced"], pair["plain"].loads["paced"]
    kb, pb = pair["kx"].loads.get("burst"), pair["plain"].loads.get("burst")
    burst = (
        f"{kb.rate:,.0f} | {pb.rate:,.0f} | {ratio(kb.rate, pb.rate) or 0:.2f}×"
        if kb and pb
        else "— | — | —"
    )
    return (
        f"| {label} | {burst} | {ms(kp.p99)} | {ms(pp.p99)} | "
        f"{ratio(kp.p99, pp.p99) or 0:.2f}× | {kp.delivered:,}/{kp.expected:,} | "
        f"{pp.delivered:,}/{pp.expected:,} | "
        f"{us(web_us(pair['kx']))} | {us(web_us(pair['plain']))} |"
    )


TABLE_HEAD = (
    "| {what} | kernel_ext blocks/s (burst) | plain blocks/s | ratio | kernel_ext p99 ms "
    "(paced) | plain p99 ms | ratio | delivered, paced: kernel_ext | plain | relay CPU "
    "µs per delivered block (burst): kernel_ext | plain |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)
"""The head of a curve's table of loads (``what``: the first column's name)."""


def span(values: Sequence[float]) -> str:
    """``low–high`` of ``values`` to the µs, or one figure when they round alike."""
    low, high = f"{min(values):,.0f}", f"{max(values):,.0f}"
    return low if low == high else f"{low}–{high}"


def plot_line(plots: dict[str, str], name: str) -> list[str]:
    if name in plots:
        return ["", f"![{name}]({plots[name]})", ""]
    return ["", "(no plot: matplotlib is not installed; `pip install -e .[bench]`)", ""]


# ---------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------


class Plots:
    """The plots of one run: matplotlib's ``pyplot`` (:attr:`plt`), the directory they are
    written to, and the file written for each curve (:attr:`written`, by name, relative to
    the directory's parent)."""

    def __init__(self, plt: Any, directory: Path) -> None:
        self.plt = plt
        self.directory = directory
        self.written: dict[str, str] = {}

    @classmethod
    def open(cls, directory: Path) -> Plots | None:
        """The plots of a run written to ``directory``; ``None`` without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        plt.rcParams["svg.hashsalt"] = "kernel_ext"  # reproducible ids in the SVG
        return cls(plt, directory)

    def save(self, fig: Any, name: str) -> None:
        """Write ``fig`` as the SVG plot of curve ``name`` and close it."""
        path = self.directory / f"scale-{name}.svg"
        fig.tight_layout()
        fig.savefig(path, format="svg", metadata={"Date": None})
        self.plt.close(fig)
        self.written[name] = f"{self.directory.name}/{path.name}"


def curve_plot(
    plots: Plots,
    name: str,
    points: dict[int, Pair],
    xlabel: str,
    left: Callable[[Point], float],
    left_label: str,
) -> None:
    """A curve's plot: ``left`` of each contender's points (left) and their paced p99
    (right) against the curve's variable on a log scale (nothing without points)."""
    if not points:
        return
    xs = list(points)
    fig, (left_axis, right_axis) = plots.plt.subplots(1, 2, figsize=(10, 3.6))
    for kind, label, style in (("kx", "kernel_ext", "o-"), ("plain", "plain relay", "s--")):
        left_axis.plot(xs, [left(p[kind]) for p in points.values()], style, label=label)
        right_axis.plot(
            xs, [p[kind].loads["paced"].p99 or 0 for p in points.values()], style, label=label
        )
    left_axis.set_ylabel(left_label)
    right_axis.set_ylabel("p99 latency (ms), paced")
    for axis in (left_axis, right_axis):
        axis.set_xscale("log")
        axis.set_xlabel(xlabel)
        axis.grid(True, alpha=0.3)
        axis.legend()
    plots.save(fig, name)
