"""The ``tool_event_stream`` wire protocol: blocks, envelopes, one encode/decode pair.

A *block* is one ``tool_event_stream`` message; its *envelope* is the peer's progress
object, passed through unchanged::

    {"v": 1, "callId": "00f067aa0ba902b7", "taskId": "…", "state": "running",
     "ts": 1789123456789, "envelope": {"v": 1, "kind": "thinking", "streamKey": "…",
                                       "seq": 42, "status": "running", "payload": {…}}}

Rules pinned here:

* ``state`` is ``running | done | aborted``; a ``done`` block's answer is the string
  ``envelope.payload.text``, an ``aborted`` block's the string ``envelope.payload.message``.
* ``callId``: the tool call's span id (16 lower-case hex digits) or ``null``; ``traceId``
  (optional): its trace id (32), never all zeros, never beside a ``null`` callId.
* Unknown envelope kinds and fields are kept; unknown block fields are rejected.
* ``seq`` is a non-negative integer; payloads are JSON (finite numbers, nested at most
  :data:`MAX_PAYLOAD_DEPTH` levels).
* :func:`block_size` is *the* size of a block, for the worker, the relay and every check.
  :func:`encode` truncates a block over ``max_bytes`` (default
  :data:`DEFAULT_MAX_BLOCK_BYTES`, 64 KiB) with a visible marker, else raises
  :class:`~kernel_ext.errors.BlockTooLargeError`; :func:`decode` rejects, never truncates.
* A terminal that cannot be sent as it is is never just lost: :func:`fallback_terminal`.
* Payload strings may hold lone surrogates (JSON's ``\\ud800`` escapes, which the Socket.IO
  path carries as such); a sender whose encoding cannot carry one replaces each with
  U+FFFD: :func:`well_formed`, :func:`well_formed_json`.

Design: docs/contracts.md, "The wire protocol module".

The package's other module: :mod:`kernel_ext.protocol.schema`, the wire described for other
languages (the JSON Schema of a block, the payloads of the known kinds); it reads this
module's models, so this module does not import it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kernel_ext.errors import BlockTooLargeError, DecodeError

__all__ = [
    "ACKS_PACED",
    "CHAT_EVENT",
    "DEFAULT_MAX_BLOCK_BYTES",
    "FRAME_ROOMS",
    "JOIN_EVENT",
    "KNOWN_KINDS",
    "KX_BLOCKS",
    "KX_CHAT_EVENT",
    "KX_HELLO",
    "KX_HELLO_MAX_OPEN",
    "KX_STOP",
    "LEAVE_EVENT",
    "MAX_CONVERSATION_ID_CHARS",
    "MAX_PAYLOAD_DEPTH",
    "MAX_TASK_ID_CHARS",
    "NAMESPACE",
    "PROTOCOL_VERSION",
    "REFUSED_BAD_WORKER",
    "REFUSED_UNAUTHORIZED",
    "REPLAY_IDLE",
    "STOPPED_KEY",
    "STOP_ANSWERS",
    "STOP_EVENT",
    "STOP_UNDER_WAY",
    "TERMINAL_KEYS",
    "TERMINAL_STATES",
    "TOOL_EVENT_STREAM",
    "TRACE_ID_PATTERN",
    "TRUNCATION_MARKER",
    "WORKER_HEARTBEAT",
    "WORKER_ID_PATTERN",
    "WORKER_TAG",
    "Block",
    "BlockState",
    "Envelope",
    "block_size",
    "check_block",
    "compact_bytes",
    "decode",
    "decode_envelope",
    "encode",
    "encode_wire",
    "fallback_terminal",
    "fits",
    "is_well_formed",
    "pseudo_envelope",
    "terminal_envelope",
    "text_block",
    "text_block_fast_limit",
    "trace_id_hex",
    "well_formed",
    "well_formed_json",
    "wire_text",
]

PROTOCOL_VERSION = 1

# Socket.IO names of the delivery path (decision T1; relay frames: docs/contracts.md).
NAMESPACE = "/chat"
TOOL_EVENT_STREAM = "tool_event_stream"
CHAT_EVENT = "chat_event"
JOIN_EVENT = "join_conversation"
LEAVE_EVENT = "leave_conversation"
# A browser asks to stop one running call of a room it joined (docs/web.md, "Stopping a
# call"): {"v": 1, "room": <conversation id>, "callId": <call id>}, acknowledged
# {"answer": <one of STOP_ANSWERS>} and maybe a short "reason".
STOP_EVENT = "stop_call"
STOP_UNDER_WAY = "stopping"
STOP_ANSWERS: tuple[str, ...] = (
    STOP_UNDER_WAY,  # the worker was asked; the call's terminal follows
    "already_ended",  # the call had ended
    "unknown",  # no running call with that callId in that room
    "refused",  # not allowed: not joined, the application's hook said no, or rate-limited
    "unreachable",  # no worker reachable: the pane ends as a gone worker's does
)
"""Every answer a relay gives to :data:`STOP_EVENT`; anything else is a failure."""
MAX_CONVERSATION_ID_CHARS = 512
"""The longest conversation id (a room's name) a relay takes, in characters."""
MAX_TASK_ID_CHARS = 512
"""The longest ``taskId`` of a block, in characters."""
KX_BLOCKS = "kx_blocks"
KX_CHAT_EVENT = "kx_chat_event"
KX_HELLO = "kx_hello"
KX_HELLO_MAX_OPEN = 1_000
"""The most open streams a sender announces in ``kx_hello`` (``open``), newest first, and
the most a relay reads of one: each entry past them is ignored, counted
``rejected_bad_announce``."""
# Relay → worker, on the worker's own connection: stop one running call of this worker.
# ``{"v": 1, "callId": "<16 hex>"}``, acknowledged ``{"answer": <kernel_ext.StopAnswer>}``.
KX_STOP = "kx_stop"
# A relay that answers ``kx_hello`` with this in ``frames`` takes blocks of several rooms in
# one ``kx_blocks`` frame: {"v": 1, "rooms": [{"room", "blocks"}, ...]}.
FRAME_ROOMS = "rooms"
# A relay that answers ``kx_hello`` with ``"acks": ACKS_PACED`` acknowledges every
# ``kx_blocks`` frame that asks for it, and only once its browsers' queues have room (or a
# bounded wait passed): a sender may then keep a window of frames awaiting acknowledgement.
ACKS_PACED = "paced"
# Why the relay refuses a connection: the ``message`` of its CONNECT error.
REFUSED_UNAUTHORIZED = "unauthorized"
REFUSED_BAD_WORKER = "bad worker id"
KNOWN_KINDS: frozenset[str] = frozenset(
    {"thinking", "tool_call", "text", "tool_output_append", "progress"}
)
BlockState = Literal["running", "done", "aborted"]
TERMINAL_STATES: frozenset[str] = frozenset({"done", "aborted"})
TERMINAL_KEYS: Mapping[str, str] = {"done": "text", "aborted": "message"}
STOPPED_KEY = "stopped"
"""An ``aborted`` block's ``envelope.payload.stopped``: ``true`` when the user stopped the
call (:func:`kernel_ext.stop_call`), a stop rather than a failure; absent otherwise. Readers
treat only ``true`` as stopped (additive: ``v`` stays 1)."""
"""The string each terminal state carries in ``envelope.payload``: the final answer, the
summary of why the stream ended without one."""
DEFAULT_MAX_BLOCK_BYTES = 64 * 1024
MAX_PAYLOAD_DEPTH = 32
TRUNCATION_MARKER = "…[truncated {n} chars]"
CALL_ID_PATTERN = r"^[0-9a-f]{16}$"
TRACE_ID_PATTERN = r"^[0-9a-f]{32}$"
_NO_TRACE_ID = "0" * 32  # W3C: all zeros is the invalid trace id
# A sender's worker id (connect auth ``worker``; the Redis liveness signal), matched whole
# (``re.fullmatch``); on the Socket.IO Redis channel, the ``method`` of the heartbeat and the
# key that tags a write-only sender's emits with its id (docs/contracts.md).
WORKER_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}"
WORKER_HEARTBEAT = "kx_worker_heartbeat"
REPLAY_IDLE = 900.0
"""Seconds a stream without a terminal is kept for catch-up after its last block: the
relay's memory (:class:`~kernel_ext.relay.replay.ReplayMemory`'s default) and a room's log
on Redis (:mod:`kernel_ext.redis.routing`)."""

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


