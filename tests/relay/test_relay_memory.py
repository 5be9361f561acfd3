"""The relay's bounded memories: what it remembers, for how long, at most how much, and what
it counts (issue 14, item 5).

* ``kernel_ext.relay.emitted_terminals.EmittedTerminals`` (the terminal dedup and the late-joiner
  hold) on a fake clock;
* ``RelayRedisManager``'s terminals to publish again, against a Redis that is not there (a
  port nothing listens on): bounded, given up after ``retry_for`` even while Redis stays
  down, counted; and nothing kept where python-socketio's publish result cannot be read.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import pytest
from support.network import free_port
from support.timing import FakeClock, wait_until

import kernel_ext.redis.manager as relay_redis
from kernel_ext.relay import RelayRedisManager
from kernel_ext.relay.emitted_terminals import EmittedTerminals


def terminal(call_id: str = "00f067aa0ba902b7", task_id: str = "t") -> dict[str, Any]:
    return {"callId": call_id, "taskId": task_id, "state": "done"}


def memory(
    remember: int = 4, hold: int = 4
) -> tuple[EmittedTerminals, FakeClock, collections.Counter[str]]:
    clock = FakeClock(0.0)
    counts: collections.Counter[str] = collections.Counter()

    def count(outcome: str, n: int) -> None:
        counts[outcome] += n

    terminals = EmittedTerminals(
        remember=remember, remember_ttl=300, hold=hold, hold_ttl=30, count=count, clock=clock
    )
    return terminals, clock, counts


def test_a_terminal_sent_again_is_a_duplicate_while_a_browser_it_went_to_is_connected() -> None:
    terminals, clock, counts = memory()
    raw = terminal()
    assert terminals.admit(raw, "room", ["b1"], {"b1"})
    assert not terminals.admit(raw, "room", ["b1"], {"b1"})
    # Every browser it went to has left: it goes to the room again, remembered anew.
    assert terminals.admit(raw, "room", ["b2"], {"b2"})
    assert counts["terminal_reemitted"] == 1
    assert not terminals.admit(raw, "room", ["b2"], {"b2"})
    clock.now = 299.0
    assert not terminals.admit(raw, "room", ["b2"], {"b2"})
    clock.now = 300.0  # remembered for 300 s from when it was last emitted
    assert terminals.admit(raw, "room", ["b2"], {"b2"})
    assert terminals.remembered == 1
    assert counts["terminal_reemitted"] == 1


def test_at_most_so_many_terminals_are_remembered_the_oldest_forgotten() -> None:
    terminals, _, _ = memory(remember=2)
    first, second, third = (terminal(task_id=t) for t in ("t1", "t2", "t3"))
    for raw in (first, second, third):
        assert terminals.admit(raw, "room", ["b1"], {"b1"})
    assert terminals.remembered == 2
    assert not terminals.admit(third, "room", ["b1"], {"b1"})
    assert terminals.admit(first, "room", ["b1"], {"b1"})  # forgotten: emitted again


def test_a_terminal_into_an_empty_room_is_held_and_sent_once_to_each_joiner() -> None:
    terminals, clock, counts = memory()
    raw = terminal()
    assert terminals.admit(raw, "room", [], set())
    assert counts["held_terminals"] == 1
    assert not terminals.admit(raw, "room", [], set())  # it went to no one: a duplicate
    assert terminals.late("b1", "another room") == []
    assert terminals.late("b1", "room") == [raw]
    assert terminals.late("b1", "room") == []
    assert terminals.late("b2", "room") == [raw]
    clock.now = 30.0  # held for 30 s
    assert terminals.late("b3", "room") == []
    assert terminals.held == 0
    assert counts["held_terminals"] == 1


def test_at_most_so_many_terminals_are_held_the_oldest_forgotten() -> None:
    terminals, _, counts = memory(hold=2)
    held = [terminal(task_id=t) for t in ("t1", "t2", "t3")]
    for raw in held:
        assert terminals.admit(raw, "room", [], set())
    assert terminals.held == 2
    assert terminals.late("b1", "room") == held[1:]
    assert counts["held_terminals"] == 3


def test_a_bound_of_zero_turns_a_memory_off() -> None:
    terminals, _, counts = memory(remember=0, hold=0)
    raw = terminal()
    assert terminals.admit(raw, "room", [], set())
    assert terminals.admit(raw, "room", [], set())
    assert terminals.late("b1", "room") == []
    assert (terminals.remembered, terminals.held) == (0, 0)
    assert counts == {}


def emit_message(state: str, task_id: str = "t") -> dict[str, Any]:
    """A python-socketio pub/sub emit message carrying one block."""
    block = {"callId": "00f067aa0ba902b7", "taskId": task_id, "state": state}
    return {
        "method": "emit",
        "event": "tool_event_stream",
        "data": [block],
        "namespace": "/chat",
        "room": "conv-1",
        "skip_sid": None,
        "callback": None,
        "host_id": "test",
    }


@pytest.mark.timeout(60)
async def test_terminals_that_did_not_reach_redis_wait_bounded_then_are_given_up() -> None:
    manager = RelayRedisManager(
        f"redis://127.0.0.1:{free_port()}/0", max_pending=2, retry_for=0.5, worker_grace=None
    )
    for task in ("t1", "t2", "t3"):
        await manager._publish(emit_message("done", task))
    await manager._publish(emit_message("running"))  # only terminals are kept
    assert manager.counts == {"redis_publish_failed": 3, "redis_given_up": 1}
    # Redis never comes back: the two kept are given up once retry_for has passed.
    await wait_until(lambda: manager.counts["redis_given_up"] == 3, timeout=30)
    assert manager.counts == {"redis_publish_failed": 3, "redis_given_up": 3}


@pytest.mark.timeout(60)
async def test_a_frames_pipeline_that_did_not_reach_redis_keeps_its_terminals_to_retry() -> None:
    manager = RelayRedisManager(
        f"redis://127.0.0.1:{free_port()}/0", max_pending=2, retry_for=0.5, worker_grace=None
    )
    async with manager.pipelined() as receivers:
        for message in (emit_message("running"), emit_message("done", "t1")):
            await manager._publish(message)
        await manager._publish(emit_message("aborted", "t2"))
    assert receivers == [None, None, None]
    assert manager.counts == {"redis_publish_failed": 2}  # the terminals, kept to retry
    assert len(manager._pending) == 2
    await wait_until(lambda: manager.counts.get("redis_given_up") == 2, timeout=30)


async def test_nothing_is_kept_where_the_publish_result_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(relay_redis, "publish_result_supported", lambda: False)
    caplog.set_level(logging.WARNING, logger="kernel_ext.relay")
    manager = RelayRedisManager(f"redis://127.0.0.1:{free_port()}/0", worker_grace=None)
    await manager._publish(emit_message("done"))
    assert manager.counts == {}  # not counted failed, not kept
    assert manager._retrying is None
    assert any("not published again" in r.getMessage() for r in caplog.records)
