"""OpenAI Agents SDK integration: each function tool call's code sees its own call in the
contextvar.

Give the agent attributed copies of its function tools::

    from agents import Agent
    from kernel_ext.integrations.openai_agents import attributed_tools

    agent = Agent(name="kernel", tools=attributed_tools([ask_colleague, lookup]))

Each call of such a tool is described (:func:`describe_tool_call`, or the ``describe`` hook
given: ``None`` leaves the call alone; a hook that raises or returns something other than a
:class:`~kernel_ext.ToolDescription` leaves it unattributed, logged), gets one tool span
(this call's current one, else one with the GenAI attributes) and
:func:`kernel_ext.current_tool_call` while the tool's code runs; the sink's
``call_attributes(call_id)`` are written on the span before the call returns.

Guarantees: concurrent calls of one turn, and sync tools in worker threads, each see their
own call. The tool behaves as without kernel_ext (its exception still becomes the SDK's
model-visible error text); the call ends failed with that exception, cancelled on a
timeout (its streams ``aborted``), or with what it returned. A call stopped by
:func:`kernel_ext.stop_call` returns the stopped result (a string that says the user stopped
the call, with what it had said so far) to the SDK as the tool's output: the run goes on.
A copy of an attributed tool stays attributed. MCP server tools and hosted tools are not attributed.

Requires openai-agents ≥ 0.24 (Python ≥ 3.10).
Design: docs/contracts.md, "OpenAI Agents SDK hooks".
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import wrapt
from agents import FunctionTool, RunContextWrapper, Tool
from agents.tool_context import ToolContext
from agents.tracing import get_current_trace
from opentelemetry.trace import TracerProvider

from kernel_ext.attribution.tap import CallSink
from kernel_ext.instrument import ToolDescription, ToolRuntimeInstrumentor
from kernel_ext.instrument._call import begin_described, run_stoppable, tracer_of
from kernel_ext.observability._rare_log import RareLog

__all__ = ["AgentsDescribe", "attributed_tool", "attributed_tools", "describe_tool_call"]

_rare = RareLog(logging.getLogger(__name__))

AgentsDescribe = Callable[
    ["ToolContext[Any] | RunContextWrapper[Any]", FunctionTool], "ToolDescription | None"
]
"""``describe(context, tool)``: the :class:`~kernel_ext.ToolDescription` of one call of
``tool`` (``context`` is what the runner passes the tool: a ``ToolContext``, or a plain
``RunContextWrapper`` for a tool declared to take one), or ``None`` to leave the call
alone. Runs once per call, in the call's task."""


def describe_tool_call(
    context: ToolContext[Any] | RunContextWrapper[Any], tool: FunctionTool
) -> ToolDescription:
    """The default describe hook (see the module docstring): tool name, conversation
    (``RunConfig.group_id``, else the current SDK trace's ``group_id``) and the model's call
    id, from the ``ToolContext`` (the tool's own name when the context is a plain
    ``RunContextWrapper``)."""
    tool_name = tool.name
    llm_call_id: str | None = None
    group_id: str | None = None
    if isinstance(context, ToolContext):
        tool_name = context.tool_name or tool_name
        llm_call_id = context.tool_call_id or None
        if context.run_config is not None:
            group_id = context.run_config.group_id or None
    if group_id is None:
        trace_group = getattr(get_current_trace(), "group_id", None)
        group_id = trace_group if isinstance(trace_group, str) and trace_group else None
    return ToolDescription(tool_name, group_id, llm_call_id)


@dataclass(frozen=True, slots=True)
class _Options:
    describe: AgentsDescribe
    sink: CallSink | None
    tracer_provider: TracerProvider | None

    def sink_of(self) -> CallSink | None:
        return self.sink if self.sink is not None else ToolRuntimeInstrumentor().sink


if TYPE_CHECKING:
    _Proxy = wrapt.ObjectProxy[Any]
else:  # wrapt < 2 has no subscriptable ObjectProxy
    _Proxy = wrapt.ObjectProxy


