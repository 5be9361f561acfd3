"""The stream hub's fixtures: a fake clock, a tap, a hub on both, an in-process sender
attached to it, an event loop that never runs, and a guard that a test leaves the default hub
as it found it (each test module of the stream rules uses it: ``pytestmark``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from support.timing import FakeClock

from kernel_ext.attribution.tap import Tap
from kernel_ext.stream import StreamHub, set_default_hub
from kernel_ext.testing import MemoryEmitter


@pytest.fixture
def clock() -> FakeClock:
    """The hub's clock, moved by the test."""
    return FakeClock()


@pytest.fixture
def tap() -> Tap:
    return Tap()


@pytest.fixture
def hub(clock: FakeClock, tap: Tap) -> StreamHub:
    """A hub on the fake clock and the tap, with the default bounds."""
    return StreamHub(clock=clock, tap=tap)


@pytest.fixture
async def mem(hub: StreamHub) -> AsyncIterator[MemoryEmitter]:
    """An in-process sender attached to the hub, started; stopped at the end."""
    emitter = MemoryEmitter(hub=hub)
    await emitter.start()
    try:
        yield emitter
    finally:
        await emitter.stop(timeout=1)


@pytest.fixture
def _no_default_hub_leak() -> Iterator[None]:
    """The default hub after the test is the one before it."""
    before = set_default_hub(None)
    set_default_hub(before)
    yield
    set_default_hub(before)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop that never runs: the consumer only needs one to be attached."""
    new = asyncio.new_event_loop()
    yield new
    new.close()
