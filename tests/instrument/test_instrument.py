"""ToolRuntimeInstrumentor: an execute_tool span and the contextvar around each call."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.trace import NoOpTracerProvider, SpanKind, StatusCode
from support.attribution_helpers import (
    RecordingSink,
    Tracing,
    describe_runtime,
    hex_id,
    make_runtime_module,
    make_tracing,
)

from kernel_ext import (
    ConfigError,
    ToolCall,
    ToolDescription,
    current_call_id,
    current_tool_call,
    use_tool_call,
)
from kernel_ext.instrument import ToolRuntimeInstrumentor, ToolTarget, _wrappers, tool_call_scope

_names = itertools.count()
LOGGER = "kernel_ext.instrument"
ENV_TARGETS = "KERNEL_EXT_TARGETS"
ENV_DESCRIBE = "KERNEL_EXT_DESCRIBE"


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    tracing = make_tracing(sink=RecordingSink({"kernel_ext.blocks.sent": 3}))
    yield tracing
    tracing.close()


@pytest.fixture
def runtime() -> Iterator[types.ModuleType]:
    module = make_runtime_module(f"kx_runtime_{next(_names)}")
    yield module
    del sys.modules[module.__name__]


@pytest.fixture
def instrumentor() -> Iterator[ToolRuntimeInstrumentor]:
    instrumentor = ToolRuntimeInstrumentor()
    yield instrumentor
    instrumentor.uninstrument()
    instrumentor.sink = None


@pytest.fixture
def instrumented(
    tracing: Tracing, runtime: types.ModuleType, instrumentor: ToolRuntimeInstrumentor
) -> types.ModuleType:
    """``runtime`` with all its methods wrapped, spans going to ``tracing``."""
    name = runtime.__name__
    instrumentor.instrument(
        targets=[f"{name}:Runtime.{m}" for m in ("invoke", "ainvoke", "stream", "astream")],
        describe=describe_runtime,
        tracer_provider=tracing.provider,
        sink=tracing.sink,
    )
    return runtime


def test_a_sync_call_runs_in_an_execute_tool_span_with_its_call_active(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    seen = instrumented.Runtime().invoke(
        "ask_colleague", conversation_id="conv-1", tool_call_id="llm-1"
    )
    [span] = tracing.tool_spans()
    assert span.name == "execute_tool ask_colleague"
    assert span.kind is SpanKind.INTERNAL
    assert dict(span.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "ask_colleague",
        "gen_ai.tool.call.id": "llm-1",
        "gen_ai.conversation.id": "conv-1",
        "kernel_ext.blocks.sent": 3,
    }
    trace_id = span.context.trace_id  # a sampled span: its trace id is the call's
    assert seen == ToolCall(hex_id(span), "ask_colleague", "conv-1", "llm-1", None, None, trace_id)
    assert current_tool_call() is None


async def test_an_async_call_runs_in_its_span_with_its_call_active(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    seen = await instrumented.Runtime().ainvoke("search", conversation_id="conv-1")
    [span] = tracing.tool_spans()
    assert seen.call_id == hex_id(span)
    assert seen.tool_name == "search"
    assert current_tool_call() is None


def test_sink_call_attributes_are_written_while_the_span_is_live(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    instrumented.Runtime().invoke("ask_colleague", conversation_id="conv-1")
    [span] = tracing.tool_spans()
    assert span.attributes is not None
    assert span.attributes["kernel_ext.blocks.sent"] == 3
    assert tracing.sink.asked == [hex_id(span)]


def test_an_exception_propagates_unchanged_and_marks_the_span_as_error(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    error = LookupError("colleague unknown")

    def body(arg: Any) -> None:
        raise error

    with pytest.raises(LookupError) as raised:
        instrumented.Runtime(body).invoke("ask_colleague")
    assert raised.value is error
    [span] = tracing.tool_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "LookupError: colleague unknown"
    assert [event.name for event in span.events] == ["exception"]
    assert tracing.sink.ended[0][1] == "LookupError: colleague unknown"
    assert current_tool_call() is None


async def test_an_async_exception_propagates_unchanged_and_marks_the_span_as_error(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    async def body(arg: Any) -> None:
        await asyncio.sleep(0)
        raise KeyError("gone")

    with pytest.raises(KeyError, match="gone"):
        await instrumented.Runtime(body).ainvoke("ask_colleague")
    [span] = tracing.tool_spans()
    assert span.status.status_code is StatusCode.ERROR


def test_a_generator_tool_has_its_call_active_at_each_step_only(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    steps = []
    outside = []
    generator = instrumented.Runtime().stream("ask_colleague", n=3)
    for i, call in generator:
        steps.append((i, call.call_id if call else None))
        outside.append(current_tool_call())
    [span] = tracing.tool_spans()
    assert steps == [(0, hex_id(span)), (1, hex_id(span)), (2, hex_id(span))]
    assert outside == [None, None, None]


def test_a_generator_tool_keeps_send_and_return_value(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    def drive() -> Any:
        generator = instrumented.Runtime().stream("ask_colleague", n=1)
        first = next(generator)
        echoed = generator.send("hello")
        with pytest.raises(StopIteration) as stop:
            next(generator)
        return first[0], echoed, stop.value.value

    assert drive() == (0, ("echo", "hello"), "done")
    assert len(tracing.tool_spans()) == 1


def test_closing_a_generator_tool_early_ends_its_span_without_error(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    generator = instrumented.Runtime().stream("ask_colleague", n=10)
    next(generator)
    assert len(tracing.tap) == 1
    generator.close()
    [span] = tracing.tool_spans()
    assert span.status.status_code is StatusCode.UNSET
    assert len(tracing.tap) == 0


async def test_an_async_generator_tool_has_its_call_active_at_each_step_only(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    steps = []
    outside = []
    async for i, call in instrumented.Runtime().astream("ask_colleague", n=3):
        steps.append((i, call.call_id if call else None))
        outside.append(current_tool_call())
    [span] = tracing.tool_spans()
    assert steps == [(0, hex_id(span)), (1, hex_id(span)), (2, hex_id(span))]
    assert outside == [None, None, None]


async def test_closing_an_async_generator_tool_early_ends_its_span(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    generator = instrumented.Runtime().astream("ask_colleague", n=10)
    await generator.__anext__()
    await generator.aclose()
    assert len(tracing.tool_spans()) == 1
    assert len(tracing.tap) == 0


def test_a_nested_call_shadows_the_outer_one_and_is_reported_for_the_parent(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    runtime = instrumented.Runtime

    def outer_body(arg: Any) -> tuple[ToolCall | None, ToolCall | None, ToolCall | None]:
        before = current_tool_call()
        inner = runtime().invoke("search")
        after = current_tool_call()
        return before, inner, after

    before, inner, after = runtime(outer_body).invoke("ask_colleague", conversation_id="conv-1")
    inner_span, outer_span = tracing.tool_spans()
    assert before is after
    assert before is not None
    assert before.call_id == hex_id(outer_span)
    assert inner is not None
    assert inner.call_id == hex_id(inner_span)
    assert inner.parent is before
    assert inner.conversation_id == "conv-1"  # inherited
    assert inner_span.parent is not None
    assert inner_span.parent.span_id == outer_span.context.span_id
    [(parent, child)] = tracing.sink.started
    assert (parent.call_id, child.call_id, child.tool_name) == (
        hex_id(outer_span),
        hex_id(inner_span),
        "search",
    )


def test_the_runtimes_own_execute_tool_span_is_reused(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    tracer = tracing.provider.get_tracer("runtime")
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "ask_colleague",
        "gen_ai.tool.call.id": "llm-7",
        "gen_ai.conversation.id": "conv-1",
    }
    with tracer.start_as_current_span("execute_tool ask_colleague", attributes=attributes):
        seen = instrumented.Runtime().invoke("ask_colleague", tool_call_id="llm-7")
    [span] = tracing.tool_spans()
    trace_id = span.context.trace_id
    assert seen == ToolCall(hex_id(span), "ask_colleague", "conv-1", "llm-7", None, None, trace_id)
    assert span.attributes is not None
    assert span.attributes["kernel_ext.blocks.sent"] == 3


def test_an_execute_tool_span_of_another_call_is_not_reused(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    tracer = tracing.provider.get_tracer("runtime")
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "ask_colleague",
        "gen_ai.tool.call.id": "llm-7",
    }
    with tracer.start_as_current_span("execute_tool ask_colleague", attributes=attributes):
        seen = instrumented.Runtime().invoke("ask_colleague", tool_call_id="llm-8")
    inner, outer = tracing.tool_spans()
    assert seen is not None
    assert seen.call_id == hex_id(inner) != hex_id(outer)


def test_a_recursive_call_of_the_same_tool_gets_its_own_span(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    runtime = instrumented.Runtime

    def outer_body(arg: Any) -> ToolCall | None:
        return runtime().invoke("ask_colleague")  # type: ignore[no-any-return]

    inner = runtime(outer_body).invoke("ask_colleague")
    inner_span, outer_span = tracing.tool_spans()
    assert inner is not None
    assert inner.call_id == hex_id(inner_span)
    assert inner.parent is not None
    assert inner.parent.call_id == hex_id(outer_span)


async def test_thread_hand_off_keeps_the_call(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    async def body(arg: Any) -> tuple[str | None, str | None, str | None]:
        in_to_thread = await asyncio.to_thread(current_call_id)
        copied: list[str | None] = []
        context = contextvars.copy_context()
        thread = threading.Thread(
            target=context.run, args=(lambda: copied.append(current_call_id()),)
        )
        thread.start()
        await asyncio.to_thread(thread.join, 10)
        return current_call_id(), in_to_thread, copied[0]

    mine, in_to_thread, in_thread = await asyncio.wait_for(
        instrumented.Runtime(body).ainvoke("ask_colleague"), 10
    )
    [span] = tracing.tool_spans()
    assert mine == in_to_thread == in_thread == hex_id(span)


async def test_concurrent_same_name_calls_each_see_their_own_span(
    tracing: Tracing, instrumented: types.ModuleType
) -> None:
    n = 200
    started = 0
    all_started = asyncio.Event()

    async def body(arg: Any) -> str | None:
        nonlocal started
        started += 1
        if started == n:
            all_started.set()
        await all_started.wait()
        return current_call_id()

    runtime = instrumented.Runtime(body)
    seen = await asyncio.wait_for(
        asyncio.gather(*(runtime.ainvoke("ask_colleague", conversation_id="c") for _ in range(n))),
        30,
    )
    assert sorted(seen) == sorted(hex_id(span) for span in tracing.tool_spans())
    assert len(set(seen)) == n


# -- suppress_instrumentation ----------------------------------------------------------


@pytest.fixture(params=["probed keys", "public check"])
def suppress_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the wrapper tells suppression: the context keys kernel_ext._shared.compat probed,
    and OpenTelemetry's is_instrumentation_enabled() where the probe failed (requested
    before ``instrumented``, which builds the wrappers)."""
    if request.param == "public check":
        monkeypatch.setattr(_wrappers, "SUPPRESS_KEYS", None)
    return str(request.param)


