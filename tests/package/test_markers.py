"""The marker rule holds for every test: a test that starts a server is marked ``network``,
one that needs redis-server ``redis``, one that drives Chromium ``browser``; conftest fails
one that is not (at collection for fixtures such as ``redis_server``, at run time for what
``network``'s helpers start). Checked on tests/support/markers_probe.py in a child pytest."""

from __future__ import annotations

import os
import subprocess
import sys

from support import ROOT
from support.network import missing_markers

PROBE = "tests/support/markers_probe.py"


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", PROBE, *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_markers_are_what_was_started_and_is_not_marked() -> None:
    assert missing_markers({"network", "redis"}, {"network", "timeout"}) == ["redis"]
    assert missing_markers({"browser"}, {"browser", "network"}) == []
    assert missing_markers(set(), set()) == []


def test_a_test_that_starts_what_it_is_not_marked_for_fails() -> None:
    done = _pytest("-rf")
    report = done.stdout + done.stderr
    assert done.returncode == 1, report
    assert "2 failed, 2 passed" in report, report
    failed = sorted(
        line.split()[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")
    )
    assert failed == [
        f"{PROBE}::test_starts_a_server_unmarked",
        f"{PROBE}::test_starts_redis_marked_network_only",
    ], report
    assert "this test started what needs pytest.mark.network: mark it so" in report
    assert "this test started what needs pytest.mark.redis: mark it so" in report


def test_a_test_using_redis_server_without_its_markers_fails_collection() -> None:
    done = _pytest(MARKERS_PROBE_FIXTURE="1")
    report = done.stdout + done.stderr
    assert done.returncode == 4, report  # a usage error: nothing runs
    assert (
        f"{PROBE}::test_uses_redis_server_unmarked uses redis_server but is not marked "
        "['network', 'redis']"
    ) in report, report
