"""resolve_call_id: contextvar first, then the near-match, with its ambiguity fallback."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.attribution_helpers import (
    Tracing,
    describe_runtime,
    hex_id,
    make_runtime_module,
    make_tracing,
)

from kernel_ext import ToolCall, current_call_id, use_tool_call
from kernel_ext.attribution.resolve import Resolution, ResolutionPath, resolve_call_id
from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.instrument import ToolRuntimeInstrumentor
from kernel_ext.observability._rare_log import BatchedCount

_names = itertools.count()


def live(n: int, name: str = "ask_colleague", conversation: str | None = "conv-1") -> LiveCall:
    return LiveCall(f"{n:016x}", name, conversation)


def test_the_active_call_wins_over_the_tap() -> None:
    tap = Tap()
    tap.add(live(1))
    with use_tool_call(ToolCall("00000000000000aa", "ask_colleague", "conv-1")):
        resolution = resolve_call_id("conv-1", tap=tap)
    assert resolution == Resolution("00000000000000aa", ResolutionPath.CONTEXT, "conv-1")
    assert resolution


def test_the_context_path_ignores_the_tool_name_asked_about() -> None:
    with use_tool_call(ToolCall("00000000000000aa", "search", "conv-1")):
        resolution = resolve_call_id("conv-1", "ask_colleague", tap=Tap())
    assert (resolution.call_id, resolution.path) == ("00000000000000aa", ResolutionPath.CONTEXT)


def test_the_context_path_takes_the_calls_conversation_else_the_one_asked_about() -> None:
    with use_tool_call(ToolCall("00000000000000aa", "ask_colleague", "conv-call")):
        assert resolve_call_id("conv-arg").conversation_id == "conv-call"
    with use_tool_call(ToolCall("00000000000000bb", "ask_colleague", None)):
        assert resolve_call_id("conv-arg").conversation_id == "conv-arg"
        assert resolve_call_id("conv-other").conversation_id == "conv-other"


def test_a_single_live_candidate_is_a_near_match() -> None:
    tap = Tap()
    tap.add(live(1))
    tap.add(live(2, name="search"))
    tap.add(live(3, conversation="conv-2"))
    assert resolve_call_id("conv-1", tap=tap) == Resolution(
        live(1).call_id, ResolutionPath.NEAR_MATCH, "conv-1"
    )


def test_two_live_candidates_are_ambiguous_and_give_no_call_id() -> None:
    tap = Tap()
    tap.add(live(1))
    tap.add(live(2))
    resolution = resolve_call_id("conv-1", tap=tap)
    assert resolution == Resolution(None, ResolutionPath.AMBIGUOUS, "conv-1")
    assert not resolution


def test_no_live_candidate_gives_none() -> None:
    tap = Tap()
    tap.add(live(1, name="search"))
    assert resolve_call_id("conv-1", tap=tap) == Resolution(None, ResolutionPath.NONE, "conv-1")
    assert resolve_call_id(None, tap=tap) == Resolution(None, ResolutionPath.NONE, None)


def test_the_tool_name_to_match_is_configurable() -> None:
    tap = Tap()
    tap.add(live(1, name="delegate"))
    assert resolve_call_id("conv-1", "delegate", tap=tap).call_id == live(1).call_id


def test_resolution_paths_are_their_metric_names() -> None:
    assert [str(p) for p in ResolutionPath] == ["context", "near_match", "ambiguous", "none"]
    assert ResolutionPath("near_match") is ResolutionPath.NEAR_MATCH


def _counter_total(reader: InMemoryMetricReader) -> int:
    data = reader.get_metrics_data()
    if data is None:
        return 0
    return sum(
        int(getattr(point, "value", 0))
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
    )


def test_batched_counts_reach_the_counter_exactly_after_a_flush() -> None:
    reader = InMemoryMetricReader()
    counter = MeterProvider(metric_readers=[reader]).get_meter("t").create_counter("c")
    count = BatchedCount(counter, {"path": "context"}, batch=8)
    for _ in range(20):
        count.add_one()
    assert _counter_total(reader) == 16  # two full batches
    count.flush()
    assert _counter_total(reader) == 20
    count.flush()
    assert _counter_total(reader) == 20


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.lists(st.integers(0, 30), max_size=12))
def test_batched_counts_add_at_every_batchth_occurrence_and_at_each_flush_exactly(
    batch: int, runs: list[int]
) -> None:
    # The rule: the batch-th, 2·batch-th … add_one adds everything not yet added; a flush
    # adds the rest. Runs of add_one, each followed by a flush.
    reader = InMemoryMetricReader()
    counter = MeterProvider(metric_readers=[reader]).get_meter("t").create_counter("c")
    count = BatchedCount(counter, {"path": "context"}, batch=batch)
    occurrences = added = 0
    for run in runs:
        for _ in range(run):
            count.add_one()
            occurrences += 1
            if occurrences % batch == 0:
                added = occurrences
            assert _counter_total(reader) == added
        count.flush()
        added = occurrences
        assert _counter_total(reader) == added


def test_a_batched_count_in_a_forked_child_adds_only_the_childs_occurrences() -> None:
    reader = InMemoryMetricReader()
    counter = MeterProvider(metric_readers=[reader]).get_meter("t").create_counter("c")
    count = BatchedCount(counter, {"path": "context"}, batch=4)
    for _ in range(6):  # one batch added, two outstanding: the parent's
        count.add_one()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it added, then leave without cleanup
        try:
            before = _counter_total(reader)
            for _ in range(5):  # the fourth of these is the cycle's batch-th
                count.add_one()
            at_batch = _counter_total(reader)
            count.flush()
            os.write(write, f"{before} {at_batch} {_counter_total(reader)}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        reported = pipe.read()
    os.waitpid(pid, 0)
    # the child's counter starts from the parent's 4; the parent's 2 outstanding are never
    # added there; the child's own 5 are, exactly
    assert reported == "4 6 9"
    count.flush()
    assert _counter_total(reader) == 6


# -- the convergence path under load: 1,000 concurrent calls of one tool -----------------


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    tracing = make_tracing()
    yield tracing
    tracing.close()


@pytest.fixture
def runtime(tracing: Tracing) -> Iterator[types.ModuleType]:
    module = make_runtime_module(f"kx_resolve_runtime_{next(_names)}")
    instrumentor = ToolRuntimeInstrumentor()
    instrumentor.instrument(
        targets=[f"{module.__name__}:Runtime.ainvoke"],
        describe=describe_runtime,
        tracer_provider=tracing.provider,
    )
    yield module
    instrumentor.uninstrument()
    del sys.modules[module.__name__]


async def test_a_thousand_concurrent_same_name_calls_are_each_attributed_to_their_own_span(
    tracing: Tracing, runtime: types.ModuleType
) -> None:
    n = 1000
    started = resolved = 0
    all_live = asyncio.Event()
    all_resolved = asyncio.Event()
    unattributed = contextvars.Context()  # a context where no tool call is active

    async def ask_colleague(arg: Any) -> tuple[str | None, str, Resolution, Resolution]:
        nonlocal started, resolved
        started += 1
        if started == n:
            all_live.set()
        await all_live.wait()  # all 1,000 calls are live at once
        by_context = resolve_call_id("conv-1", tap=tracing.tap)
        by_near_match = unattributed.run(
            resolve_call_id, "conv-1", "ask_colleague", tap=tracing.tap
        )
        resolved += 1
        if resolved == n:
            all_resolved.set()
        await all_resolved.wait()  # no call ends before every call has resolved
        running_in = format(trace.get_current_span().get_span_context().span_id, "016x")
        return current_call_id(), running_in, by_context, by_near_match

    tool = runtime.Runtime(ask_colleague)
    results = await asyncio.wait_for(
        asyncio.gather(
            *(tool.ainvoke("ask_colleague", conversation_id="conv-1") for _ in range(n))
        ),
        60,
    )
    span_ids = {hex_id(span) for span in tracing.tool_spans()}
    assert len(span_ids) == n
    assert {own for own, _, _, _ in results} == span_ids
    for own, running_in, by_context, by_near_match in results:
        assert own == running_in  # the id of the span this very call runs in
        assert by_context == Resolution(own, ResolutionPath.CONTEXT, "conv-1")
        assert by_near_match == Resolution(None, ResolutionPath.AMBIGUOUS, "conv-1")
    assert len(tracing.tap) == 0
