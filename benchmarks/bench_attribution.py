"""Attribution benchmarks: ratios measured side by side in one run (design.md §7).

Run: ``python benchmarks/bench_attribution.py [--quick]``. Prints each figure with its
target and PASS/MISS; :func:`run` returns the same figures as a list of dicts for
``benchmarks/run.py``, and :func:`profile_target` the path behind a figure.

* ``current_call_id()`` vs. a bare ``ContextVar.get()`` holding a value — target: within 2×.
* a call of a runtime method wrapped by ``ToolRuntimeInstrumentor`` (its ``execute_tool``
  span with the four GenAI attributes, the contextvar, no sink) vs. the same, unwrapped call
  inside a plain SDK span carrying the same four GenAI attributes
  (``start_as_current_span``: what a runtime following the conventions opens itself) —
  target: ≤ 1.10×, like for like. For information, the same against a plain SDK span
  without attributes. Both sides start their spans from one TracerProvider with one no-op
  span processor. Where the wrapped call's instructions go (wrapt, the SDK, the
  contextvars, kernel_ext's own work) is counted under callgrind by
  ``benchmarks/floor_attribution.py`` (``docs/profiles/attribution-wrapped-floor.txt``).
* ``ToolSpanProcessor.on_start`` + ``on_end`` for one tool span, called directly on a live
  SDK span — target: ≤ 2 µs. For information, the same for a non-tool span.
* For information: ``resolve_call_id`` on the context path and on the near-match path.

Two functions that are compared are timed in alternation (so drift hits both alike);
each figure is the median of several repeats after a warm-up. Nothing is tuned to pass.
"""

from __future__ import annotations

import contextvars
import statistics
import sys
import timeit
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from opentelemetry.sdk.trace import Span, SpanProcessor, TracerProvider

from kernel_ext import ToolCall, ToolDescription, current_call_id, use_tool_call
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.resolve import resolve_call_id
from kernel_ext.attribution.tap import CallSink, LiveCall, Tap
from kernel_ext.instrument import ToolRuntimeInstrumentor

REPEATS = 9
CALL_ID = "00f067aa0ba902b7"
GENAI = {
    "gen_ai.operation.name": "execute_tool",
    "gen_ai.tool.name": "search",
    "gen_ai.tool.call.id": "llm-1",
    "gen_ai.conversation.id": "conv-1",
}
_Figure = dict[str, Any]


