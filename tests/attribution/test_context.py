"""The active tool call contextvar: kernel_ext.current_tool_call / current_call_id."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator

import pytest

from kernel_ext import (
    ToolCall,
    current_call_id,
    current_tool_call,
    reset_tool_call,
    set_tool_call,
    use_tool_call,
)
from kernel_ext.context import span_id_hex

OUTER = ToolCall("00000000000000a1", "ask_colleague", "conv-1", "llm-1")


def test_outside_any_call_there_is_no_active_call() -> None:
    assert current_tool_call() is None
    assert current_call_id() is None


def test_use_tool_call_sets_the_call_and_its_id_and_restores_afterwards() -> None:
    with use_tool_call(OUTER) as call:
        assert call is OUTER
        assert current_tool_call() is OUTER
        assert current_call_id() == "00000000000000a1"
    assert current_tool_call() is None
    assert current_call_id() is None


def test_use_tool_call_restores_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), use_tool_call(OUTER):
        raise RuntimeError("boom")
    assert current_tool_call() is None


def test_a_nested_call_shadows_the_outer_one_which_comes_back() -> None:
    inner = ToolCall("00000000000000b2", "search", "conv-1", parent=OUTER)
    with use_tool_call(OUTER):
        with use_tool_call(inner):
            assert current_call_id() == "00000000000000b2"
            assert current_tool_call().parent is OUTER  # type: ignore[union-attr]
        assert current_tool_call() is OUTER


def test_set_and_reset_tool_call_pair_restores_the_previous_call() -> None:
    token = set_tool_call(OUTER)
    try:
        assert current_call_id() == OUTER.call_id
        inner = set_tool_call(None)
        assert current_tool_call() is None
        reset_tool_call(inner)
        assert current_tool_call() is OUTER
    finally:
        reset_tool_call(token)
    assert current_tool_call() is None


def test_tool_call_is_immutable() -> None:
    with pytest.raises(AttributeError):
        OUTER.call_id = "x"  # type: ignore[misc]


async def test_concurrent_asyncio_tasks_each_see_their_own_call() -> None:
    started = 0
    all_started = asyncio.Event()
    n = 1000

    async def tool(i: int) -> tuple[str, str | None]:
        nonlocal started
        call_id = f"{i:016x}"
        with use_tool_call(ToolCall(call_id, "ask_colleague", "conv-1")):
            started += 1
            if started == n:
                all_started.set()
            await all_started.wait()  # every call is active at the same time
            return call_id, current_call_id()

    results = await asyncio.wait_for(asyncio.gather(*(tool(i) for i in range(n))), 30)
    assert all(expected == seen for expected, seen in results)
    assert current_tool_call() is None


async def test_asyncio_to_thread_sees_the_callers_call() -> None:
    with use_tool_call(OUTER):
        seen = await asyncio.wait_for(asyncio.to_thread(current_call_id), 10)
    assert seen == OUTER.call_id


def test_thread_started_with_copy_context_sees_the_callers_call() -> None:
    seen: list[str | None] = []
    with use_tool_call(OUTER):
        context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(lambda: seen.append(current_call_id()),))
    thread.start()
    thread.join(10)
    assert seen == [OUTER.call_id]


def test_plain_thread_does_not_inherit_the_call() -> None:
    seen: list[str | None] = []
    with use_tool_call(OUTER):
        thread = threading.Thread(target=lambda: seen.append(current_call_id()))
        thread.start()
        thread.join(10)
    assert seen == [None]


async def test_async_generator_steps_see_the_call_active_in_the_consumer() -> None:
    async def agen() -> AsyncIterator[str | None]:
        for _ in range(2):
            yield current_call_id()

    seen = []
    with use_tool_call(OUTER):
        async for value in agen():
            seen.append(value)
    assert seen == [OUTER.call_id, OUTER.call_id]


async def test_cancellation_inside_use_tool_call_restores_the_previous_call() -> None:
    entered = asyncio.Event()
    after: list[ToolCall | None] = []

    async def tool() -> None:
        try:
            with use_tool_call(ToolCall("00000000000000c3", "slow")):
                entered.set()
                await asyncio.Event().wait()
        finally:
            after.append(current_tool_call())

    async def runner() -> None:
        with use_tool_call(OUTER):
            await tool()

    task = asyncio.create_task(runner())
    await asyncio.wait_for(entered.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert after == [OUTER]


@pytest.mark.parametrize(
    ("span_id", "call_id"),
    [
        (0xA1, "00000000000000a1"),
        (0x00F067AA0BA902B7, "00f067aa0ba902b7"),
        (2**64 - 1, "ffffffffffffffff"),
    ],
)
def test_span_id_hex_is_sixteen_lower_case_hex_digits(span_id: int, call_id: str) -> None:
    assert span_id_hex(span_id) == call_id


@pytest.mark.parametrize("span_id", [-1, 2**64])
def test_span_id_hex_refuses_what_is_not_a_64_bit_id(span_id: int) -> None:
    with pytest.raises(OverflowError):
        span_id_hex(span_id)


def test_a_tool_call_is_an_immutable_value_whose_life_is_shared_not_compared() -> None:
    one = ToolCall("00f067aa0ba902b7", "ask_colleague", "conv-1")
    other = ToolCall("00f067aa0ba902b7", "ask_colleague", "conv-1")
    assert one == other
    assert hash(one) == hash(other)
    assert one.life is not other.life  # each call made without one gets its own life
    assert "life" not in repr(one)
    assert not one.ended
    one.life.end()
    assert one.ended
    assert not other.ended
    assert one == other  # ending a call does not change its value
    with pytest.raises(AttributeError):
        one.call_id = "x"  # type: ignore[misc]
    shared = ToolCall("a" * 16, "t", life=one.life)
    assert shared.ended


def test_the_hot_paths_setters_set_and_restore_what_the_getters_read() -> None:
    from kernel_ext.context import reset_call, reset_call_id, set_call, set_call_id

    call_token, id_token = set_call(OUTER), set_call_id(OUTER.call_id)
    try:
        assert current_tool_call() is OUTER
        assert current_call_id() == OUTER.call_id
    finally:
        reset_call_id(id_token)
        reset_call(call_token)
    assert current_tool_call() is None
    assert current_call_id() is None