# The constraint before the validator: the JSON Schema then says ``minimum`` (after it,
# pydantic writes its own keyword ``ge``, which standard validators ignore).
Seq = Annotated[int, Field(ge=0), BeforeValidator(_coerce_seq)]


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

    v: StrictInt = Field(default=PROTOCOL_VERSION, ge=1, description="envelope version, 1")
    kind: StrictStr = Field(
        min_length=1,
        max_length=64,
        description="thinking, tool_call, text, tool_output_append, progress, or any other "
        "kind, kept as it is",
    )
    stream_key: StrictStr = Field(
        max_length=MAX_TASK_ID_CHARS,
        description="the peer's stream; the task id in a pseudo-envelope",
    )
    seq: Seq = Field(description="orders the blocks of one stream")
    status: StrictStr = Field(max_length=64, description="the peer's status word")
    payload: dict[str, Any] = Field(
        default_factory=dict,
        description="the kind's content; a done block's text is the final answer, an "
        "aborted block's message a summary (and its stopped, when true, says the user "
        "stopped the call: a stop, not a failure)",
    )

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

    v: Literal[1] = Field(description="protocol version")
    call_id: Annotated[StrictStr, Field(pattern=CALL_ID_PATTERN)] | None = Field(
        description="the span id of the tool call's execute_tool span, 16 lower-case hex "
        "digits; null when it could not be found without guessing"
    )
    task_id: StrictStr = Field(
        min_length=1,
        max_length=MAX_TASK_ID_CHARS,
        description="the A2A task id; blocks made without an A2A task use the callId",
    )
    state: BlockState = Field(
        description="running: progress; done: the terminal, the final answer in "
        "envelope.payload.text; aborted: the terminal, a summary in envelope.payload.message"
    )
    ts: StrictInt = Field(ge=0, description="emit time at the caller, epoch milliseconds")
    envelope: Envelope = Field(description="the peer's envelope, passed through unchanged")
    trace_id: Annotated[StrictStr, Field(pattern=TRACE_ID_PATTERN)] | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # absent from the wire when unknown
        json_schema_extra={"not": {"const": _NO_TRACE_ID}},
        description="optional: the trace id of the tool call's execute_tool span, 32 "
        "lower-case hex digits, not all zeros; absent or null when unknown, and never "
        "beside a null callId",
    )

    @model_validator(mode="after")
    def _terminal_payload(self) -> Block:
        key = TERMINAL_KEYS.get(self.state)
        if key is not None and not isinstance(self.envelope.payload.get(key), str):
            raise ValueError(f"a {self.state} block must carry a string envelope.payload.{key}")
        return self

    @field_validator("trace_id")
    @classmethod
    def _trace_of_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            if value == _NO_TRACE_ID:
                raise ValueError("traceId must not be all zeros (the invalid trace id)")
            if info.data.get("call_id", "") is None:
                raise ValueError("a block without a callId carries no traceId")
        return value

    @property
    def is_terminal(self) -> bool:
        """Whether this block closes its stream (``done`` or ``aborted``)."""
        return self.state in TERMINAL_STATES


