"""The abuse benchmark (benchmarks/bench_abuse.py) measures what it says, at its quick size.

No timing is asserted. What is checked: a probe runs against the real relay with the bounds
off and on, the bystander receives its live blocks in order throughout, and the figures
compare what they claim to (the leave/join loop is limited only with the bounds on, and
costs the attacker's connection far fewer bytes then).
"""

from __future__ import annotations

import asyncio
import re
import sys

import pytest
import support  # noqa: F401  (benchmarks/ on sys.path, for the imports below)

# isort: split
import bench_abuse

pytestmark = [
    pytest.mark.network,
    pytest.mark.timeout(240),
    # The benchmark runs under tox -e bench, on Python 3.11 (it uses asyncio.timeout).
    pytest.mark.skipif(sys.version_info < (3, 11), reason="tox -e bench runs Python 3.11"),
]


def _limited(detail: str) -> int:
    found = re.search(r"(\d+) acknowledged limited", detail)
    assert found, detail
    return int(found.group(1))


def test_the_leave_join_loop_is_limited_only_with_the_bounds_on() -> None:
    off = asyncio.run(asyncio.wait_for(bench_abuse.measure("off", "a", True), 200))
    on = asyncio.run(asyncio.wait_for(bench_abuse.measure("on", "a", True), 200))
    for result in (off, on):
        assert result["live"] > 0, result
        assert result["in_order"] is True, result
    assert _limited(off["detail"]) == 0, off["detail"]
    assert _limited(on["detail"]) > 0, on["detail"]
    assert on["amplification"] < off["amplification"], (on, off)
