"""The wire described for other languages: the JSON Schema of a block and the payloads of
the known kinds.

* :func:`block_json_schema` is the JSON Schema (draft 2020-12) of a block, generated from
  :class:`~kernel_ext.protocol.Block` and written in standard keywords only (no pydantic
  keyword, nothing a standard validator would ignore), with the terminals' payload rule
  (:data:`~kernel_ext.protocol.TERMINAL_KEYS`) and "no traceId without a callId" as
  ``if``/``then``. A block
  :func:`~kernel_ext.protocol.decode` accepts is valid against it and a block it refuses is
  not, except for what JSON Schema cannot express (:data:`NOT_EXPRESSIBLE`).
* :data:`KIND_PAYLOADS` declares what producers put in ``envelope.payload`` for each of
  :data:`~kernel_ext.protocol.KNOWN_KINDS` (``TypedDict``, all fields optional: a running
  block's payload is passed through unchecked, so a renderer reads each one leniently).
  With the schema, they are what :mod:`kernel_ext.web.typescript` turns into
  ``tool_event_stream.d.ts``.

``kernel-ext schema`` prints the schema; ``kernel-ext schema --typescript`` the declarations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from typing_extensions import TypedDict  # pydantic reads typing's own only from Python 3.12

from kernel_ext.protocol import (
    DEFAULT_MAX_BLOCK_BYTES,
    MAX_PAYLOAD_DEPTH,
    TERMINAL_KEYS,
    Block,
)

__all__ = [
    "DRAFT",
    "KIND_PAYLOADS",
    "NOT_EXPRESSIBLE",
    "ProgressPayload",
    "TextPayload",
    "ThinkingPayload",
    "ToolCallPayload",
    "ToolOutputAppendPayload",
    "block_json_schema",
]

DRAFT = "https://json-schema.org/draft/2020-12/schema"

NOT_EXPRESSIBLE: tuple[str, ...] = (
    "the size bound: a block's compact JSON is at most "
    f"{DEFAULT_MAX_BLOCK_BYTES // 1024} KiB of UTF-8 by default",
    f"payload values nested deeper than {MAX_PAYLOAD_DEPTH} levels",
    "numbers a double cannot hold (1e999, which a parser reads as infinity)",
    "ts and envelope.v written with a fraction of zero (1.0): an integer to JSON Schema, "
    "refused by decode (seq and the block's v accept that spelling)",
)
"""The protocol's rules a JSON Schema cannot state, named in the schema's description;
:func:`~kernel_ext.protocol.decode` checks them."""


class ThinkingPayload(TypedDict, total=False):
    """``thinking``: the colleague's reasoning, shown folded."""

    text: str


class ToolCallPayload(TypedDict, total=False):
    """``tool_call``: one line, the tool's name and a start marker. A peer sends ``name``
    and ``args``; kernel_ext reports a tool call nested in a live one with ``toolName``,
    ``name`` and that call's own ``callId``."""

    name: str
    args: Any
    toolName: str
    callId: str


class TextPayload(TypedDict, total=False):
    """``text``: a paragraph of the colleague's text."""

    text: str


class ToolOutputAppendPayload(TypedDict, total=False):
    """``tool_output_append``: appended to a terminal-style output area (not produced in v1)."""

    text: str


class ProgressPayload(TypedDict, total=False):
    """``progress``: a progress bar. ``progress`` so far out of ``total`` (absent when the
    total is unknown: an indeterminate bar), and a ``message`` shown with it (an MCP server's
    ``notifications/progress``, through :mod:`kernel_ext.integrations.mcp`)."""

    progress: float
    total: float
    message: str


KIND_PAYLOADS: Mapping[str, type[Any]] = {
    "thinking": ThinkingPayload,
    "tool_call": ToolCallPayload,
    "text": TextPayload,
    "tool_output_append": ToolOutputAppendPayload,
    "progress": ProgressPayload,
}
"""The payload of each of :data:`~kernel_ext.protocol.KNOWN_KINDS`."""


def _terminal_rule(state: str, key: str) -> dict[str, Any]:
    """``if state is <state> then envelope.payload.<key> is a string``."""
    payload = {"properties": {key: {"type": "string"}}, "required": [key]}
    envelope = {"properties": {"payload": payload}, "required": ["payload"]}
    return {
        "if": {"properties": {"state": {"const": state}}, "required": ["state"]},
        "then": {"properties": {"envelope": envelope}},
    }


# A block whose callId is null carries no traceId (protocol.Block).
_NO_TRACE_WITHOUT_CALL: dict[str, Any] = {
    "if": {"properties": {"callId": {"type": "null"}}, "required": ["callId"]},
    "then": {"properties": {"traceId": {"type": "null"}}},
}


def block_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a block on the wire (module docstring)."""
    generated = Block.model_json_schema(by_alias=True)
    envelope = generated["$defs"]["Envelope"]
    for model in (generated, envelope):
        for prop in model["properties"].values():
            prop.pop("title", None)  # pydantic's "Callid", "Streamkey": no information
    envelope["description"] = (
        "The peer's progress object, passed through unchanged: unknown kinds and unknown "
        "fields are kept."
    )
    del generated["title"], generated["description"]
    limits = "; ".join(NOT_EXPRESSIBLE)
    return {
        "$schema": DRAFT,
        "title": "tool_event_stream block",
        "description": "One tool_event_stream message: an envelope attributed to a tool "
        "call. A done block carries the final answer in envelope.payload.text, an aborted "
        "block a summary in envelope.payload.message. Not expressed here, checked by the "
        f"protocol's decoder: {limits}.",
        **generated,
        "allOf": [
            *(_terminal_rule(state, key) for state, key in TERMINAL_KEYS.items()),
            _NO_TRACE_WITHOUT_CALL,
        ],
    }
