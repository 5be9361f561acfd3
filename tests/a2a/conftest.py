"""The A2A tests' fixtures: a real colleague and a pane (their types in support.a2a_helpers)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from support.a2a_helpers import Colleague, Pane
from support.network import free_port, serve_asgi
from support.timing import FakeClock

from kernel_ext.attribution.tap import Tap
from kernel_ext.stream import StreamHub
from kernel_ext.testing import MemoryEmitter
from kernel_ext.testing.a2a_peer import ScriptedPeer


@pytest.fixture
async def colleague() -> AsyncIterator[Colleague]:
    port = free_port()
    peer = ScriptedPeer(f"http://127.0.0.1:{port}/", flood_count=100)
    async with serve_asgi(peer.app, port):
        try:
            yield Colleague(f"http://127.0.0.1:{port}", peer)
        finally:
            await peer.aclose()


@pytest.fixture
async def pane() -> AsyncIterator[Pane]:
    clock = FakeClock(5000.0)
    hub = StreamHub(clock=clock, tap=Tap())
    emitter = MemoryEmitter(hub=hub)
    await emitter.start()
    try:
        yield Pane(hub, emitter, clock)
    finally:
        await emitter.stop(timeout=2)
