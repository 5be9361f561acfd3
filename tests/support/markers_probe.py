"""Tests that break the marker rule on purpose, run only by test_markers.py in a child
pytest (the file's name keeps it out of the suite's own collection)."""

from __future__ import annotations

import os

import pytest

from support import network


def test_starts_a_server_unmarked() -> None:
    network.started("network")


@pytest.mark.network
def test_starts_redis_marked_network_only() -> None:
    network.started("redis", "network")


@pytest.mark.network
@pytest.mark.redis
def test_starts_redis_marked_for_it() -> None:
    network.started("redis", "network")


def test_starts_nothing() -> None:
    pass


if os.environ.get("MARKERS_PROBE_FIXTURE"):

    def test_uses_redis_server_unmarked(redis_server: network.RedisServer) -> None:
        pass
