"""pydantic-ai integration: each tool call's code sees its own call in the contextvar.

Add :class:`KernelExtCapability` to an agent::

    from pydantic_ai import Agent
    from kernel_ext.integrations.pydantic_ai import KernelExtCapability

    agent = Agent(model, capabilities=[KernelExtCapability()])

Its ``wrap_tool_execute`` hook (public pydantic-ai API) runs inside pydantic-ai's own
``execute_tool <tool>`` span when instrumentation is on (the ``Instrumentation``
capability orders itself outermost; this capability also declares itself wrapped by it).
For each tool call it

* reuses that span, or starts one with the GenAI attributes when instrumentation is off,
* sets :func:`kernel_ext.current_tool_call` for the call: ``call_id`` = the span's id,
  ``tool_name``, ``conversation_id`` (the run's), ``llm_call_id`` (the model's
  ``tool_call_id``), ``parent`` = the enclosing call (a tool that runs an agent),
* writes the sink's ``call_attributes(call_id)`` on the span before the call returns
  (while the span is live), and tells the sink how the call ended: raised, cancelled, or
  returned with what the tool returned (a ``ToolReturn``'s ``return_value``), the ``done``
  text of the streams the hub opened for the call's nested tool calls.

A call stopped by :func:`kernel_ext.stop_call` returns the stopped result (a string that
says the user stopped the call, with what it had said so far) as the tool's return value,
so the model gets a normal tool result and the run goes on; the other calls of the turn
are untouched.

Concurrent tool calls of one model turn run as separate asyncio tasks, and sync tools run
in worker threads with a copy of the context: each sees its own call. Exceptions from the
tool propagate unchanged.

Requires pydantic-ai-slim ≥ 2.68 (Python ≥ 3.11).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import TracerProvider
from pydantic_ai.capabilities import AbstractCapability, Instrumentation
from pydantic_ai.capabilities.abstract import (
    CapabilityOrdering,
    ValidatedToolArgs,
    WrapToolExecuteHandler,
)
from pydantic_ai.messages import ToolCallPart, ToolReturn
from pydantic_ai.tools import RunContext, ToolDefinition

from kernel_ext.attribution.tap import CallSink
from kernel_ext.instrument import ToolDescription, ToolRuntimeInstrumentor
from kernel_ext.instrument._call import begin_scope, run_stoppable

__all__ = ["KernelExtCapability"]


@dataclass
class KernelExtCapability(AbstractCapability[Any]):
    """Attributes every tool call of the agent (see the module docstring).

    Args:
        sink: where ``call_attributes`` come from; ``None`` uses the sink attached to
            :class:`kernel_ext.instrument.ToolRuntimeInstrumentor` (the plugin attaches the
            stream hub there), read at each call.
        tracer_provider: for the span started when pydantic-ai's instrumentation is off
            (default: the global provider).
    """

    sink: CallSink | None = None
    tracer_provider: TracerProvider | None = None

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None  # holds live objects; not for agent specs

    def get_ordering(self) -> CapabilityOrdering:
        return CapabilityOrdering(wrapped_by=[Instrumentation])

    async def wrap_tool_execute(
        self,
        ctx: RunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: ValidatedToolArgs,
        handler: WrapToolExecuteHandler,
    ) -> Any:
        description = ToolDescription(
            call.tool_name, ctx.conversation_id or None, call.tool_call_id or None
        )
        sink = self.sink if self.sink is not None else ToolRuntimeInstrumentor().sink
        active = begin_scope(description, self.tracer_provider, sink)
        if active is None:
            return await handler(args)

        async def body() -> Any:
            result = await handler(args)
            # What the tool returned: a ToolReturn's return value (its `content` goes to
            # the model as a separate message).
            active.returned(result.return_value if isinstance(result, ToolReturn) else result)
            return result

        return await run_stoppable(active, body)
