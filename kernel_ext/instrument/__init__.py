"""The tool-runtime instrumentor: each tool call gets an ``execute_tool`` span and the contextvar.

:class:`ToolRuntimeInstrumentor` wraps a tool runtime's invoke method, named by a target
string ``"package.module:Class.method"`` (or ``"package.module:function"``), with ``wrapt``.
Around each call it

1. asks the target's *describe hook* ``describe(instance, args, kwargs)`` for a
   :class:`ToolDescription` (tool name, conversation id, the model's tool-call id); a hook
   that returns ``None`` leaves that call alone;
2. makes sure there is an ``execute_tool <name>`` span with the GenAI attributes
   (``gen_ai.operation.name``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``,
   ``gen_ai.conversation.id``): it *reuses* the current span when the runtime already opened
   the ``execute_tool`` span of this call (same tool name, and same ``gen_ai.tool.call.id``
   when both are known, and not the span of the enclosing active call) — or an
   OpenInference ``TOOL`` span of this call (tool name from ``tool.name``, else its span
   name; call id from ``tool.id``/``tool_call.id``) — and starts an ``INTERNAL`` span
   otherwise;
3. sets the contextvar (:func:`kernel_ext.current_tool_call`) for the duration, with the
   enclosing active call as ``parent``;
4. before the call returns, writes the sink's ``call_attributes(call_id)`` onto the span
   (while it is live, invariant 7), tells the sink how the call ended — returned, with what
   it returned (the sink's optional ``tool_call_returned``), or failed, cancelled or
   interrupted (``tool_call_ended`` with the error) — and ends the span if it opened it.

Sync functions, coroutine functions, async generator functions and generator functions
are supported (the kind is read from the target when it is instrumented). For generators
the span covers the whole iteration (from the first step to exhaustion, error or close),
and the contextvar is set around each step, because a generator's frame runs in its
consumer's context. Exceptions propagate unchanged; on a span the instrumentor opened they
are recorded and set the status to ERROR (``Exception`` subclasses, as the OTel SDK does).
Instrumentation itself never raises into the tool: a failing describe hook or tracer is
logged and the call runs unattributed. Inside OpenTelemetry's
``suppress_instrumentation()`` a wrapped call runs untouched: no span, no contextvar.

:func:`tool_call_scope` gives the same treatment to runtimes that have hooks rather than a
method to wrap (the pydantic-ai integration uses it).

The parts, each with one job:

* :mod:`kernel_ext.instrument._call` — the attribution of one call (span found or opened,
  contextvar, end): :class:`ToolDescription`, :class:`Describe`, :func:`default_describe`,
  :func:`tool_call_scope`;
* :mod:`kernel_ext.instrument._wrappers` — the wrappers, one per function kind;
* :mod:`kernel_ext.instrument._instrumentor` — :class:`ToolRuntimeInstrumentor` and its
  targets (:class:`ToolTarget`).

Import the public names from here.
"""

from __future__ import annotations

from kernel_ext.instrument._call import (
    Describe,
    ToolDescription,
    default_describe,
    tool_call_scope,
)
from kernel_ext.instrument._instrumentor import ToolRuntimeInstrumentor, ToolTarget

__all__ = [
    "Describe",
    "ToolDescription",
    "ToolRuntimeInstrumentor",
    "ToolTarget",
    "default_describe",
    "tool_call_scope",
]
