"""Fixtures, and the check that a test is marked for what it starts.

Helpers live in the ``support`` package (``support.network``, ``support.timing``,
``support.relay_helpers`` …), never here: tests import those, not ``conftest``. The tests
are in folders that mirror the package (tests/relay/, tests/stream/ …); no test module
imports another. What the tests of one folder share is in ``support`` (helpers) or in that
folder's ``conftest.py`` (fixtures: tests/a2a/, tests/stream/, tests/web/); fixtures that
several folders share would go in a ``support`` module registered here with
``pytest_plugins`` (pytest allows it only in this conftest).

Markers (pyproject): ``network`` for a test that starts a server on 127.0.0.1, ``redis``
for one that needs a real redis-server, ``browser`` for one that drives Chromium. They are
enforced twice: at collection, a test using a fixture of :data:`FIXTURE_MARKERS` must carry
its markers; at run time, a test that started something through ``network``'s helpers
(``serve_asgi``, ``wait_listening``, ``RedisServer``, ``chromium`` …) without its marker
fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Generator, Iterator

import pytest
from support import network

FIXTURE_MARKERS = {"redis_server": ("redis", "network")}
"""Fixtures that start something, and the markers every test using one must carry."""


@pytest.fixture
def redis_server(request: pytest.FixtureRequest) -> Iterator[network.RedisServer]:
    """A fresh real redis-server for one test (skips outside CI when not installed); one
    that keeps its data across a restart when the test is parametrized indirectly with
    ``persist=True``."""
    persist = bool(getattr(request, "param", {}).get("persist", False))
    server = network.RedisServer(
        network.need_binary("redis-server", "REDIS_SERVER"), persist=persist
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


def _markers(item: pytest.Item) -> set[str]:
    return {mark.name for mark in item.iter_markers()}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = []
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            missing = network.missing_markers(set(FIXTURE_MARKERS.get(fixture, ())), _markers(item))
            if missing:
                unmarked.append(f"{item.nodeid} uses {fixture} but is not marked {missing}")
    if unmarked:
        raise pytest.UsageError("\n".join(unmarked))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    network.take_started()  # forget what earlier tests started


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield  # a failed or skipped test stays so
    missing = network.missing_markers(network.take_started(), _markers(item))
    if missing:
        marks = ", ".join(f"pytest.mark.{name}" for name in missing)
        pytest.fail(f"this test started what needs {marks}: mark it so", pytrace=False)
