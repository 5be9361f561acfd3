"""Attribution benchmarks: ratios measured side by side in one run (design.md §7).

Run: ``python benchmarks/bench_attribution.py``. Prints each figure with its target and
PASS/MISS; :func:`run` returns the same figures as a list of dicts for a benchmark runner.

* ``current_call_id()`` vs. a bare ``ContextVar.get()`` — target: within 2×.
* a wrapped tool call (``ToolRuntimeInstrumentor``) vs. the same call inside a plain SDK
  span, both on a TracerProvider with one no-op processor — target: ≤ 1.10×.
* ``ToolSpanProcessor.on_start`` + ``on_end`` for one tool span — target: ≤ 2 µs added.

Medians of several repeats after a warm-up; nothing is tuned to pass.
"""

from __future__ import annotations

import contextvars
import statistics
import sys
import timeit
import types
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from kernel_ext import (
    ToolCall,
    ToolDescription,
    ToolRuntimeInstrumentor,
    ToolSpanProcessor,
    current_call_id,
    resolve_call_id,
    use_tool_call,
)
from kernel_ext.tap import LiveCall, Tap

REPEATS = 9


def _per_call_ns(fn: Callable[[], object], number: int, repeats: int = REPEATS) -> float:
    """Median time per call in ns over ``repeats`` runs of ``number`` calls (after warm-up)."""
    timer = timeit.Timer(fn)
    timer.timeit(max(1, number // 10))
    return statistics.median(timer.repeat(repeat=repeats, number=number)) / number * 1e9


def _interleaved(
    first: Callable[[], object], second: Callable[[], object], number: int
) -> tuple[float, float]:
    """Medians for two functions measured in alternation, so drift hits both alike."""
    a_runs: list[float] = []
    b_runs: list[float] = []
    ta, tb = timeit.Timer(first), timeit.Timer(second)
    ta.timeit(max(1, number // 10))
    tb.timeit(max(1, number // 10))
    for _ in range(REPEATS):
        a_runs.append(ta.timeit(number) / number * 1e9)
        b_runs.append(tb.timeit(number) / number * 1e9)
    return statistics.median(a_runs), statistics.median(b_runs)


def bench_current_call_id() -> dict[str, Any]:
    bare: contextvars.ContextVar[str | None] = contextvars.ContextVar("bare", default=None)
    bare.set("00f067aa0ba902b7")
    get = bare.get
    with use_tool_call(ToolCall("00f067aa0ba902b7", "ask_colleague", "conv")):
        ours, base = _interleaved(current_call_id, get, 2_000_000)
    ratio = ours / base
    return {
        "name": "current_call_id() vs bare ContextVar.get()",
        "value": round(ratio, 2),
        "unit": "x",
        "target": 2.0,
        "ok": ratio <= 2.0,
        "detail": f"{ours:.1f} ns vs {base:.1f} ns",
    }


class _Runtime:
    def invoke(self, tool_name: str, payload: int) -> int:
        return payload + 1


def _describe(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ToolDescription:
    return ToolDescription(args[0], "conv-1", None)


def bench_wrapped_call() -> dict[str, Any]:
    module = types.ModuleType("kx_bench_runtime")
    runtime_cls = type("Runtime", (), {"invoke": _Runtime.invoke})
    module.Runtime = runtime_cls  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    provider = TracerProvider()
    provider.add_span_processor(SpanProcessor())  # one no-op processor
    tracer = provider.get_tracer("bench")
    plain = runtime_cls()

    def in_plain_span() -> None:
        with tracer.start_as_current_span("execute_tool search"):
            plain.invoke("search", 1)

    instrumentor = ToolRuntimeInstrumentor()
    instrumentor.instrument(
        targets=["kx_bench_runtime:Runtime.invoke"],
        describe=_describe,
        tracer_provider=provider,
    )
    try:
        wrapped = runtime_cls()

        def through_wrapper() -> None:
            wrapped.invoke("search", 1)

        ours, base = _interleaved(through_wrapper, in_plain_span, 20_000)
    finally:
        instrumentor.uninstrument()
        del sys.modules[module.__name__]
    ratio = ours / base
    return {
        "name": "wrapped tool call vs same call in a plain SDK span (1 no-op processor)",
        "value": round(ratio, 3),
        "unit": "x",
        "target": 1.10,
        "ok": ratio <= 1.10,
        "detail": f"{ours / 1000:.2f} µs vs {base / 1000:.2f} µs",
    }


def bench_processor() -> list[dict[str, Any]]:
    provider = TracerProvider()
    tracer = provider.get_tracer("bench")
    processor = ToolSpanProcessor(tap=Tap(), sink=None)
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "ask_colleague",
        "gen_ai.tool.call.id": "call_1",
        "gen_ai.conversation.id": "conv-1",
    }
    tool_span = tracer.start_span("execute_tool ask_colleague", attributes=attributes)
    other_span = tracer.start_span("chat model", attributes={"gen_ai.operation.name": "chat"})

    def tool() -> None:
        processor.on_start(tool_span)
        processor.on_end(tool_span)

    def other() -> None:
        processor.on_start(other_span)
        processor.on_end(other_span)

    tool_ns = _per_call_ns(tool, 200_000)
    other_ns = _per_call_ns(other, 200_000)
    assert len(processor.tap) == 0, "the tap must be empty again"
    return [
        {
            "name": "processor on_start+on_end, tool span",
            "value": round(tool_ns / 1000, 3),
            "unit": "µs",
            "target": 2.0,
            "ok": tool_ns / 1000 <= 2.0,
            "detail": f"{tool_ns:.0f} ns",
        },
        {
            "name": "processor on_start+on_end, non-tool span (info)",
            "value": round(other_ns / 1000, 3),
            "unit": "µs",
            "target": None,
            "ok": None,
            "detail": f"{other_ns:.0f} ns",
        },
    ]


def bench_resolve() -> list[dict[str, Any]]:
    tap = Tap()
    tap.add(LiveCall("00f067aa0ba902b7", "ask_colleague", "conv-1"))
    with use_tool_call(ToolCall("00f067aa0ba902b7", "ask_colleague", "conv-1")):
        context_ns = _per_call_ns(lambda: resolve_call_id("conv-1", tap=tap), 500_000)
    near_ns = _per_call_ns(lambda: resolve_call_id("conv-1", tap=tap), 500_000)
    return [
        {
            "name": "resolve_call_id, context path (info)",
            "value": round(context_ns / 1000, 3),
            "unit": "µs",
            "target": None,
            "ok": None,
            "detail": f"{context_ns:.0f} ns",
        },
        {
            "name": "resolve_call_id, near-match path (info)",
            "value": round(near_ns / 1000, 3),
            "unit": "µs",
            "target": None,
            "ok": None,
            "detail": f"{near_ns:.0f} ns",
        },
    ]


def run() -> list[dict[str, Any]]:
    """Measure every figure; each dict has name, value, unit, target, ok, detail."""
    return [
        bench_current_call_id(),
        bench_wrapped_call(),
        *bench_processor(),
        *bench_resolve(),
    ]


def main() -> int:
    print(f"kernel_ext attribution benchmarks — Python {sys.version.split()[0]}")
    for figure in run():
        if figure["ok"] is None:
            verdict = "info"
            target = ""
        else:
            verdict = "PASS" if figure["ok"] else "MISS"
            target = f"(target ≤ {figure['target']}{figure['unit']})"
        print(
            f"  {verdict:4}  {figure['name']:<72} {figure['value']:>8}{figure['unit']:<2} "
            f"{target:<18} {figure['detail']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