def trace_id_hex(trace_id: int) -> str | None:
    """The ``traceId`` of a span's trace id: its 32 lower-case hex digits, zero-padded;
    ``None`` for 0 (the invalid trace id), a negative one or one over 128 bits."""
    if trace_id <= 0 or trace_id >> 128:
        return None
    return trace_id.to_bytes(16, "big").hex()


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
    key = TERMINAL_KEYS[state]
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


# One encoder, built once: json.dumps with arguments builds a new one on every call.
_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


wire_text: Callable[[Any], str] = json.JSONEncoder(separators=(",", ":")).encode
"""The JSON text a sender puts on the wire for a JSON-ready value: python-socketio's own
encoding of event data (``json.dumps(data, separators=(",", ":"))``: non-ASCII characters
and lone surrogates as ``\\u`` escapes), so a block pre-encoded with it travels
byte for byte as the same block encoded by python-socketio would. Not the size measure
(:func:`compact_bytes`)."""


def compact_bytes(wire: Mapping[str, Any]) -> bytes:
    """A block's compact JSON as UTF-8 (separators ``,`` and ``:``, non-ASCII characters
    as themselves, a lone surrogate as 3 bytes): what :func:`block_size` measures, and
    what a relay holds for catch-up. Raises ``ValueError``/``TypeError`` for a value JSON
    cannot hold (NaN, a set, …)."""
    return _compact(wire).encode("utf-8", "surrogatepass")


