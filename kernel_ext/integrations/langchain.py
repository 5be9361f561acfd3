"""LangChain / LangGraph integration: each tool call's code sees its own call in the contextvar.

Hand :func:`langchain_targets` to :func:`kernel_ext.enable` (or to
:class:`kernel_ext.instrument.ToolRuntimeInstrumentor`)::

    import kernel_ext
    from kernel_ext.integrations.langchain import langchain_targets

    kernel_ext.enable(relay_url=..., secret=..., targets=langchain_targets())

The targets are the public methods ``BaseTool.run`` and ``BaseTool.arun`` of
``langchain_core.tools``, through which every LangChain tool call runs: ``tool.invoke`` /
``tool.ainvoke`` (sync and async, ``@tool`` functions, ``StructuredTool``, ``BaseTool``
subclasses) and LangGraph's ``ToolNode``, which invokes each tool call of a model turn in
its own thread (sync graphs) or task (async graphs). For each call the instrumentor

* reuses the current span when it is this call's ``execute_tool`` span (GenAI attributes:
  same tool name, and same ``gen_ai.tool.call.id`` when both are known), else starts one
  with the GenAI attributes (``execute_tool <tool name>``);
* sets :func:`kernel_ext.current_tool_call` for the call: ``call_id`` = the span's id,
  ``tool_name`` = the tool's ``name``, ``llm_call_id`` = the model's tool-call id (the
  ``id`` of the ``ToolCall`` the tool was invoked with), ``conversation_id`` = LangGraph's
  ``thread_id`` (see :func:`thread_id`), ``parent`` = the enclosing call;
* writes the sink's ``call_attributes(call_id)`` on the span before the call returns.

``BaseTool.run``/``arun`` run the tool's function in a copy of the context they are called
in (sync functions of an async call: in a worker thread with a copy of it), made after our
wrapper set the contextvar: the tool's code, and what it starts with a copy of its
context, sees its own call. Exceptions from the tool propagate unchanged (LangGraph's
``ToolNode`` may then turn them into an error ``ToolMessage``, as without kernel_ext).

The describe hook is :func:`describe_tool_run`; give your own to
:func:`langchain_targets` to change what a call is said to be (for instance another
conversation id), typically by calling :func:`describe_tool_run` and replacing a field.

Requires langchain-core ≥ 1.0 (LangGraph ≥ 1.0 for ``ToolNode``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.runnables.config import ensure_config

from kernel_ext.instrument import Describe, ToolDescription, ToolTarget

__all__ = ["TARGETS", "describe_tool_run", "langchain_targets", "thread_id"]

TARGETS = ("langchain_core.tools:BaseTool.run", "langchain_core.tools:BaseTool.arun")
"""The methods wrapped: every LangChain tool call, sync or async, runs through one of them."""


def thread_id(config: Mapping[str, Any] | None) -> str | None:
    """LangGraph's ``thread_id`` of a run config: ``configurable.thread_id``, else
    ``metadata.thread_id``; ``None`` when neither is a non-empty string (a number is
    taken as its decimal string)."""
    if not config:
        return None
    for section in ("configurable", "metadata"):
        values = config.get(section)
        if isinstance(values, Mapping):
            value = values.get("thread_id")
            if isinstance(value, int) and not isinstance(value, bool):
                value = str(value)
            if isinstance(value, str) and value:
                return value
    return None


def describe_tool_run(
    instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ToolDescription:
    """The default describe hook of ``BaseTool.run``/``arun`` (see the module docstring).

    ``instance`` is the tool. Tool name: its ``name``. Model call id: the ``tool_call_id``
    keyword (set when the tool is invoked with a ``ToolCall``). Conversation:
    :func:`thread_id` of the call's ``config`` keyword, else of the config of the runnable
    that is running (LangGraph's, when a node calls ``tool.run`` itself); ``None`` inherits
    the enclosing call's.
    """
    name = getattr(instance, "name", None)
    if not isinstance(name, str) or not name:
        name = type(instance).__name__
    config = kwargs.get("config")
    if not isinstance(config, Mapping):
        config = ensure_config()
    llm_call_id = kwargs.get("tool_call_id")
    return ToolDescription(
        name,
        thread_id(config),
        llm_call_id if isinstance(llm_call_id, str) and llm_call_id else None,
    )


def langchain_targets(describe: Describe | None = None) -> list[ToolTarget]:
    """The targets to instrument (:data:`TARGETS`), each with ``describe`` (default:
    :func:`describe_tool_run`)."""
    hook = describe if describe is not None else describe_tool_run
    return [ToolTarget(target, hook) for target in TARGETS]
