"""The trajectory tap: live tool calls per conversation, bounded, thread-safe."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from typing import Any

import pytest
from support.timing import FakeClock

from kernel_ext import ConfigError
from kernel_ext.attribution.tap import LiveCall, Tap, default_tap


def call(n: int, name: str = "ask_colleague", conversation: str | None = "conv-1") -> LiveCall:
    return LiveCall(f"{n:016x}", name, conversation, started_ns=n)


def test_added_call_is_live_and_found_by_id_until_discarded() -> None:
    tap = Tap()
    first = call(1)
    assert tap.add(first) is True
    assert tap.get(first.call_id) is first
    assert first.call_id in tap
    assert len(tap) == 1
    assert tap.discard(first.call_id) is first
    assert tap.get(first.call_id) is None
    assert len(tap) == 0


def test_discarding_an_unknown_call_returns_none() -> None:
    assert Tap().discard("00000000000000ff") is None


def test_adding_a_live_call_id_again_is_refused_and_changes_nothing() -> None:
    tap = Tap()
    tap.add(call(1))
    assert tap.add(call(1, name="other")) is False
    assert tap.get(call(1).call_id) == call(1)


def test_live_lists_a_conversations_calls_in_start_order_filtered_by_name() -> None:
    tap = Tap()
    for n, name in [(3, "ask_colleague"), (1, "search"), (2, "ask_colleague")]:
        tap.add(call(n, name))
    tap.add(call(9, conversation="conv-2"))
    assert [c.started_ns for c in tap.live("conv-1")] == [3, 1, 2]
    assert [c.started_ns for c in tap.live("conv-1", "ask_colleague")] == [3, 2]
    assert tap.live("conv-3") == ()


def test_near_match_gives_the_single_live_call_of_that_name_in_that_conversation() -> None:
    tap = Tap()
    tap.add(call(1, "ask_colleague"))
    tap.add(call(2, "search"))
    tap.add(call(3, "ask_colleague", conversation="conv-2"))
    assert tap.near_match("conv-1", "ask_colleague") == (call(1), 1)


def test_near_match_with_two_candidates_gives_no_call() -> None:
    tap = Tap()
    tap.add(call(1))
    tap.add(call(2))
    assert tap.near_match("conv-1", "ask_colleague") == (None, 2)


def test_near_match_without_candidates_gives_no_call() -> None:
    tap = Tap()
    tap.add(call(1, "search"))
    assert tap.near_match("conv-1", "ask_colleague") == (None, 0)
    assert tap.near_match("conv-9", "search") == (None, 0)


def test_calls_without_conversation_are_found_only_under_none() -> None:
    tap = Tap()
    tap.add(call(1, conversation=None))
    assert tap.near_match(None, "ask_colleague") == (call(1, conversation=None), 1)
    assert tap.near_match("conv-1", "ask_colleague") == (None, 0)


def test_the_tap_is_empty_again_when_every_call_ended() -> None:
    tap = Tap()
    for n in range(50):
        tap.add(call(n, conversation=f"conv-{n % 7}"))
    assert tap.conversations() == 7
    for n in range(50):
        tap.discard(call(n).call_id)
    assert len(tap) == 0
    assert tap.conversations() == 0
    assert tap.snapshot() == ()


def test_a_full_conversation_evicts_its_oldest_call_and_counts_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tap = Tap(max_per_conversation=2)
    tap.add(call(1))
    tap.add(call(2, conversation="conv-2"))
    tap.add(call(3))
    with caplog.at_level(logging.WARNING, logger="kernel_ext.attribution.tap"):
        assert tap.add(call(4)) is True
    assert [c.started_ns for c in tap.live("conv-1")] == [3, 4]
    assert tap.get(call(2).call_id) is not None  # other conversations untouched
    assert tap.evicted == 1
    assert "evicted live call 0000000000000001" in caplog.text


def test_a_full_tap_evicts_the_oldest_call_overall() -> None:
    tap = Tap(max_calls=3)
    for n in range(1, 5):
        tap.add(call(n, conversation=f"conv-{n}"))
    assert [c.started_ns for c in tap.snapshot()] == [2, 3, 4]
    assert tap.conversations() == 3
    assert tap.evicted == 1


def test_evicting_the_last_call_of_a_conversation_keeps_the_new_one_indexed() -> None:
    tap = Tap(max_per_conversation=1)
    tap.add(call(1))
    tap.add(call(2))
    assert tap.live("conv-1") == (call(2),)
    # call(1) was evicted while live: no near-match until its end is seen.
    assert tap.near_match("conv-1", "ask_colleague") == (None, 2)
    assert tap.discard(call(1).call_id) is None
    assert tap.near_match("conv-1", "ask_colleague") == (call(2), 1)
    tap.discard(call(2).call_id)
    assert tap.conversations() == 0
    assert tap.uncertain == 0


@pytest.mark.parametrize(
    "kwargs", [{"max_calls": 0}, {"max_per_conversation": -1}, {"max_calls": True}]
)
def test_bad_bounds_are_rejected_at_construction(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        Tap(**kwargs)


def test_default_tap_is_one_process_wide_tap() -> None:
    assert default_tap() is default_tap()


def test_concurrent_adds_and_discards_from_many_threads_leave_a_consistent_tap() -> None:
    tap = Tap(max_calls=100_000)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            barrier.wait(10)
            for n in range(t * 1000, t * 1000 + 1000):
                assert tap.add(call(n, conversation=f"conv-{n % 5}"))
                tap.near_match(f"conv-{n % 5}", "ask_colleague")
                assert tap.discard(call(n).call_id) is not None
        except BaseException as exc:  # collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert len(tap) == 0
    assert tap.conversations() == 0


# -- never a wrong callId after an eviction (issue: terminal edges, item 4) ----------------


def _span_tap(tap: Tap) -> tuple[Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider

    from kernel_ext.attribution.processor import ToolSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(ToolSpanProcessor(tap=tap))
    return provider, provider.get_tracer("test")


def _tool_span(tracer: Any, name: str, conversation: str = "conv-e") -> Any:
    return tracer.start_span(
        f"execute_tool {name}",
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.conversation.id": conversation,
        },
    )


def test_after_a_live_call_is_evicted_near_match_never_answers_with_another_call() -> None:
    """A live ask_colleague, enough other tool spans to evict it, a second ask_colleague:
    blocks resolved by near-match get no callId — never the second call's."""
    from kernel_ext.attribution.resolve import ResolutionPath, resolve_call_id

    clock = FakeClock()
    tap = Tap(max_per_conversation=4, evicted_ttl=60, clock=clock)
    provider, tracer = _span_tap(tap)
    first = _tool_span(tracer, "ask_colleague")
    others = [_tool_span(tracer, f"search_{i}") for i in range(4)]  # evicts `first`
    assert tap.get(format(first.get_span_context().span_id, "016x")) is None
    second = _tool_span(tracer, "ask_colleague")
    second_id = format(second.get_span_context().span_id, "016x")
    assert tap.get(second_id) is not None

    resolution = resolve_call_id("conv-e", "ask_colleague", tap=tap)
    assert resolution.call_id is None
    assert resolution.path is ResolutionPath.AMBIGUOUS
    # Other tool names and other conversations are unaffected.
    assert resolve_call_id("conv-e", "search_3", tap=tap).call_id is not None

    first.end()  # the evicted span's end is seen: sure again
    assert resolve_call_id("conv-e", "ask_colleague", tap=tap).call_id == second_id
    for span in [*others, second]:
        span.end()
    assert len(tap) == 0
    assert tap.uncertain == 0
    provider.shutdown()


