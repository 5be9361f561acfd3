"""The catch-up benchmark (benchmarks/bench_catchup.py) measures what it says, at a tiny size.

No timing is asserted. What is checked: the on/off runs really start relays with catch-up on
and off (one holds the streams, the other nothing) and count every block at the receiver;
a timed join really received its whole pane before its acknowledgement; the memory rows
come from held streams of the stated size; the figures have the runner's shape, with a
verdict on each target.
"""

from __future__ import annotations

import asyncio

import pytest
import support  # noqa: F401  (benchmarks/ on sys.path, for the imports below)
from support.bench_helpers import check_shape

# isort: split
import bench_catchup

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]


def test_on_and_off_alternate_so_that_drift_hits_both() -> None:
    orders = [bench_catchup._order(r) for r in range(4)]
    assert orders == [("on", "off"), ("off", "on"), ("on", "off"), ("off", "on")]


def test_the_live_path_rows_compare_catch_up_on_with_off_every_block_received() -> None:
    runs = asyncio.run(asyncio.wait_for(bench_catchup.live_path(300, 0.3, 1), 150))
    for mode in ("burst", "paced"):
        for setting in ("on", "off"):
            (result,) = runs[mode][setting]
            assert result["count"] == result["expected"] > 0, (mode, setting, result)
            assert result["relay_cpu"] > 0
    figures = bench_catchup.live_figures(runs, 300)
    check_shape(figures)
    targets = {f["name"]: f["target"] for f in figures if f["target"] is not None}
    assert targets == {
        "live path, catch-up on vs off: relay throughput": 0.95,
        "live path, catch-up on vs off: latency p99 at 100 streams × 10/s": 1.05,
        "live path, catch-up on vs off: relay CPU per delivered block": 1.05,
    }


def test_a_timed_join_receives_the_whole_pane_before_its_acknowledgement() -> None:
    times = asyncio.run(asyncio.wait_for(bench_catchup.join_times((5, 30), 2), 150))
    assert set(times) == {5, 30}
    assert all(len(values) == 2 and min(values) > 0 for values in times.values())
    figures = bench_catchup.join_figures(times)
    check_shape(figures)
    assert [f["name"] for f in figures] == [
        "join → caught up, pane of 5 blocks (info)",
        "join → caught up, pane of 30 blocks (info)",
    ]


def test_the_memory_rows_come_from_held_streams_of_the_stated_size() -> None:
    found = asyncio.run(asyncio.wait_for(bench_catchup.memory(2), 150))
    blocks = 2 * bench_catchup.BLOCKS_PER_STREAM
    on, off = found[("on", True)], found[("off", True)]
    assert off["held_bytes"] == 0  # catch-up off: the relay holds nothing
    assert on["held_streams"] == 3  # the warm-up stream and the two measured
    per_block = on["held_bytes"] / blocks
    assert abs(per_block - bench_catchup.BLOCK_BYTES) <= 0.05 * bench_catchup.BLOCK_BYTES
    figures = bench_catchup.memory_figures(found, 2)
    check_shape(figures)
    names = [f["name"] for f in figures]
    assert names == [
        "relay memory per live stream of 600 blocks, catch-up on (info)",
        "relay memory per live stream of 600 blocks, catch-up off (info)",
        "relay memory per held block, catch-up on (info)",
        "relay memory per wire byte held (replay_bytes), catch-up on (info)",
    ]


def test_the_in_process_rows_time_add_and_block_size_of_a_typical_block() -> None:
    costs = bench_catchup.add_costs()
    assert set(costs) == {
        "below",
        "at_bound",
        "block_size",
        "decode",
        "bytes",
        "gc_held",
        "gc_empty",
        "gc_bytes",
    }
    assert costs["gc_bytes"] >= bench_catchup.GC_HELD * 0.95 * bench_catchup.BLOCK_BYTES
    assert abs(costs["bytes"] - bench_catchup.BLOCK_BYTES) <= 0.05 * bench_catchup.BLOCK_BYTES
    check_shape(bench_catchup.add_figures(costs))
    assert callable(bench_catchup.profile_target("live path, catch-up on vs off: relay throughput"))


def _run(rate: float, cpu_us: float, p99: float | None) -> dict[str, object]:
    return {
        "count": 1_000,
        "expected": 1_000,
        "elapsed": 1_000 / rate,
        "relay_cpu": cpu_us * 1_000 / 1e6,
        "p99": p99,
        "p50": 1.0,
    }


def test_each_ratio_is_taken_within_a_run_where_the_load_hit_both_relays_alike() -> None:
    # Each run's two relays saw the same machine: on is 10 % slower in every run, while a
    # busy third run makes the medians of each side alone say the opposite (180 vs 150).
    on = [_run(90, 110, 11.0), _run(180, 110, None), _run(400, 110, 22.0)]
    off = [_run(100, 100, 10.0), _run(200, 100, 5.0), _run(150, 100, 20.0)]
    runs = {"burst": {"on": on, "off": off}, "paced": {"on": on, "off": off}}
    figures = {f["name"]: f for f in bench_catchup.live_figures(runs, 1_000)}
    throughput = figures["live path, catch-up on vs off: relay throughput"]
    assert throughput["value"] == 0.9
    assert throughput["ok"] is False
    cpu = figures["live path, catch-up on vs off: relay CPU per delivered block"]
    assert cpu["value"] == 1.1
    assert cpu["ok"] is False
    p99 = figures["live path, catch-up on vs off: latency p99 at 100 streams × 10/s"]
    assert p99["value"] == 1.1  # the run without a p99 on one side is left out
    assert p99["ok"] is False
