"""The OpenInference conventions' names for a tool span, as kernel_ext reads them.

The Arize/Phoenix instrumentations (smolagents, CrewAI, DSPy, LlamaIndex, the OpenAI Agents
SDK, …) follow the OpenInference semantic conventions rather than the GenAI ones. Their
names are held here as strings (openinference-semantic-conventions is not a dependency;
tests/test_openinference.py checks them against it): the span processor reads tool spans
of this convention into the tap, and the tool-call scope reuses such a span as the call's
own. The mapping is the one OpenInference's own GenAI conversion uses.
"""

from __future__ import annotations

__all__ = [
    "OI_KIND",
    "OI_SESSION",
    "OI_TOOL",
    "OI_TOOL_CALL_ID",
    "OI_TOOL_ID",
    "OI_TOOL_NAME",
    "openinference_tool_name",
]

OI_KIND = "openinference.span.kind"
"""A tool span's kind is :data:`OI_TOOL`."""
OI_TOOL = "TOOL"
OI_TOOL_NAME = "tool.name"
"""The tool's name (→ ``gen_ai.tool.name``)."""
OI_SESSION = "session.id"
"""The session (→ ``gen_ai.conversation.id``)."""
OI_TOOL_ID = "tool.id"
"""The model's tool-call id (→ ``gen_ai.tool.call.id``); else :data:`OI_TOOL_CALL_ID`."""
OI_TOOL_CALL_ID = "tool_call.id"


def openinference_tool_name(span_name: object) -> str | None:
    """The tool name of an OpenInference tool span that has no ``tool.name``, from its
    span name: ``"<name>.<method>"`` gives ``<name>`` (DSPy's ``search.__call__``, CrewAI's
    ``search._run``), another name is taken whole (the OpenAI Agents SDK instrumentation
    names a function span after its tool); ``None`` for no usable name."""
    if not isinstance(span_name, str) or not span_name.strip():
        return None
    name = span_name.strip()
    head, dot, _method = name.rpartition(".")
    return head.strip() if dot and head.strip() else name