def test_inside_suppress_instrumentation_sync_calls_and_generators_run_untouched(
    suppress_path: str, tracing: Tracing, instrumented: types.ModuleType
) -> None:
    runtime = instrumented.Runtime
    with suppress_instrumentation():
        seen = runtime().invoke("ask_colleague", conversation_id="conv-1")
        steps = list(runtime().stream("ask_colleague", n=2))
        generator = runtime().stream("ask_colleague", n=1)
    # A generator created inside runs untouched even when iterated outside.
    assert list(generator) == [(0, None)]
    assert seen is None
    assert steps == [(0, None), (1, None)]
    assert tracing.tool_spans() == []
    assert tracing.sink.ended == []
    assert runtime().invoke("ask_colleague") is not None  # attributed again outside
    assert len(tracing.tool_spans()) == 1


async def test_inside_suppress_instrumentation_async_calls_and_generators_run_untouched(
    suppress_path: str, tracing: Tracing, instrumented: types.ModuleType
) -> None:
    runtime = instrumented.Runtime
    with suppress_instrumentation():
        seen = await runtime().ainvoke("ask_colleague", conversation_id="conv-1")
        steps = [step async for step in runtime().astream("ask_colleague", n=2)]
    assert seen is None
    assert steps == [(0, None), (1, None)]
    assert tracing.tool_spans() == []
    assert tracing.sink.ended == []
    seen = await runtime().ainvoke("ask_colleague")
    assert seen is not None
    assert seen.call_id == hex_id(tracing.tool_spans()[0])