class _AttributedInvoker(_Proxy):
    """``on_invoke_tool`` of an attributed tool: the SDK's invoker behind a proxy, called
    inside the call's attribution (module docstring)."""

    def __init__(self, invoker: Any, tool: FunctionTool, options: _Options) -> None:
        super().__init__(invoker)
        self._self_tool = tool
        self._self_options = options

    async def __call__(self, context: Any, arguments: str) -> Any:
        options = self._self_options
        tool = self._self_tool
        active = begin_described(
            tracer_of(options.tracer_provider),
            lambda instance, args, kwargs: options.describe(context, tool),
            _rare,
            options.sink_of,
            None,
            (),
            {},
        )
        # This call's own record of its tool's exceptions (none when it is not attributed):
        # not its enclosing call's, whose record this context inherited.
        failures: list[BaseException] | None = None if active is None else []
        token = _FAILURES.set(failures)
        try:
            if active is None:
                return await self.__wrapped__(context, arguments)

            async def body() -> Any:
                result = await self.__wrapped__(context, arguments)
                if failures:  # the SDK's invoker turned the tool's exception into `result`
                    active.failed(failures[-1])
                else:
                    active.returned(result)
                return result

            return await run_stoppable(active, body)
        finally:
            _FAILURES.reset(token)

    def __agents_bind_function_tool__(self, function_tool: FunctionTool) -> _AttributedInvoker:
        """The SDK's copy hook: bind the SDK's invoker to the copy, and stay around it."""
        bind = getattr(self.__wrapped__, "__agents_bind_function_tool__", None)
        invoker = bind(function_tool) if callable(bind) else self.__wrapped__
        if invoker is self.__wrapped__ and function_tool is self._self_tool:
            return self
        return _AttributedInvoker(invoker, function_tool, self._self_options)


_FAILURES: ContextVar[list[BaseException] | None] = ContextVar(
    "kernel_ext.openai_agents.failures", default=None
)
"""The exceptions that left the tool's implementation during the attributed call running
in this context (``None`` outside one, or in a call that is not attributed)."""


class _FailureWatch(_Proxy):
    """The SDK invoker's implementation (``_invoke_tool_impl``, which its failure handling
    wraps): an exception that leaves it is recorded for the call running in this context
    (:data:`_FAILURES`), then propagates unchanged. Everything else reads through."""

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self.__wrapped__(*args, **kwargs)
        except BaseException as error:
            failures = _FAILURES.get()
            if failures is not None:
                failures.append(error)
            raise


# The SDK's; contract test in tests/integrations/test_compat.py.
_IMPLEMENTATION = "_invoke_tool_impl"


def _watch_failures(invoker: Any, given: Any) -> None:
    """Put a :class:`_FailureWatch` around the implementation of ``invoker``, the SDK
    invoker bound to an attributed copy, once — unless it is ``given``, the invoker of the
    tool the caller gave (left as it was). An invoker without one (a hand-made
    ``FunctionTool``'s) has no failure handling to look inside: its exceptions reach the
    call's scope unchanged."""
    implementation = getattr(invoker, _IMPLEMENTATION, None)
    if implementation is None or isinstance(implementation, _FailureWatch) or invoker is given:
        return
    setattr(invoker, _IMPLEMENTATION, _FailureWatch(implementation))


def attributed_tool(
    tool: FunctionTool,
    *,
    describe: AgentsDescribe | None = None,
    sink: CallSink | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FunctionTool:
    """A copy of ``tool`` whose calls are attributed (the module docstring); ``tool`` itself
    is left as it was. A tool that is already attributed is attributed anew with these
    arguments (not twice).

    Args:
        describe: the describe hook (default :func:`describe_tool_call`).
        sink: where ``call_attributes`` come from; ``None`` uses the sink attached to
            :class:`kernel_ext.instrument.ToolRuntimeInstrumentor` (the plugin attaches the
            stream hub there), read at each call's end.
        tracer_provider: for the span started when there is none to reuse (default: the
            global provider).

    Raises:
        TypeError: ``tool`` is not a ``FunctionTool``.
    """
    if not isinstance(tool, FunctionTool):
        raise TypeError(f"attributed_tool() takes a FunctionTool, got {type(tool).__name__}")
    options = _Options(describe or describe_tool_call, sink, tracer_provider)
    attributed = copy.copy(tool)  # the SDK's __copy__: its invoker is bound to the copy
    invoker = attributed.on_invoke_tool
    if isinstance(invoker, _AttributedInvoker):
        invoker = invoker.__wrapped__
    given = tool.on_invoke_tool
    _watch_failures(invoker, given.__wrapped__ if isinstance(given, _AttributedInvoker) else given)
    attributed.on_invoke_tool = _AttributedInvoker(invoker, attributed, options)
    return attributed


def attributed_tools(
    tools: Iterable[Tool],
    *,
    describe: AgentsDescribe | None = None,
    sink: CallSink | None = None,
    tracer_provider: TracerProvider | None = None,
) -> list[Tool]:
    """:func:`attributed_tool` of each ``FunctionTool`` in ``tools`` (agents as tools,
    ``agent.as_tool()``, are ones); other tools (hosted tools, computer, shell) are passed
    through unchanged, in order."""
    return [
        attributed_tool(tool, describe=describe, sink=sink, tracer_provider=tracer_provider)
        if isinstance(tool, FunctionTool)
        else tool
        for tool in tools
    ]
