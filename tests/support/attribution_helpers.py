"""Test doubles and helpers shared by the attribution tests (tap, resolver, processor,
instrumentor, the integrations, how a call's pane ends)."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util.types import AttributeValue

from kernel_ext import ToolCall, ToolDescription, current_tool_call
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.viewing.view import PaneStore


class RecordingSink:
    """Test double of :class:`kernel_ext.attribution.tap.CallSink`: records every notification."""

    def __init__(self, attributes: Mapping[str, AttributeValue] | None = None) -> None:
        self.started: list[tuple[LiveCall, LiveCall]] = []
        self.ended: list[tuple[LiveCall, str | None]] = []
        self.asked: list[str] = []
        self._attributes = dict(attributes or {})
        self._lock = threading.Lock()

    def tool_call_started(self, parent: LiveCall, child: LiveCall) -> None:
        with self._lock:
            self.started.append((parent, child))

    def tool_call_ended(self, call: LiveCall, error: str | None) -> None:
        with self._lock:
            self.ended.append((call, error))

    def call_attributes(self, call_id: str) -> Mapping[str, AttributeValue]:
        with self._lock:
            self.asked.append(call_id)
        return dict(self._attributes)


@dataclass
class Tracing:
    """A private TracerProvider (never the global one) with an in-memory exporter and a
    ToolSpanProcessor feeding its own tap and a recording sink."""

    provider: TracerProvider
    exporter: InMemorySpanExporter
    processor: ToolSpanProcessor
    tap: Tap
    sink: RecordingSink

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def tool_spans(self) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name.startswith("execute_tool ")]

    def close(self) -> None:
        self.provider.shutdown()


def make_tracing(sink: RecordingSink | None = None, tap: Tap | None = None) -> Tracing:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tap = tap if tap is not None else Tap()
    sink = sink if sink is not None else RecordingSink()
    processor = ToolSpanProcessor(tap=tap, sink=sink)
    provider.add_span_processor(processor)
    return Tracing(provider, exporter, processor, tap, sink)


def pane_reads(blocks: list[dict[str, Any]], call_id: str) -> tuple[str, str, str]:
    """How the reference reducer (:mod:`kernel_ext.viewing.view`, the twin of the browser renderer)
    shows the pane of ``call_id`` after ``blocks``: its status, where its pinned final
    answer is from (``done``, ``aborted``) and that answer's text."""
    store = PaneStore()
    for block in blocks:
        store.apply_block(block)
    pane = store.pane(call_id)
    assert pane is not None
    assert pane.final is not None
    return pane.status, pane.final.source, pane.final.text


def hex_id(span: ReadableSpan) -> str:
    """The span's id as the 16 lower-case hex digits of a callId."""
    assert span.context is not None
    return format(span.context.span_id, "016x")


def trace_of(span: ReadableSpan) -> int:
    """The span's trace id as a call record keeps it: the id when sampled, else 0."""
    assert span.context is not None
    return span.context.trace_id if span.context.trace_flags.sampled else 0


def describe_runtime(
    instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ToolDescription:
    """The describe hook of :class:`Runtime`: ``(tool_name, conversation_id, tool_call_id)``."""
    return ToolDescription(
        kwargs.get("tool_name", args[0] if args else "tool"),
        kwargs.get("conversation_id"),
        kwargs.get("tool_call_id"),
    )


def make_runtime_module(name: str) -> types.ModuleType:
    """A fresh importable module ``name`` holding a fake tool runtime ``Runtime`` whose
    methods (sync, async, generator, async generator, plus a staticmethod) call ``body``."""
    module = types.ModuleType(name)

    class Runtime:
        def __init__(self, body: Callable[..., Any] | None = None) -> None:
            self.body = body if body is not None else (lambda arg: current_tool_call())

        def invoke(self, tool_name: str, arg: Any = None, **_: Any) -> Any:
            return self.body(arg)

        async def ainvoke(self, tool_name: str, arg: Any = None, **_: Any) -> Any:
            result = self.body(arg)
            if asyncio.iscoroutine(result):
                result = await result
            return result

        def stream(self, tool_name: str, n: int = 3, **_: Any) -> Generator[Any, Any, str]:
            for i in range(n):
                received = yield i, current_tool_call()
                if received is not None:
                    yield "echo", received
            return "done"

        async def astream(self, tool_name: str, n: int = 3, **_: Any) -> AsyncIterator[Any]:
            for i in range(n):
                await asyncio.sleep(0)
                yield i, current_tool_call()

        @staticmethod
        def static(tool_name: str, **_: Any) -> ToolCall | None:
            return current_tool_call()

    def function(tool_name: str, **_: Any) -> ToolCall | None:
        return current_tool_call()

    Runtime.__module__ = name
    Runtime.__qualname__ = "Runtime"
    module.Runtime = Runtime  # type: ignore[attr-defined]
    module.function = function  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module