def test_an_evicted_call_whose_end_is_never_seen_is_forgotten_after_evicted_ttl() -> None:
    from kernel_ext.attribution.resolve import resolve_call_id

    clock = FakeClock()
    tap = Tap(max_per_conversation=1, evicted_ttl=60, clock=clock)
    tap.add(LiveCall("0000000000000001", "ask_colleague", "conv-1"))
    tap.add(LiveCall("0000000000000002", "ask_colleague", "conv-1"))  # evicts the first
    assert resolve_call_id("conv-1", "ask_colleague", tap=tap).call_id is None
    clock.now += 59.999
    assert resolve_call_id("conv-1", "ask_colleague", tap=tap).call_id is None
    clock.now += 0.001  # exactly evicted_ttl after the eviction
    assert resolve_call_id("conv-1", "ask_colleague", tap=tap).call_id == "0000000000000002"
    assert tap.uncertain == 0


def test_evicted_calls_remembered_are_bounded_by_max_calls() -> None:
    tap = Tap(max_calls=8, max_per_conversation=8, evicted_ttl=600)
    for i in range(1, 1001):
        tap.add(LiveCall(f"{i:016x}", "ask_colleague", f"conv-{i % 7}"))
    assert len(tap) == 8
    assert tap.uncertain == 8
    for i in range(1, 1001):
        tap.discard(f"{i:016x}")
    assert len(tap) == 0
    assert tap.uncertain == 0


# -- the model's tool-call id outlives the call a while (Tap.llm_call_id) -------------------


def with_id(n: int, conversation: str | None = "conv-1") -> LiveCall:
    return LiveCall(f"{n:016x}", "ask_colleague", conversation, f"llm-{n}", started_ns=n)


def test_llm_call_id_answers_for_a_live_call_and_none_for_an_unknown_or_idless_one() -> None:
    tap = Tap()
    tap.add(with_id(1))
    tap.add(call(2))
    assert tap.llm_call_id(with_id(1).call_id) == "llm-1"
    assert tap.llm_call_id(call(2).call_id) is None
    assert tap.llm_call_id("00000000000000ff") is None


