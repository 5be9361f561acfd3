"""The terminals a sender owes (kernel_ext.emit.owed_terminals): bounded in count, age and
attempts, each give-up counted and logged; a refused terminal degraded one step at a time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from support.timing import FakeClock

from kernel_ext.attribution.tap import Tap
from kernel_ext.emit.owed_terminals import OwedTerminal, OwedTerminals
from kernel_ext.errors import ConfigError
from kernel_ext.protocol import (
    FALLBACK_INVALID,
    FALLBACK_TOO_LARGE,
    TRUNCATION_MARKER,
    block_size,
    text_block,
)
from kernel_ext.stream import OutgoingBlock, SenderPort, StreamHub

CALL = "00f067aa0ba902b7"


def terminal(task: str = "t", text: str = "the answer") -> OutgoingBlock:
    block = text_block(CALL, task, "done", 1_000_000_000_000, 3, text)
    return OutgoingBlock("conv", block, CALL, task, True, block_size(block))


def held(
    port: SenderPort,
    clock: FakeClock,
    *,
    count: int = 10,
    age: float = 60.0,
    attempts: int = 3,
) -> OwedTerminals:
    return OwedTerminals(
        lambda: port,
        max_pending_terminals=count,
        terminal_max_age=age,
        terminal_max_attempts=attempts,
        clock=clock,
    )


@pytest.fixture
def hub() -> StreamHub:
    return StreamHub(tap=Tap())


@pytest.fixture
def port(hub: StreamHub) -> Iterator[SenderPort]:
    """The hub's port, as a sender holds it (its loop never runs: nothing waits on it)."""
    loop = asyncio.new_event_loop()
    try:
        yield hub.attach_sender(loop)
    finally:
        loop.close()


def test_owed_terminals_come_back_oldest_first_and_are_no_longer_held(
    hub: StreamHub, port: SenderPort
) -> None:
    clock = FakeClock()
    owed = held(port, clock)
    entries = [owed.new(terminal(f"t{i}"), attempts=1) for i in range(3)]
    for entry in entries:
        owed.hold(entry)
    assert len(owed) == 3
    assert owed.take() == entries
    assert len(owed) == 0
    assert hub.stats().counts.get("terminal_expired", 0) == 0


def test_beyond_the_count_bound_the_oldest_is_given_up_counted_and_logged(
    hub: StreamHub, port: SenderPort, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    owed = held(port, clock, count=2)
    entries = [owed.new(terminal(f"t{i}"), attempts=1) for i in range(3)]
    with caplog.at_level(logging.ERROR, logger="kernel_ext.emit"):
        for entry in entries:
            owed.hold(entry)
    assert owed.take() == entries[1:]
    assert hub.stats()["terminal_overflow"] == 1
    assert "terminal of (00f067aa0ba902b7, t0) given up" in caplog.text


def test_age_counts_from_the_first_attempt_even_when_held_again_later(
    hub: StreamHub, port: SenderPort
) -> None:
    clock = FakeClock()
    owed = held(port, clock, age=60.0, attempts=100)
    entry = owed.new(terminal(), attempts=1)
    owed.hold(entry)
    clock.now += 59.0
    (again,) = owed.take()
    again.attempts += 1
    owed.hold(again)  # held anew, but first tried 59 s ago
    clock.now += 2.0
    assert owed.take() == []
    assert hub.stats()["terminal_expired"] == 1


def test_a_spent_terminal_is_given_up_when_held_and_expire_keeps_the_rest(
    hub: StreamHub,
    port: SenderPort,
) -> None:
    clock = FakeClock()
    owed = held(port, clock, age=60.0, attempts=3)
    spent = owed.new(terminal("spent"), attempts=3)
    owed.hold(spent)
    assert len(owed) == 0
    assert hub.stats()["terminal_expired"] == 1
    old = owed.new(terminal("old"), attempts=1)
    owed.hold(old)
    clock.now += 30.0
    young = owed.new(terminal("young"), attempts=1)
    owed.hold(young)
    clock.now += 31.0
    owed.expire()
    assert hub.stats()["terminal_expired"] == 2
    assert owed.take() == [young]


def test_abandon_forgets_without_counting(hub: StreamHub, port: SenderPort) -> None:
    owed = held(port, FakeClock())
    owed.hold(owed.new(terminal(), attempts=1))
    assert owed.abandon() == 1
    assert len(owed) == 0
    assert not any(k.startswith("terminal_") for k in hub.stats().counts)


def test_bad_bounds_are_refused_naming_the_senders_argument(port: SenderPort) -> None:
    with pytest.raises(ConfigError, match="max_pending_terminals"):
        held(port, FakeClock(), count=0)
    with pytest.raises(ConfigError, match="terminal_max_age"):
        held(port, FakeClock(), age=-1.0)
    with pytest.raises(ConfigError, match="terminal_max_attempts"):
        held(port, FakeClock(), attempts=0)


def test_a_terminal_refused_as_too_large_is_cut_to_the_bound_then_replaced_then_lost(
    hub: StreamHub, port: SenderPort, caplog: pytest.LogCaptureFixture
) -> None:
    owed = held(port, FakeClock())
    entry = owed.new(terminal(text="x" * 5_000), attempts=1)
    assert owed.refused(entry, "too_large", 1_000)
    cut = entry.item.block
    assert block_size(cut) <= 1_000
    assert TRUNCATION_MARKER.split("{")[0] in cut["envelope"]["payload"]["text"]
    assert entry.item.size < 1_000  # the frame packer's estimate (characters) follows
    assert owed.refused(entry, "too_large", 1_000)
    assert entry.item.block["envelope"]["payload"] == {"text": FALLBACK_TOO_LARGE}
    assert entry.item.block["envelope"]["seq"] == 3
    assert owed.take() == [entry, entry]  # held after each step
    with caplog.at_level(logging.ERROR, logger="kernel_ext.emit"):
        assert not owed.refused(entry, "too_large", 1_000)
    assert len(owed) == 0
    assert hub.stats()["rejected"] == 1
    assert "refused the terminal of (00f067aa0ba902b7, t) even degraded" in caplog.text


def test_a_terminal_refused_as_invalid_goes_straight_to_the_fallback(
    hub: StreamHub, port: SenderPort
) -> None:
    owed = held(port, FakeClock())
    entry = owed.new(terminal(), attempts=1)
    assert owed.refused(entry, "invalid", 1_000)
    assert entry.item.block["state"] == "done"
    assert entry.item.block["envelope"]["payload"] == {"text": FALLBACK_INVALID}
    assert not owed.refused(entry, "invalid", 1_000)
    assert hub.stats()["rejected"] == 1


def test_degrading_does_not_touch_the_callers_block() -> None:
    item = terminal(text="y" * 5_000)
    original = item.block
    entry = OwedTerminal(item, 0.0)
    assert entry.degrade("too_large", 1_000)
    assert original["envelope"]["payload"]["text"] == "y" * 5_000
    assert item.block is not original
