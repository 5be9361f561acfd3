"""The ``tool_event_stream`` wire protocol: blocks, envelopes, one encode/decode pair.

A *block* is one ``tool_event_stream`` message::

    {"v": 1, "callId": "00f067aa0ba902b7", "taskId": "…", "state": "running",
     "ts": 1789123456789, "envelope": {…}}

and its *envelope* is the peer's progress object, passed through unchanged::

    {"v": 1, "kind": "thinking", "streamKey": "…", "seq": 42, "status": "running",
     "payload": {…}}

Rules pinned here (spec ``tool-event-stream.zh.md``, design.md §2, §4):

* ``state`` is ``running | done | aborted``; a ``done`` block carries the final answer as
  a string in ``envelope.payload.text``, an ``aborted`` block a string in
  ``envelope.payload.message``.
* ``callId`` is the 16 lower-case hex digit span id of the tool call, or ``null`` (T2).
* Envelope kinds ``thinking``, ``tool_call``, ``text`` and ``tool_output_append`` are
  known; any other kind is kept as it is (forward compatible). Unknown envelope fields
  are kept too; unknown block fields are rejected (the block is ours).
* ``seq`` is a non-negative integer; an integral float (``1.0``, as A2A data parts carry
  every number) is accepted as that integer; ``1.5``, negatives, booleans and strings
  are rejected.
* Payloads must be JSON: finite numbers only (no NaN/Infinity), nested at most
  :data:`MAX_PAYLOAD_DEPTH` levels.
* Size bound: :func:`encode` **truncates** an encoded block over ``max_bytes`` (default
  :data:`DEFAULT_MAX_BLOCK_BYTES`, 64 KiB). Rule: the longest string inside
  ``envelope.payload`` is cut and ends with the visible marker
  ``…[truncated N chars]``, repeated (longest first) until the block fits. A block that
  cannot be brought under the bound that way (its bulk is not in payload strings) is
  rejected with :class:`~kernel_ext.errors.BlockTooLargeError`. :func:`decode` rejects
  input over the bound with the same error; it never truncates.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kernel_ext.errors import BlockTooLargeError, DecodeError

__all__ = [
    "CHAT_EVENT",
    "DEFAULT_MAX_BLOCK_BYTES",
    "JOIN_EVENT",
    "KNOWN_KINDS",
    "KX_BLOCKS",
    "KX_CHAT_EVENT",
    "LEAVE_EVENT",
    "MAX_PAYLOAD_DEPTH",
    "NAMESPACE",
    "PROTOCOL_VERSION",
    "TERMINAL_STATES",
    "TOOL_EVENT_STREAM",
    "TRUNCATION_MARKER",
    "WORKER_HEARTBEAT",
    "WORKER_ID_PATTERN",
    "WORKER_TAG",
    "Block",
    "BlockState",
    "Envelope",
    "block_json_schema",
    "decode",
    "decode_envelope",
    "encode",
    "pseudo_envelope",
    "terminal_envelope",
]

PROTOCOL_VERSION = 1

# Socket.IO names of the delivery path (decision T1; relay frames: docs/contracts.md).
NAMESPACE = "/chat"
TOOL_EVENT_STREAM = "tool_event_stream"
CHAT_EVENT = "chat_event"
JOIN_EVENT = "join_conversation"
LEAVE_EVENT = "leave_conversation"
KX_BLOCKS = "kx_blocks"
KX_CHAT_EVENT = "kx_chat_event"
KNOWN_KINDS: frozenset[str] = frozenset({"thinking", "tool_call", "text", "tool_output_append"})
BlockState = Literal["running", "done", "aborted"]
TERMINAL_STATES: frozenset[str] = frozenset({"done", "aborted"})
DEFAULT_MAX_BLOCK_BYTES = 64 * 1024
MAX_PAYLOAD_DEPTH = 32
TRUNCATION_MARKER = "…[truncated {n} chars]"
CALL_ID_PATTERN = r"^[0-9a-f]{16}$"
# A sender's worker id (connect auth ``worker``; the Redis liveness signal), matched whole
# (``re.fullmatch``); on the Socket.IO Redis channel, the ``method`` of the heartbeat and the
# key that tags a write-only sender's emits with its id (docs/contracts.md).
WORKER_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}"
WORKER_HEARTBEAT = "kx_worker_heartbeat"
WORKER_TAG = "kx_worker"


def _coerce_seq(value: object) -> int:
    # bool is an int subclass: reject it before the int branch.
    if isinstance(value, bool):
        raise ValueError("seq must be a non-negative integer, got bool")
    if isinstance(value, int):
        result = value
    elif isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"seq must be a non-negative integer, got float {value!r}")
        result = int(value)
    else:
        raise ValueError(f"seq must be a non-negative integer, got {type(value).__name__}")
    if result < 0:
        raise ValueError(f"seq must be a non-negative integer, got {result}")
    return result


Seq = Annotated[int, BeforeValidator(_coerce_seq), Field(ge=0)]


def _check_json_value(value: Any, where: str) -> None:
    """Reject non-finite floats and nesting deeper than MAX_PAYLOAD_DEPTH (iteratively)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{where} holds a non-finite number ({item!r}); JSON has none")
        elif isinstance(item, (dict, list)):
            if depth > MAX_PAYLOAD_DEPTH:
                raise ValueError(f"{where} is nested deeper than {MAX_PAYLOAD_DEPTH} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str):
                        raise ValueError(f"{where} has a non-string key ({type(key).__name__})")


class _Wire(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        allow_inf_nan=False,
        ser_json_inf_nan="null",
    )


class Envelope(_Wire):
    """The peer's structured progress object, passed through unchanged.

    Unknown ``kind`` values and unknown fields are accepted and kept, so a newer peer
    never breaks an older caller. ``seq`` orders the blocks of one task.
    """

    model_config = ConfigDict(extra="allow")

    v: StrictInt = Field(default=PROTOCOL_VERSION, ge=1)
    kind: StrictStr = Field(min_length=1, max_length=64)
    stream_key: StrictStr = Field(max_length=512)
    seq: Seq
    status: StrictStr = Field(max_length=64)
    payload: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _payload_is_json(self) -> Envelope:
        _check_json_value(self.payload, "payload")
        if self.model_extra:
            _check_json_value(self.model_extra, "envelope")
        return self

    @property
    def is_known_kind(self) -> bool:
        """Whether ``kind`` is one of :data:`KNOWN_KINDS`."""
        return self.kind in KNOWN_KINDS


class Block(_Wire):
    """One ``tool_event_stream`` message: an envelope attributed to a tool call.

    Invariants checked at construction: ``done`` carries ``envelope.payload.text`` and
    ``aborted`` carries ``envelope.payload.message``, each a string. Every field is
    required on the wire, ``v`` included (the envelope's ``v`` defaults to 1: it is the
    peer's object and is read leniently).
    """

    model_config = ConfigDict(extra="forbid")

    v: Literal[1]
    call_id: Annotated[StrictStr, Field(pattern=CALL_ID_PATTERN)] | None
    task_id: StrictStr = Field(min_length=1, max_length=512)
    state: BlockState
    ts: StrictInt = Field(ge=0)
    envelope: Envelope

    @model_validator(mode="after")
    def _terminal_payload(self) -> Block:
        if self.state == "done" and not isinstance(self.envelope.payload.get("text"), str):
            raise ValueError("a done block must carry the final answer in envelope.payload.text")
        if self.state == "aborted" and not isinstance(self.envelope.payload.get("message"), str):
            raise ValueError("an aborted block must carry a string envelope.payload.message")
        return self

    @property
    def is_terminal(self) -> bool:
        """Whether this block closes its stream (``done`` or ``aborted``)."""
        return self.state in TERMINAL_STATES


def pseudo_envelope(task_id: str, seq: int, text: str, *, status: str = "running") -> Envelope:
    """The envelope the caller builds for a peer that sends none (design.md, words).

    ``{v: 1, kind: "text", streamKey: task_id, seq, status, payload: {text}}``.
    """
    return Envelope(
        v=PROTOCOL_VERSION,
        kind="text",
        stream_key=task_id,
        seq=seq,
        status=status,
        payload={"text": text},
    )


def terminal_envelope(
    state: Literal["done", "aborted"], task_id: str, seq: int, text: str
) -> Envelope:
    """The envelope of a terminal block.

    ``payload.text`` holds ``text`` for ``done``, ``payload.message`` for ``aborted``.
    """
    key = "text" if state == "done" else "message"
    return Envelope(
        v=PROTOCOL_VERSION,
        kind="text",
        stream_key=task_id,
        seq=seq,
        status=state,
        payload={key: text},
    )


def _field_of(error: ValidationError) -> tuple[str | None, str]:
    first = error.errors(include_url=False)[0]
    loc = ".".join(str(part) for part in first["loc"]) or None
    return loc, first["msg"]


def _decode_error(error: ValidationError, what: str) -> DecodeError:
    field, msg = _field_of(error)
    if field is None:
        if error.errors(include_url=False)[0]["type"] in ("json_invalid", "json_type"):
            return DecodeError(f"invalid {what}: not a JSON object ({msg})")
        return DecodeError(f"invalid {what}: {msg}")
    count = error.error_count()
    more = f" (and {count - 1} more)" if count > 1 else ""
    return DecodeError(f"invalid {what}: field {field!r}: {msg}{more}", field=field)


Wire: TypeAlias = "str | bytes | bytearray | Mapping[str, Any]"


def _check_size(data: str | bytes | bytearray, max_bytes: int) -> None:
    size = (
        len(data.encode("utf-8"))
        if isinstance(data, str) and len(data) * 4 > max_bytes
        else len(data)
    )
    if size > max_bytes:
        raise BlockTooLargeError(f"block is {size} bytes, over the bound of {max_bytes} bytes")


def decode(data: Wire, *, max_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> Block:
    """Decode one block from JSON text/bytes or from an already parsed mapping.

    Raises :class:`~kernel_ext.errors.DecodeError` (one type for every bad input) whose
    message and ``field`` name the offending wire field; JSON over ``max_bytes`` raises
    :class:`~kernel_ext.errors.BlockTooLargeError`.
    """
    try:
        if isinstance(data, (str, bytes, bytearray)):
            _check_size(data, max_bytes)
            return Block.model_validate_json(data)
        if not isinstance(data, Mapping):
            raise DecodeError(f"invalid block: expected a JSON object, got {type(data).__name__}")
        return Block.model_validate(data)
    except ValidationError as exc:
        raise _decode_error(exc, "block") from None
    except RecursionError:
        raise DecodeError("invalid block: nested too deeply") from None


def decode_envelope(data: Wire) -> Envelope:
    """Decode one envelope (JSON or mapping); errors as for :func:`decode`."""
    try:
        if isinstance(data, (str, bytes, bytearray)):
            return Envelope.model_validate_json(data)
        if not isinstance(data, Mapping):
            raise DecodeError(
                f"invalid envelope: expected a JSON object, got {type(data).__name__}"
            )
        return Envelope.model_validate(data)
    except ValidationError as exc:
        raise _decode_error(exc, "envelope") from None
    except RecursionError:
        raise DecodeError("invalid envelope: nested too deeply") from None


def _encoded_len(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8"))


def _longest_string(payload: Any) -> tuple[Any, Any, str] | None:
    """Return (container, key, value) of the longest string in payload, or None."""
    best: tuple[Any, Any, str] | None = None
    stack: list[Any] = [payload]
    while stack:
        item = stack.pop()
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for key, value in pairs:
            if isinstance(value, str):
                if best is None or len(value) > len(best[2]):
                    best = (item, key, value)
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return best


def _truncate(block: Block, max_bytes: int, size: int) -> str:
    wire = block.model_dump(by_alias=True, mode="json")
    payload = wire["envelope"]["payload"]
    for _ in range(16):
        found = _longest_string(payload)
        if found is None:
            break
        container, key, text = found
        overflow = size - max_bytes
        per_char = max(1.0, _encoded_len(text) / max(1, len(text)))
        marker_room = _encoded_len(TRUNCATION_MARKER.format(n=len(text)))
        keep = max(0, len(text) - math.ceil((overflow + marker_room) / per_char) - 1)
        if keep >= len(text) - len(TRUNCATION_MARKER):
            break
        container[key] = text[:keep] + TRUNCATION_MARKER.format(n=len(text) - keep)
        encoded = json.dumps(wire, ensure_ascii=False, separators=(",", ":"))
        size = len(encoded.encode("utf-8"))
        if size <= max_bytes:
            return encoded
    raise BlockTooLargeError(
        f"block is {size} bytes after truncating payload strings, over the bound of "
        f"{max_bytes} bytes",
        field="envelope.payload",
    )


def encode(block: Block, *, max_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> str:
    """Encode one block as compact JSON with the spec's camelCase names.

    Over ``max_bytes`` the longest payload strings are cut with the visible marker
    ``…[truncated N chars]`` until the block fits; if that cannot make it fit,
    :class:`~kernel_ext.errors.BlockTooLargeError` is raised.
    """
    encoded = block.model_dump_json(by_alias=True)
    if len(encoded) * 4 <= max_bytes:
        return encoded
    size = len(encoded.encode("utf-8"))
    if size <= max_bytes:
        return encoded
    return _truncate(block, max_bytes, size)


def block_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a block as it appears on the wire."""
    schema = Block.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "tool_event_stream block"
    return schema