# -- instrument / uninstrument ---------------------------------------------------------


def test_uninstrument_puts_back_the_very_original_method(
    tracing: Tracing, runtime: types.ModuleType, instrumentor: ToolRuntimeInstrumentor
) -> None:
    originals = {m: vars(runtime.Runtime)[m] for m in ("invoke", "static")}
    original_function = runtime.function
    name = runtime.__name__
    instrumentor.instrument(
        targets=[f"{name}:Runtime.invoke", f"{name}:Runtime.static", f"{name}:function"],
        tracer_provider=tracing.provider,
    )
    assert vars(runtime.Runtime)["invoke"] is not originals["invoke"]
    assert runtime.Runtime.static("x") is not None
    assert runtime.function(tool_name="y") is not None
    instrumentor.uninstrument()
    assert {m: vars(runtime.Runtime)[m] for m in originals} == originals
    assert vars(runtime.Runtime)["static"] is originals["static"]
    assert runtime.function is original_function
    assert runtime.Runtime().invoke("x") is None
    assert len(tracing.tool_spans()) == 2


def test_instrument_and_uninstrument_are_idempotent(
    tracing: Tracing, runtime: types.ModuleType, instrumentor: ToolRuntimeInstrumentor
) -> None:
    target = f"{runtime.__name__}:Runtime.invoke"
    instrumentor.instrument(targets=[target], tracer_provider=tracing.provider)
    instrumentor.instrument(targets=[target], tracer_provider=tracing.provider)
    assert ToolRuntimeInstrumentor() is instrumentor
    assert instrumentor.targets == (target,)
    runtime.Runtime().invoke("x")
    assert len(tracing.tool_spans()) == 1  # wrapped once
    instrumentor.uninstrument()
    instrumentor.uninstrument()
    assert len(instrumentor.targets) == 0
    assert runtime.Runtime().invoke("x") is None