def _median_ns(fn: Callable[[], object], number: int, repeats: int) -> float:
    timer = timeit.Timer(fn)
    timer.timeit(max(1, number // 10))  # warm-up
    return statistics.median(timer.repeat(repeat=repeats, number=number)) / number * 1e9


def _interleaved_ns(
    first: Callable[[], object], second: Callable[[], object], number: int, repeats: int
) -> tuple[float, float]:
    """Median ns per call of two functions timed in alternation."""
    timers = timeit.Timer(first), timeit.Timer(second)
    for timer in timers:
        timer.timeit(max(1, number // 10))  # warm-up
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for timer, out in zip(timers, runs, strict=True):
            out.append(timer.timeit(number) / number * 1e9)
    return statistics.median(runs[0]), statistics.median(runs[1])


def _figure(
    name: str,
    value: float,
    unit: str,
    target: float | None,
    detail: str,
    profile: str,
) -> _Figure:
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "target": target,
        "ok": None if target is None else value <= target,
        "detail": detail,
        "profile": profile,
    }


# -- current_call_id -----------------------------------------------------------------------


def bench_current_call_id(repeats: int, scale: float) -> list[_Figure]:
    bare: contextvars.ContextVar[str | None] = contextvars.ContextVar("bare", default=None)
    token = bare.set(CALL_ID)
    try:
        with use_tool_call(ToolCall(CALL_ID, "ask_colleague", "conv-1")):
            ours, base = _interleaved_ns(current_call_id, bare.get, int(2_000_000 * scale), repeats)
    finally:
        bare.reset(token)
    return [
        _figure(
            "current_call_id() vs bare ContextVar.get()",
            round(ours / base, 2),
            "x",
            2.0,
            f"{ours:.1f} ns vs {base:.1f} ns",
            "current_call_id",
        )
    ]


# -- wrapped tool call ---------------------------------------------------------------------


class PlainRuntime:
    def invoke(self, tool_name: str, payload: int) -> int:
        return payload + 1


def describe_tool(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ToolDescription:
    return ToolDescription(args[0], "conv-1", "llm-1")


@contextmanager
def wrapped_runtime(
    provider: TracerProvider | None = None, sink: CallSink | None = None
) -> Iterator[tuple[Callable[[], object], TracerProvider]]:
    """A runtime class instrumented with ToolRuntimeInstrumentor (spans to ``provider``,
    default: a new one with one no-op processor; ends reported to ``sink``); yields one
    call of it and the provider."""
    module = types.ModuleType("kx_bench_runtime")
    runtime_cls = type("Runtime", (), {"invoke": PlainRuntime.invoke})
    module.Runtime = runtime_cls  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    if provider is None:
        provider = TracerProvider()
        provider.add_span_processor(SpanProcessor())  # one no-op processor
    instrumentor = ToolRuntimeInstrumentor()
    previous_sink = instrumentor.sink
    instrumentor.instrument(
        targets=["kx_bench_runtime:Runtime.invoke"],
        describe=describe_tool,
        tracer_provider=provider,
        sink=sink,
    )
    try:
        wrapped = runtime_cls()
        yield (lambda: wrapped.invoke("search", 1)), provider
    finally:
        instrumentor.uninstrument()
        instrumentor.sink = previous_sink
        del sys.modules[module.__name__]


FLOOR_PROFILE = "profiles/attribution-wrapped-floor.txt"  # relative to docs/performance.md


def bench_wrapped_call(repeats: int, scale: float) -> list[_Figure]:
    plain = PlainRuntime()  # never instrumented: the same code, unwrapped
    number = int(20_000 * scale)
    with wrapped_runtime() as (through_wrapper, provider):
        tracer = provider.get_tracer("bench")

        def in_plain_genai_span() -> None:
            with tracer.start_as_current_span("execute_tool search", attributes=GENAI):
                plain.invoke("search", 1)

        def in_plain_span() -> None:
            with tracer.start_as_current_span("execute_tool search"):
                plain.invoke("search", 1)

        ours, genai = _interleaved_ns(through_wrapper, in_plain_genai_span, number, repeats)
        ours_again, base = _interleaved_ns(through_wrapper, in_plain_span, number, repeats)
    both = "both: one TracerProvider, one no-op span processor, no sink"
    return [
        _figure(
            "wrapped tool call vs same call in a plain SDK span with the same GenAI attrs",
            round(ours / genai, 3),
            "x",
            1.10,
            f"{ours / 1000:.2f} µs vs {genai / 1000:.2f} µs; wrapped: its execute_tool span "
            f"with the 4 GenAI attrs + contextvar; plain: start_as_current_span with the same "
            f"4 attrs; {both}; [instruction floor]({FLOOR_PROFILE})",
            "wrapped_call",
        ),
        _figure(
            "wrapped tool call vs same call in a plain SDK span, no attributes (info)",
            round(ours_again / base, 3),
            "x",
            None,
            f"{ours_again / 1000:.2f} µs vs {base / 1000:.2f} µs; wrapped: as above; plain: "
            f"start_as_current_span without attributes; {both}",
            "wrapped_call",
        ),
    ]


# -- span processor ------------------------------------------------------------------------


def _processor_pair(tool: bool) -> Callable[[], None]:
    """on_start + on_end of a ToolSpanProcessor (own tap, no sink) for one live SDK span."""
    tracer = TracerProvider().get_tracer("bench")
    processor = ToolSpanProcessor(tap=Tap(), sink=None)
    if tool:
        started = tracer.start_span("execute_tool search", attributes=GENAI)
    else:
        started = tracer.start_span("chat model", attributes={"gen_ai.operation.name": "chat"})
    span = cast(Span, started)  # the SDK's span: what processors receive
    on_start, on_end = processor.on_start, processor.on_end

    def pair() -> None:
        on_start(span)
        on_end(span)

    return pair


def bench_processor(repeats: int, scale: float) -> list[_Figure]:
    tool_ns = _median_ns(_processor_pair(tool=True), int(200_000 * scale), repeats)
    other_ns = _median_ns(_processor_pair(tool=False), int(200_000 * scale), repeats)
    return [
        _figure(
            "processor on_start+on_end, tool span",
            round(tool_ns / 1000, 3),
            "µs",
            2.0,
            f"{tool_ns:.0f} ns",
            "processor",
        ),
        _figure(
            "processor on_start+on_end, non-tool span (info)",
            round(other_ns / 1000, 3),
            "µs",
            None,
            f"{other_ns:.0f} ns",
            "processor_other",
        ),
    ]


# -- resolve_call_id -----------------------------------------------------------------------


def bench_resolve(repeats: int, scale: float) -> list[_Figure]:
    tap = Tap()
    tap.add(LiveCall(CALL_ID, "ask_colleague", "conv-1"))
    number = int(500_000 * scale)
    with use_tool_call(ToolCall(CALL_ID, "ask_colleague", "conv-1")):
        context_ns = _median_ns(lambda: resolve_call_id("conv-1", tap=tap), number, repeats)
    near_ns = _median_ns(lambda: resolve_call_id("conv-1", tap=tap), number, repeats)
    return [
        _figure(
            "resolve_call_id, context path (info)",
            round(context_ns / 1000, 3),
            "µs",
            None,
            f"{context_ns:.0f} ns",
            "resolve",
        ),
        _figure(
            "resolve_call_id, near-match path (info)",
            round(near_ns / 1000, 3),
            "µs",
            None,
            f"{near_ns:.0f} ns",
            "resolve",
        ),
    ]


# -- entry points ----------------------------------------------------------------------------


def run(quick: bool = False) -> list[_Figure]:
    """Measure every figure; each dict has name, value, unit, target, ok, detail, profile."""
    repeats = max(3, REPEATS // 3) if quick else REPEATS
    scale = 0.2 if quick else 1.0
    return [
        *bench_current_call_id(repeats, scale),
        *bench_wrapped_call(repeats, scale),
        *bench_processor(repeats, scale),
        *bench_resolve(repeats, scale),
    ]


def profile_target(figure_name: str) -> Callable[[], None] | None:
    """A callable that runs the path behind ``figure_name`` many times (for a profiler)."""
    if figure_name.startswith("current_call_id"):

        def calls() -> None:
            with use_tool_call(ToolCall(CALL_ID, "ask_colleague", "conv-1")):
                for _ in range(2_000_000):
                    current_call_id()

        return calls
    if figure_name.startswith("wrapped tool call"):

        def wrapped_calls() -> None:
            with wrapped_runtime() as (call, _):
                for _ in range(50_000):
                    call()

        return wrapped_calls
    if figure_name.startswith("processor"):
        pair = _processor_pair(tool="non-tool" not in figure_name)

        def pairs() -> None:
            for _ in range(300_000):
                pair()

        return pairs
    return None


def main(argv: list[str]) -> int:
    print(f"kernel_ext attribution benchmarks — Python {sys.version.split()[0]}")
    for figure in run(quick="--quick" in argv):
        if figure["ok"] is None:
            verdict, target = "info", ""
        else:
            verdict = "PASS" if figure["ok"] else "MISS"
            target = f"(target ≤ {figure['target']}{figure['unit']})"
        print(
            f"  {verdict:4}  {figure['name']:<76} {figure['value']:>7}{figure['unit']:<2} "
            f"{target:<18} {figure['detail']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
