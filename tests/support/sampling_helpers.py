"""Test helpers for calls under a sampler: a kernel's tool runtime instrumented through the
public API (an SDK tracer provider with the span processor, the instrumentor on
:class:`Kernel`, the stream hub and an in-process sender), and the samplers that drop a
call's trace (``ALWAYS_OFF``, ``TraceIdRatioBased(0.1)``, ``ParentBased`` under an
unsampled parent)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kernel_ext import ToolDescription
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import Tap
from kernel_ext.instrument import ToolRuntimeInstrumentor
from kernel_ext.stream import StreamHub
from kernel_ext.testing import MemoryEmitter

CONV = "conv-sampled"


class Kernel:
    """A kernel's tool runtime: ``run_tool``/``arun_tool`` run a tool body by name."""

    def run_tool(self, name: str, body: Any, conversation_id: str = CONV) -> Any:
        return body()

    async def arun_tool(self, name: str, body: Any, conversation_id: str = CONV) -> Any:
        return await body()


def describe(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ToolDescription:
    return ToolDescription(args[0], kwargs.get("conversation_id", CONV))


class Setup:
    """The instrumented :class:`Kernel` under ``sampler``: its tap, hub, tracer provider,
    instrumentor and in-process sender (``emitter``)."""

    def __init__(self, sampler: Sampler) -> None:
        self.tap = Tap()
        self.hub = StreamHub(tap=self.tap)
        self.provider = TracerProvider(sampler=sampler)
        self.provider.add_span_processor(ToolSpanProcessor(tap=self.tap, sink=self.hub))
        self.instrumentor = ToolRuntimeInstrumentor()
        self.instrumentor.instrument(
            targets=[f"{__name__}:Kernel.run_tool", f"{__name__}:Kernel.arun_tool"],
            describe=describe,
            tracer_provider=self.provider,
            sink=self.hub,
        )
        self.emitter = MemoryEmitter(hub=self.hub)

    def close(self) -> None:
        self.instrumentor.uninstrument()
        self.instrumentor.sink = None
        self.provider.shutdown()


@contextlib.asynccontextmanager
async def setup(sampler: Sampler) -> AsyncIterator[Setup]:
    """A :class:`Setup` under ``sampler``, its sender started; uninstrumented at the end."""
    made = Setup(sampler)
    try:
        async with made.emitter:
            yield made
    finally:
        made.close()


@contextlib.contextmanager
def unsampled_parent() -> Iterator[None]:
    """A remote parent whose trace was not sampled (its trace flags say so)."""
    parent = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0x00F067AA0BA902B7,
        is_remote=True,
        trace_flags=TraceFlags(0),
    )
    with trace.use_span(NonRecordingSpan(parent)):
        yield


SAMPLERS = {
    "always_off": (ALWAYS_OFF, contextlib.nullcontext),
    "ratio_0.1": (TraceIdRatioBased(0.1), contextlib.nullcontext),
    "parent_based_unsampled_parent": (ParentBased(ALWAYS_ON), unsampled_parent),
}
"""The samplers that drop a call's trace, by name: each with the context its calls run in."""
