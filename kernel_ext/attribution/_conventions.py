"""The conventions' names for a tool span, and the rule that tells one, as kernel_ext reads them.

The GenAI semantic conventions name a tool span's operation ``execute_tool`` and its tool,
call id and conversation ``gen_ai.tool.name``, ``gen_ai.tool.call.id`` and
``gen_ai.conversation.id``; :func:`tool_span_keys` is the rule that tells a tool span (of
which convention) from its attributes and name.

The Arize/Phoenix instrumentations (smolagents, CrewAI, DSPy, LlamaIndex, the OpenAI Agents
SDK, …) follow the OpenInference semantic conventions rather than the GenAI ones. Their
names are held here as strings (openinference-semantic-conventions is not a dependency;
tests/attribution/test_openinference.py checks them against it): the span processor reads tool spans
of this convention into the tap, and the tool-call scope reuses such a span as the call's
own. The mapping is the one OpenInference's own GenAI conversion uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "CONVERSATION_ID",
    "EXECUTE_TOOL",
    "GEN_AI_KEYS",
    "OI_KIND",
    "OI_SESSION",
    "OI_TOOL",
    "OI_TOOL_CALL_ID",
    "OI_TOOL_ID",
    "OI_TOOL_NAME",
    "OPENINFERENCE_KEYS",
    "OPERATION",
    "SPAN_NAME_PREFIX",
    "TOOL_CALL_ID",
    "TOOL_NAME",
    "ToolSpanKeys",
    "attribute_text",
    "openinference_tool_name",
    "span_llm_call_id",
    "tool_name_from_span_name",
    "tool_span_keys",
]

OPERATION = "gen_ai.operation.name"
"""A tool span's operation is :data:`EXECUTE_TOOL`."""
EXECUTE_TOOL = "execute_tool"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
CONVERSATION_ID = "gen_ai.conversation.id"
SPAN_NAME_PREFIX = "execute_tool "
"""The GenAI tool span's name: ``"execute_tool <tool name>"``."""

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


class ToolSpanKeys(NamedTuple):
    """Where a tool span of one convention keeps its tool name, conversation and the
    model's tool-call id (the first of ``call_id`` that is set)."""

    tool_name: str
    conversation_id: str
    call_id: tuple[str, ...]


GEN_AI_KEYS = ToolSpanKeys(TOOL_NAME, CONVERSATION_ID, (TOOL_CALL_ID,))
OPENINFERENCE_KEYS = ToolSpanKeys(OI_TOOL_NAME, OI_SESSION, (OI_TOOL_ID, OI_TOOL_CALL_ID))


def tool_span_keys(attributes: Mapping[str, object], span_name: object) -> ToolSpanKeys | None:
    """The keys of a tool span's fields, or ``None`` for a span that is not a tool span.

    The rule, readable: a span with a ``gen_ai.operation.name`` is a (GenAI) tool span when
    that is ``execute_tool``; one without it but with an ``openinference.span.kind`` is an
    (OpenInference) tool span when that is ``TOOL``; one with neither is a (GenAI) tool span
    when its name starts with ``"execute_tool "``. A value of another type is not a match.
    The specification of the span processor's copies of this rule, which run inline for
    speed (tests/core/test_fast_copies.py holds them to it); not for a hot path.
    """
    operation = attributes.get(OPERATION)
    if operation is not None:
        return GEN_AI_KEYS if operation == EXECUTE_TOOL else None
    kind = attributes.get(OI_KIND)
    if kind is not None:
        return OPENINFERENCE_KEYS if kind == OI_TOOL else None
    if isinstance(span_name, str) and span_name.startswith(SPAN_NAME_PREFIX):
        return GEN_AI_KEYS
    return None


def attribute_text(value: object) -> str | None:
    """A tool span attribute as text: a non-empty string as is, an int (not a bool) as its
    decimal string; anything else (``None``, ``""``, another type) is absent."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def span_llm_call_id(attributes: Mapping[str, object], keys: ToolSpanKeys) -> str | None:
    """The model's tool-call id of a tool span: the first of ``keys.call_id`` that is set
    (not ``None``), as text; an empty or unusable value there is no id (no fall-through)."""
    for key in keys.call_id:
        value = attributes.get(key)
        if value is not None:
            return attribute_text(value)
    return None


def tool_name_from_span_name(span_name: object, keys: ToolSpanKeys) -> str | None:
    """The tool name of a tool span without a usable tool-name attribute, from its span
    name: :func:`openinference_tool_name` for an OpenInference span; ``<name>`` of
    ``"execute_tool <name>"`` for a GenAI one; ``None`` for no usable name."""
    if keys is OPENINFERENCE_KEYS:
        return openinference_tool_name(span_name)
    if isinstance(span_name, str) and span_name.startswith(SPAN_NAME_PREFIX):
        return span_name[len(SPAN_NAME_PREFIX) :].strip() or None
    return None