_SURROGATE = re.compile("[\ud800-\udfff]")


def is_well_formed(text: str) -> bool:
    """Whether UTF-8 (and every encoder that refuses surrogates) can carry ``text`` as it is:
    it holds no surrogate (:func:`well_formed` would return it unchanged)."""
    return text.isascii() or _SURROGATE.search(text) is None


def well_formed(text: str) -> str:
    """``text`` as UTF-8 (and every encoder that refuses surrogates) can carry it: each
    lone surrogate replaced by U+FFFD, the replacement character, and a surrogate pair
    joined into the character it stands for, as a JSON parser reads ``\\ud83d\\ude00``
    (JavaScript's ``String.prototype.toWellFormed``). ``text`` itself when it holds no
    surrogate."""
    if is_well_formed(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _holds_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item) is not None:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


def well_formed_json(value: Any) -> Any:
    """``value`` (parsed JSON: dicts, lists, strings, numbers, …) with :func:`well_formed`
    applied to every string in it, dict keys included (two keys made equal keep the later
    value); a tuple comes back a list. ``value`` itself, untouched, when it holds no
    surrogate; else a copy, ``value`` untouched. Any depth (no recursion)."""
    if not _holds_surrogate(value):
        return value
    root = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, key = stack.pop()
        item = parent[key]
        if isinstance(item, str):
            parent[key] = well_formed(item)
        elif isinstance(item, dict):
            copy = {well_formed(k) if isinstance(k, str) else k: v for k, v in item.items()}
            parent[key] = copy
            stack.extend((copy, k) for k in copy)
        elif isinstance(item, (list, tuple)):
            items = parent[key] = list(item)
            stack.extend((items, i) for i in range(len(items)))
    return root[0]


def block_size(wire: Mapping[str, Any]) -> int:
    """The size of a block in bytes: the length of :func:`compact_bytes`.

    The one measure of the size bound: the worker truncates to it and the relay checks it,
    so what one accepts the other accepts. ``wire`` is the block as a JSON-ready mapping
    (its wire form, camelCase keys). Raises ``ValueError``/``TypeError`` for a value JSON
    cannot hold (NaN, a set, …).
    """
    return len(compact_bytes(wire))


def fits(wire: Mapping[str, Any], max_bytes: int) -> bool:
    """Whether ``block_size(wire) <= max_bytes``, cheaply for small blocks.

    ``wire`` is made of dicts, lists, strings, numbers, booleans and ``None`` (as parsed
    JSON is): then no character of its ``repr`` becomes more than 4 bytes of its compact
    JSON, and a block whose ``repr`` is within a quarter of the bound is not measured.
    """
    if len(repr(wire)) * 4 <= max_bytes:
        return True
    return block_size(wire) <= max_bytes


# The fixed parts of a text block (keys, v, state, ts, seq, callId, traceId, punctuation) take
# fewer bytes than this; a character of its text or task id takes at most 6 (``\u0001``).
_TEXT_BLOCK_FIXED = 256
_MAX_BYTES_PER_CHAR = 6


