"""LangChain / LangGraph integration: each tool call's code sees its own call in the contextvar.

Hand :func:`langchain_targets` to :func:`kernel_ext.enable` (or to
:class:`kernel_ext.instrument.ToolRuntimeInstrumentor`)::

    import kernel_ext
    from kernel_ext.integrations.langchain import langchain_targets

    kernel_ext.enable(relay_url=..., secret=..., targets=langchain_targets())

The targets are ``BaseTool.run`` and ``BaseTool.arun``, through which every LangChain tool
call runs (``invoke``/``ainvoke``, ``@tool``, ``StructuredTool``, subclasses, LangGraph's
``ToolNode``). Each call reuses its current ``execute_tool`` span or starts one, and sets
:func:`kernel_ext.current_tool_call` (the tool's ``name``, the ``ToolCall``'s id,
LangGraph's ``thread_id`` as conversation: :func:`thread_id`); the sink's
``call_attributes(call_id)`` are written on the span before the call returns.

Guarantees: the tool's code, and what it starts with a copy of its context, sees its own
call, also for concurrent calls of one turn and sync tools in worker threads; exceptions
propagate unchanged. A call stopped by :func:`kernel_ext.stop_call` returns the stopped
result — a ``ToolMessage`` with the model's ``tool_call_id`` when the tool was invoked
with a tool call (as ``ToolNode`` does), else the text — so the graph goes on.
The describe hook is :func:`describe_tool_run`; give your own to
:func:`langchain_targets` to change what a call is said to be.

Requires langchain-core ≥ 1.0 (LangGraph ≥ 1.0 for ``ToolNode``).
Design: docs/contracts.md, "LangChain / LangGraph hooks".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.runnables.config import ensure_config

from kernel_ext.instrument import Describe, ToolDescription, ToolTarget

__all__ = ["TARGETS", "describe_tool_run", "langchain_targets", "stopped_tool_result", "thread_id"]

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


def stopped_tool_result(
    instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any], text: str
) -> ToolMessage | str:
    """A stopped call's result as ``BaseTool.run``/``arun`` return one (the targets'
    ``stopped_as``): a ``ToolMessage`` with the model's ``tool_call_id`` and the tool's name
    when the tool was invoked with a tool call (what ``ToolNode`` requires), else ``text``."""
    tool_call_id = kwargs.get("tool_call_id")
    if not isinstance(tool_call_id, str) or not tool_call_id:
        return text
    name = getattr(instance, "name", None)
    return ToolMessage(
        text, tool_call_id=tool_call_id, name=name if isinstance(name, str) else None
    )


def langchain_targets(describe: Describe | None = None) -> list[ToolTarget]:
    """The targets to instrument (:data:`TARGETS`), each with ``describe`` (default:
    :func:`describe_tool_run`) and :func:`stopped_tool_result` for a stopped call."""
    hook = describe if describe is not None else describe_tool_run
    return [ToolTarget(target, hook, stopped_tool_result) for target in TARGETS]