def test_an_ended_calls_tool_call_id_is_known_but_attribution_never_sees_the_call() -> None:
    tap = Tap()
    tap.add(with_id(1))
    tap.discard(with_id(1).call_id)
    assert tap.llm_call_id(with_id(1).call_id) == "llm-1"
    assert tap.ended == 1
    assert tap.get(with_id(1).call_id) is None
    assert with_id(1).call_id not in tap
    assert tap.live("conv-1") == ()
    assert tap.near_match("conv-1", "ask_colleague") == (None, 0)


def test_an_ended_calls_tool_call_id_is_forgotten_ended_ttl_seconds_after_its_end() -> None:
    clock = FakeClock()
    tap = Tap(clock=clock)  # the default ended_ttl: 60 s
    tap.add(with_id(1))
    clock.advance(30)  # time spent live does not count
    tap.discard(with_id(1).call_id)
    clock.advance(59.999)
    assert tap.llm_call_id(with_id(1).call_id) == "llm-1"
    clock.advance(0.001)  # exactly ended_ttl
    assert tap.llm_call_id(with_id(1).call_id) is None
    assert tap.ended == 0


@pytest.mark.parametrize("max_calls", [2, None], ids=["max_calls=2", "default-10000"])
def test_at_most_max_calls_ended_calls_are_remembered_the_oldest_forgotten_first(
    max_calls: int | None,
) -> None:
    tap = Tap(max_calls=max_calls) if max_calls is not None else Tap()
    bound = tap.max_calls
    assert bound == (max_calls or 10_000)  # docs/ag-ui.md: the last 10,000 ended calls
    for n in range(1, bound + 1):
        tap.add(with_id(n))
        tap.discard(with_id(n).call_id)
    assert tap.ended == bound
    assert tap.llm_call_id(with_id(1).call_id) == "llm-1"  # exactly at the bound: kept
    tap.add(with_id(bound + 1))
    tap.discard(with_id(bound + 1).call_id)
    assert tap.llm_call_id(with_id(1).call_id) is None
    assert tap.llm_call_id(with_id(2).call_id) == "llm-2"
    assert tap.llm_call_id(with_id(bound + 1).call_id) == f"llm-{bound + 1}"
    assert tap.ended == bound


def test_ended_calls_are_forgotten_as_calls_end_and_idless_ones_never_held() -> None:
    clock = FakeClock()
    tap = Tap(ended_ttl=60, clock=clock)
    for n in range(100):
        tap.add(with_id(n))
        tap.discard(with_id(n).call_id)
    tap.add(call(500))
    tap.discard(call(500).call_id)
    assert tap.ended == 100
    clock.advance(60)
    tap.add(with_id(1000))
    tap.discard(with_id(1000).call_id)  # an end forgets those whose time is up
    assert len(tap) == 0
    assert tap.ended == 1


def test_a_call_id_that_ends_again_is_known_for_ended_ttl_from_its_last_end() -> None:
    clock = FakeClock()
    tap = Tap(ended_ttl=60, clock=clock)
    tap.add(with_id(1))
    tap.discard(with_id(1).call_id)
    clock.advance(50)
    tap.add(with_id(1))
    tap.discard(with_id(1).call_id)
    clock.advance(59)
    assert tap.llm_call_id(with_id(1).call_id) == "llm-1"


def test_an_evicted_live_call_is_no_ended_call() -> None:
    tap = Tap(max_calls=1)
    tap.add(with_id(1))
    tap.add(with_id(2))  # evicts call 1, which may still be live
    assert tap.llm_call_id(with_id(1).call_id) is None
    assert tap.discard(with_id(1).call_id) is None
    assert tap.llm_call_id(with_id(1).call_id) is None
    assert tap.ended == 0


def test_clear_forgets_ended_calls() -> None:
    tap = Tap()
    tap.add(with_id(1))
    tap.discard(with_id(1).call_id)
    tap.clear()
    assert tap.llm_call_id(with_id(1).call_id) is None
    assert tap.ended == 0


@pytest.mark.parametrize("ended_ttl", [0, -1.0, float("nan")])
def test_a_bad_ended_ttl_is_rejected_at_construction(ended_ttl: float) -> None:
    with pytest.raises(ConfigError, match="ended_ttl"):
        Tap(ended_ttl=ended_ttl)


FORKED = """
import os, sys
from kernel_ext.attribution.tap import LiveCall, Tap
tap = Tap()
tap.add(LiveCall("00000000000000e1", "ask_colleague", "conv-1", "llm-ended"))
tap.discard("00000000000000e1")
pid = os.fork()
if pid == 0:
    os._exit(0 if tap.llm_call_id("00000000000000e1") is None and tap.ended == 0 else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), tap.llm_call_id("00000000000000e1"))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_knows_no_ended_call_of_its_parent() -> None:
    """A real fork: the parent's ended calls are the parent's; the child starts empty."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["0", "llm-ended"]