def text_block_fast_limit(max_bytes: int) -> int:
    """How many characters the text and the task id of a pseudo-envelope or terminal text
    block may hold together (the task id counted twice: it is the stream key too) for the
    block to be within ``max_bytes`` whatever they contain. Senders use it to skip
    :func:`block_size` for small blocks; a bound, not a second measure."""
    return max(0, (max_bytes - _TEXT_BLOCK_FIXED) // _MAX_BYTES_PER_CHAR)


def _too_large(size: int, max_bytes: int) -> BlockTooLargeError:
    return BlockTooLargeError(f"block is {size} bytes, over the bound of {max_bytes} bytes")


def decode(data: Wire, *, max_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> Block:
    """Decode one block from JSON text/bytes or from an already parsed mapping.

    Raises :class:`~kernel_ext.errors.DecodeError` (one type for every bad input) whose
    message and ``field`` name the offending wire field; a block whose :func:`block_size`
    is over ``max_bytes`` raises :class:`~kernel_ext.errors.BlockTooLargeError` (JSON text
    more than 16 times the bound is refused unread).
    """
    if isinstance(data, (str, bytes, bytearray)):
        if len(data) > 16 * max_bytes:
            raise _too_large(len(data), max_bytes)
        try:
            parsed = json.loads(data)
        except RecursionError:
            raise DecodeError("invalid block: nested too deeply") from None
        except ValueError as exc:
            raise DecodeError(f"invalid block: not a JSON object ({exc})") from None
        data = parsed
    return _checked(data, max_bytes, exact=False)[0]


def check_block(wire: object, *, max_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> bytes:
    """:func:`decode` of a block already parsed, for a relay that passes it on as it came:
    the same checks and errors, the size measured exactly (not :func:`fits`' quick test);
    returns the block's :func:`compact_bytes` (so a relay that keeps it encodes it once)."""
    encoded = _checked(wire, max_bytes, exact=True)[1]
    assert encoded is not None
    return encoded


def _checked(data: object, max_bytes: int, *, exact: bool) -> tuple[Block, bytes | None]:
    """A parsed block validated and within ``max_bytes`` (and, ``exact``, its compact
    JSON); the one set of checks and errors of :func:`decode` and :func:`check_block`."""
    try:
        if not isinstance(data, Mapping):
            raise DecodeError(f"invalid block: expected a JSON object, got {type(data).__name__}")
        block = Block.model_validate(data)
        if exact:
            encoded = compact_bytes(data)
            if len(encoded) > max_bytes:
                raise _too_large(len(encoded), max_bytes)
            return block, encoded
        if not fits(data, max_bytes):
            raise _too_large(block_size(data), max_bytes)
        return block, None
    except ValidationError as exc:
        raise _decode_error(exc, "block") from None
    except RecursionError:
        raise DecodeError("invalid block: nested too deeply") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, DecodeError):
            raise
        raise DecodeError(f"invalid block: not JSON ({exc})") from None


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
    return len(_compact(text).encode("utf-8", "surrogatepass"))


_MARKER_RE = re.compile(r"…\[truncated (\d+) chars\]\Z")


def _cut(text: str, keep: int) -> str:
    """``text`` cut to its first ``keep`` characters plus the marker; a text that ends with
    a marker already keeps one marker, counting every character cut so far."""
    already = 0
    found = _MARKER_RE.search(text)
    if found is not None:
        already = int(found.group(1))
        text = text[: found.start()]
    keep = min(keep, len(text))
    return text[:keep] + TRUNCATION_MARKER.format(n=len(text) - keep + already)


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


def _truncate(wire: dict[str, Any], max_bytes: int, size: int) -> str:
    """Cut ``wire``'s payload strings (in place), longest first, until its compact JSON
    fits; return that JSON. A string's cut is estimated from its average bytes per
    character; when that is not enough, the longest prefix that fits is searched (binary
    search), so it converges whatever the text holds."""
    payload = wire["envelope"]["payload"]

    def measured() -> tuple[str, int]:
        encoded = _compact(wire)
        return encoded, len(encoded.encode("utf-8", "surrogatepass"))

    for _ in range(16):
        found = _longest_string(payload)
        if found is None:
            break
        container, key, text = found
        marked = _MARKER_RE.search(text)
        base_len = marked.start() if marked is not None else len(text)
        if base_len == 0:
            break  # the longest string is a bare marker: the bulk is not in strings
        per_char = max(1.0, _encoded_len(text) / max(1, len(text)))
        marker_room = _encoded_len(TRUNCATION_MARKER.format(n=len(text)))
        keep = max(0, base_len - math.ceil((size - max_bytes + marker_room) / per_char))
        container[key] = _cut(text, keep)
        encoded, size = measured()
        if size <= max_bytes:
            return encoded
        container[key] = _cut(text, 0)
        encoded, size = measured()
        if size > max_bytes:
            continue  # this string alone cannot make it fit: cut the next one too
        fits_at, over_at = 0, keep  # the longest prefix that fits lies in [fits_at, over_at)
        while over_at - fits_at > 1:
            middle = (fits_at + over_at) // 2
            container[key] = _cut(text, middle)
            if measured()[1] <= max_bytes:
                fits_at = middle
            else:
                over_at = middle
        container[key] = _cut(text, fits_at)
        return measured()[0]
    raise BlockTooLargeError(
        f"block is {size} bytes after truncating payload strings, over the bound of "
        f"{max_bytes} bytes",
        field="envelope.payload",
    )


def encode(block: Block, *, max_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> str:
    """Encode one block as compact JSON with the spec's camelCase names.

    The result's :func:`block_size` is at most ``max_bytes``: over it, the longest payload
    strings are cut with the visible marker ``…[truncated N chars]`` until the block fits;
    if that cannot make it fit, :class:`~kernel_ext.errors.BlockTooLargeError` is raised.
    """
    return encode_wire(block.model_dump(by_alias=True, mode="json"), max_bytes=max_bytes)


def encode_wire(wire: dict[str, Any], *, max_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> str:
    """:func:`encode` for a block already in its wire form (a valid block's JSON-ready
    dict, which may be changed in place when it has to be cut)."""
    encoded = _compact(wire)
    if len(encoded) * 4 <= max_bytes:
        return encoded
    size = len(encoded.encode("utf-8", "surrogatepass"))
    if size <= max_bytes:
        return encoded
    return _truncate(wire, max_bytes, size)


FALLBACK_TOO_LARGE = "[the final answer was too large to show]"
FALLBACK_INVALID = "[the final block could not be shown]"


def fallback_terminal(
    call_id: str | None,
    task_id: str,
    state: Literal["done", "aborted"],
    ts: int,
    seq: int,
    *,
    too_large: bool,
    trace_id: str | None = None,
) -> dict[str, Any]:
    """The short terminal a terminal is degraded to when it cannot be sent as it is: the
    same stream and state, a text saying why (:data:`FALLBACK_TOO_LARGE` or
    :data:`FALLBACK_INVALID`). A valid block for any string ``task_id`` of 1–512
    characters (a longer or empty one is replaced by its first 512 characters or ``-``,
    a lone surrogate in it by U+FFFD: :func:`well_formed`), with ``trace_id`` as
    :func:`text_block` takes it."""
    task_id = well_formed(task_id[:MAX_TASK_ID_CHARS]) or "-"
    text = FALLBACK_TOO_LARGE if too_large else FALLBACK_INVALID
    return text_block(call_id, task_id, state, ts, seq, text, trace_id)


def text_block(
    call_id: str | None,
    task_id: str,
    state: str,
    ts: int,
    seq: int,
    text: str,
    trace_id: str | None = None,
) -> dict[str, Any]:
    """The wire form of a block whose envelope is the caller's own text envelope: a running
    block's pseudo-envelope (``payload.text``) or a terminal (``payload.text`` for ``done``,
    ``payload.message`` for ``aborted``); ``traceId`` last, when ``trace_id`` is given and
    ``call_id`` is not ``None``. Built as is, not validated: the caller passes a valid call
    id, trace id, a task id of 1–512 characters and a non-negative seq."""
    wire: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "callId": call_id,
        "taskId": task_id,
        "state": state,
        "ts": ts,
        "envelope": {
            "v": PROTOCOL_VERSION,
            "kind": "text",
            "streamKey": task_id,
            "seq": seq,
            "status": state,
            "payload": {TERMINAL_KEYS.get(state, "text"): text},
        },
    }
    if trace_id is not None and call_id is not None:
        wire["traceId"] = trace_id
    return wire