def test_a_bad_target_raises_config_error_and_wraps_nothing(
    runtime: types.ModuleType, instrumentor: ToolRuntimeInstrumentor
) -> None:
    original = vars(runtime.Runtime)["invoke"]
    for bad in ["no_colon", f"{runtime.__name__}:Runtime.missing", "kx_absent_module:X.y"]:
        with pytest.raises(ConfigError, match="target"):
            instrumentor.instrument(targets=[f"{runtime.__name__}:Runtime.invoke", bad])
        assert vars(runtime.Runtime)["invoke"] is original
        assert instrumentor.targets == ()


def test_a_describe_hook_returning_none_leaves_the_call_alone(
    tracing: Tracing, runtime: types.ModuleType, instrumentor: ToolRuntimeInstrumentor
) -> None:
    instrumentor.instrument(
        targets=[ToolTarget(f"{runtime.__name__}:Runtime.invoke", lambda i, a, k: None)],
        tracer_provider=tracing.provider,
    )
    assert runtime.Runtime().invoke("x") is None
    assert tracing.tool_spans() == []


def test_a_failing_describe_hook_lets_the_call_run_unattributed(
    tracing: Tracing,
    runtime: types.ModuleType,
    instrumentor: ToolRuntimeInstrumentor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def describe(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ToolDescription:
        raise RuntimeError("describe broke")

    instrumentor.instrument(
        targets=[f"{runtime.__name__}:Runtime.invoke"],
        describe=describe,
        tracer_provider=tracing.provider,
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert runtime.Runtime(lambda arg: arg * 2).invoke("x", 21) == 42
    assert "call not attributed" in caplog.text
    assert tracing.tool_spans() == []


def test_the_default_describe_hook_reads_keyword_arguments(
    tracing: Tracing, runtime: types.ModuleType, instrumentor: ToolRuntimeInstrumentor
) -> None:
    instrumentor.instrument(
        targets=[f"{runtime.__name__}:Runtime.invoke"], tracer_provider=tracing.provider
    )
    seen = runtime.Runtime().invoke(
        tool_name="ask_colleague", conversation_id="conv-1", tool_call_id="llm-1"
    )
    assert seen is not None
    assert (seen.tool_name, seen.conversation_id, seen.llm_call_id) == (
        "ask_colleague",
        "conv-1",
        "llm-1",
    )


def test_without_a_tracer_provider_the_call_runs_and_the_contextvar_stays_unset(
    runtime: types.ModuleType,
    instrumentor: ToolRuntimeInstrumentor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    instrumentor.instrument(
        targets=[f"{runtime.__name__}:Runtime.invoke"], tracer_provider=NoOpTracerProvider()
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert runtime.Runtime().invoke("x") is None
    assert "no valid span" in caplog.text


def test_targets_come_from_the_environment_when_none_are_given(
    tracing: Tracing,
    runtime: types.ModuleType,
    instrumentor: ToolRuntimeInstrumentor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_TARGETS, f" {runtime.__name__}:Runtime.invoke , ")
    monkeypatch.setenv(ENV_DESCRIBE, "support.attribution_helpers:describe_runtime")
    monkeypatch.setitem(sys.modules, "kernel_ext.worker.wiring", None)  # it never needs the plugin
    instrumentor.instrument(tracer_provider=tracing.provider)
    assert instrumentor.targets == (f"{runtime.__name__}:Runtime.invoke",)
    seen = runtime.Runtime().invoke("from_env")
    assert seen is not None
    assert seen.tool_name == "from_env"


def test_without_environment_targets_instrument_does_nothing(
    instrumentor: ToolRuntimeInstrumentor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_TARGETS, raising=False)
    instrumentor.instrument()
    assert instrumentor.targets == ()


def test_a_bad_environment_describe_hook_is_a_config_error(
    runtime: types.ModuleType,
    instrumentor: ToolRuntimeInstrumentor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_TARGETS, f"{runtime.__name__}:Runtime.invoke")
    monkeypatch.setenv(ENV_DESCRIBE, "support.attribution_helpers:nothing_here")
    with pytest.raises(ConfigError, match=ENV_DESCRIBE):
        instrumentor.instrument()
    assert instrumentor.targets == ()


# -- tool_call_scope, for runtimes with hooks ------------------------------------------


def test_tool_call_scope_opens_a_span_and_sets_the_call_for_its_block(tracing: Tracing) -> None:
    with tool_call_scope(
        ToolDescription("ask_colleague", "conv-1"),
        tracer_provider=tracing.provider,
        sink=tracing.sink,
    ) as call:
        assert current_tool_call() is call
    [span] = tracing.tool_spans()
    assert call is not None
    assert call.call_id == hex_id(span)
    assert span.attributes is not None
    assert span.attributes["kernel_ext.blocks.sent"] == 3
    assert current_tool_call() is None


def test_tool_call_scope_propagates_exceptions_and_marks_its_span(tracing: Tracing) -> None:
    with (
        pytest.raises(ValueError, match="bad"),
        tool_call_scope(ToolDescription("ask_colleague"), tracer_provider=tracing.provider),
    ):
        raise ValueError("bad")
    [span] = tracing.tool_spans()
    assert span.status.status_code is StatusCode.ERROR


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_the_call_span_and_both_contextvars_are_set_inside_and_restored_after(
    tracing: Tracing, instrumented: types.ModuleType, fails: bool
) -> None:
    # activate()/deactivate() set and reset the two contextvars and the OTel context
    # themselves (not through set_tool_call/reset_tool_call): all three must pair up.
    from opentelemetry import trace

    outer = ToolCall("00000000000000aa", "outer", "conv-0")
    outer_span = trace.get_current_span()

    def body(arg: Any) -> tuple[ToolCall | None, str | None, int]:
        seen = (current_tool_call(), current_call_id(), trace.get_current_span())
        if fails:
            raise LookupError("tool failed")
        return seen[0], seen[1], seen[2].get_span_context().span_id

    with use_tool_call(outer):
        if fails:
            with pytest.raises(LookupError):
                instrumented.Runtime(body).invoke("search")
        else:
            call, call_id, span_id = instrumented.Runtime(body).invoke("search")
            [span] = tracing.tool_spans()
            assert call is not None
            assert call.parent is outer
            assert call_id == call.call_id == hex_id(span)
            assert span_id == span.context.span_id
        assert current_tool_call() is outer
        assert current_call_id() == outer.call_id
        assert trace.get_current_span() is outer_span
    assert current_tool_call() is None
    assert current_call_id() is None
