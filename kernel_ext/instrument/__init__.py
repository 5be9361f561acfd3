"""The tool-runtime instrumentor: each tool call gets an ``execute_tool`` span and the contextvar.

:class:`ToolRuntimeInstrumentor` wraps a tool runtime's invoke method, named by a target
string ``"package.module:Class.method"`` (or ``"package.module:function"``), with ``wrapt``.
Around each call it asks the target's describe hook for a :class:`ToolDescription` (``None``
leaves the call alone), reuses this call's current span or starts an ``execute_tool`` span,
sets :func:`kernel_ext.current_tool_call` for the duration, and before the call returns
writes the sink's ``call_attributes(call_id)`` on the span, tells the sink how the call
ended and ends the span if it opened it. :func:`tool_call_scope` does the same for runtimes
that have hooks rather than a method to wrap.

Guarantees:

* Sync, coroutine, generator and async generator functions are supported; a generator's
  span covers its whole iteration, and the contextvar is set around each step.
* Exceptions propagate unchanged (on a span the instrumentor opened: recorded, status ERROR).
* Instrumentation never raises into the tool: a failing describe hook or tracer is logged
  and the call runs unattributed.
* Inside OpenTelemetry's ``suppress_instrumentation()`` a wrapped call runs untouched.

Parts: :mod:`kernel_ext.instrument._call`, :mod:`kernel_ext.instrument._wrappers`,
:mod:`kernel_ext.instrument._instrumentor`; import the public names from here.
Design: docs/contracts.md, "The tool-runtime instrumentor".
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
