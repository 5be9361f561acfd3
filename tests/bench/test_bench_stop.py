"""The stop benchmark (benchmarks/bench_stop.py) measures what it says, at a tiny size.

No timing is asserted. What is checked: on the loopback path and behind a real
redis-server (two web processes, a write-only worker), every stop the browsers send is
answered ``stopping`` and its stopped terminal reaches the browser that asked, one latency
each; the live path's bursts run with the stop registry on and off and every call's
terminal reaches the browser; the figures have the runner's shape, with a verdict on each
target.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
import support  # noqa: F401  (benchmarks/ on sys.path, for the imports below)
from support.bench_helpers import check_shape

# isort: split
import bench_stop

pytestmark = [
    pytest.mark.network,
    pytest.mark.timeout(180),
    # The benchmark runs under tox -e bench, on Python 3.11 (it uses asyncio.timeout).
    pytest.mark.skipif(sys.version_info < (3, 11), reason="tox -e bench runs Python 3.11"),
]

SAMPLES = 7  # more than one browser's burst: two conversations, two browsers


def _check_stops(result: dict[str, object]) -> None:
    assert result["answers"] == {"stopping": SAMPLES}, result
    latencies = result["latencies"]
    assert isinstance(latencies, list)
    assert len(latencies) == SAMPLES
    assert all(latency > 0 for latency in latencies), latencies


def test_loopback_stops_reach_the_worker_and_each_terminal_its_browser() -> None:
    _check_stops(asyncio.run(asyncio.wait_for(bench_stop.loopback_stops(SAMPLES), 150)))


@pytest.mark.redis
def test_behind_redis_a_write_only_workers_calls_stop_from_either_web_process() -> None:
    result = asyncio.run(asyncio.wait_for(bench_stop.redis_stops(SAMPLES), 150))
    _check_stops(result)
    figures = bench_stop.stop_figures(result, result)
    check_shape(figures)
    assert [f["unit"] for f in figures] == ["ms"] * 4


def test_the_live_path_runs_with_the_stop_registry_on_and_off() -> None:
    found = asyncio.run(asyncio.wait_for(bench_stop.live_path(10, 5, 1), 150))
    for measured in (found["rate"], found["cpu"]):
        assert [len(measured["on"]), len(measured["off"])] == [1, 1]
        assert all(value > 0 for value in measured["on"] + measured["off"]), found
    figures = bench_stop.live_figures(found, 10, 5)
    check_shape(figures)
    assert figures[0]["target"] == bench_stop.THROUGHPUT_TARGET
    assert figures[1]["target"] is None
