"""TypeScript declarations of the wire, generated from the models of :mod:`kernel_ext.protocol`.

``kernel-ext schema --typescript`` prints :func:`declarations`; the package ships the same
text as ``kernel_ext/web/tool_event_stream.d.ts`` (:data:`kernel_ext.web.DECLARATIONS`,
``asset_path(DECLARATIONS)``), and the test suite
regenerates it and compares, so the file cannot drift from the models. What it declares:

* ``Block`` and ``Envelope``, translated from :func:`~kernel_ext.protocol.schema.block_json_schema`
  (the JSON Schema's descriptions and constraints become doc comments);
* the payload of each known kind (:data:`~kernel_ext.protocol.schema.KIND_PAYLOADS`) and of each
  terminal state (:data:`~kernel_ext.protocol.TERMINAL_KEYS`), an envelope type per known
  kind and a block type per state, whose union is ``ToolEventStreamBlock``;
* the Socket.IO events of namespace ``/chat`` as socket.io-client's event maps
  (``Socket<ServerToClientEvents, ClientToServerEvents>``), with the join's request
  (``have``: what the browser holds) and answer (``replay``: what the catch-up sent), and
  the stop request and its answer;
* the pane state of ``renderer.js``'s ``PaneStore.state()`` (the conformance vectors'
  format), its literal unions taken from :mod:`kernel_ext.viewing.view`.

Only the JSON Schema features the models use are translated: ``$ref``, ``const``, ``enum``,
``anyOf``, the JSON types, ``properties``/``required`` and open objects.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any, get_args

from pydantic import TypeAdapter

from kernel_ext.protocol import (
    CHAT_EVENT,
    JOIN_EVENT,
    LEAVE_EVENT,
    NAMESPACE,
    STOP_ANSWERS,
    STOP_EVENT,
    TERMINAL_KEYS,
    TOOL_EVENT_STREAM,
    BlockState,
)
from kernel_ext.protocol.schema import KIND_PAYLOADS, block_json_schema
from kernel_ext.viewing.view import DROP_REASONS, MAX_JOIN_STREAMS, PaneMode, PaneStatus

__all__ = ["declarations"]

_HEADER = """\
// TypeScript declarations of kernel_ext's tool_event_stream wire (namespace "{namespace}").
// Generated from the models of kernel_ext.protocol by `kernel-ext schema --typescript`:
// do not edit; regenerate it. Validate untrusted input with the JSON Schema
// (`kernel-ext schema`): these types describe, they do not check.
"""

_WIDTH = 100
_NAME = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]*$")


def _doc(text: str | None, indent: str = "") -> list[str]:
    """A JSDoc comment holding ``text`` (reST double backticks as single ones), wrapped."""
    if not text:
        return []
    flat = " ".join(text.replace("``", "`").split()).replace("*/", "*\\/")
    if len(indent) + len(flat) + 7 <= _WIDTH:
        return [f"{indent}/** {flat} */"]
    lines = textwrap.wrap(flat, _WIDTH - len(indent) - 3, break_on_hyphens=False)
    return [f"{indent}/**", *(f"{indent} * {line}" for line in lines), f"{indent} */"]


def _constraints(schema: dict[str, Any]) -> list[str]:
    notes = []
    if "pattern" in schema:
        notes.append(f"pattern /{schema['pattern']}/")
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is not None and high is not None:
        notes.append(f"{low} to {high} characters")
    elif high is not None:
        notes.append(f"at most {high} characters")
    elif low is not None:
        notes.append(f"at least {low} characters")
    if "minimum" in schema:
        kind = "an integer" if schema.get("type") == "integer" else "a number"
        notes.append(f"{kind}, at least {schema['minimum']}")
    return notes


def _describe(schema: dict[str, Any]) -> str | None:
    """A property's description with its constraints."""
    notes = _constraints(schema)
    for member in schema.get("anyOf", []):
        notes += _constraints(member)
    text = schema.get("description") or ""
    if notes:
        text = f"{text} ({'; '.join(notes)})" if text else "; ".join(notes).capitalize()
    return text or None


def _type(schema: dict[str, Any], indent: str) -> str:
    """The TypeScript type of a JSON Schema (the subset the models produce)."""
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    if "anyOf" in schema:
        return " | ".join(_type(member, indent) for member in schema["anyOf"])
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return "number"
    if kind in ("string", "boolean", "null"):
        return str(kind)
    if kind == "array":
        items = schema.get("items")
        return f"Array<{_type(items, indent) if items else 'unknown'}>"
    if kind == "object":
        if "properties" in schema:
            return "{\n" + "\n".join(_members(schema, indent + "  ")) + f"\n{indent}}}"
        return "{ [key: string]: unknown }"
    return "unknown"  # any JSON value


def _members(schema: dict[str, Any], indent: str) -> list[str]:
    """The members of an object type: each property (optional unless required), then an
    index signature when the object is open (JSON Schema's default)."""
    required = set(schema.get("required", ()))
    lines: list[str] = []
    for name, prop in schema.get("properties", {}).items():
        key = name if _NAME.match(name) else json.dumps(name)
        mark = "" if name in required else "?"
        lines += _doc(_describe(prop), indent)
        lines.append(f"{indent}{key}{mark}: {_type(prop, indent)};")
    if schema.get("additionalProperties", True) is not False:
        lines.append(f"{indent}[key: string]: unknown;")
    return lines


def _interface(
    name: str, schema: dict[str, Any], extends: str | None = None, doc: str | None = None
) -> list[str]:
    head = f"export interface {name}" + (f" extends {extends}" if extends else "") + " {"
    return [*_doc(doc or schema.get("description")), head, *_members(schema, "  "), "}", ""]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _pascal(kind: str) -> str:
    return "".join(part.capitalize() for part in kind.split("_"))


def declarations() -> str:
    """The text of ``tool_event_stream.d.ts`` (module docstring)."""
    schema = block_json_schema()
    out = [_HEADER.format(namespace=NAMESPACE)]
    out += _interface("Envelope", schema["$defs"]["Envelope"])
    out += _interface("Block", schema, doc=schema["description"])
    out += ["/** A block's state: progress, or the stream's one terminal. */"]
    out += ['export type BlockState = Block["state"];', ""]

    for payload in KIND_PAYLOADS.values():
        out += _interface(payload.__name__, TypeAdapter(payload).json_schema())
    for state, key in TERMINAL_KEYS.items():
        what = "the final answer" if state == "done" else "why the stream ended without an answer"
        out += [f"/** The payload of {_article(state)} `{state}` block: {what}. */"]
        out += [f"export interface {_pascal(state)}Payload {{", f"  {key}: string;"]
        out += ["  [key: string]: unknown;", "}", ""]
    envelopes = []
    for kind, payload in KIND_PAYLOADS.items():
        name = f"{_pascal(kind)}Envelope"
        envelopes.append(name)
        out += [f"/** An envelope of the known kind `{kind}`. */"]
        out += [f"export interface {name} extends Envelope {{"]
        out += [f"  kind: {json.dumps(kind)};", f"  payload?: {payload.__name__};", "}", ""]
    out += ["/** An envelope of one of the known kinds; any other kind is an `Envelope`. */"]
    out += ["export type KnownEnvelope =", *(f"  | {name}" for name in envelopes)]
    out[-1] += ";"
    out += ['export type KnownKind = KnownEnvelope["kind"];', ""]

    blocks = []
    for state in get_args(BlockState):
        name = f"{_pascal(state)}Block"
        blocks.append(name)
        role = "the one terminal" if state in TERMINAL_KEYS else "progress"
        out += [f"/** {_article(state).capitalize()} `{state}` block: {role} of its stream. */"]
        out += [f"export interface {name} extends Block {{", f"  state: {json.dumps(state)};"]
        if state in TERMINAL_KEYS:
            out += [f"  envelope: Envelope & {{ payload: {_pascal(state)}Payload }};"]
        out += ["}", ""]
    out += ["/** One `tool_event_stream` message, told apart by `state`. */"]
    out += [f"export type ToolEventStreamBlock = {' | '.join(blocks)};", ""]

    out += _join_declarations()
    out += _stop_declarations()
    out += [
        "/** What `leave_conversation` answers (and `join_conversation` without `replay`). */",
        "export type RoomAnswer = { ok: true } | { ok: false; error: string };",
        "",
        *_doc(
            f"Events a browser receives in namespace {json.dumps(NAMESPACE)} (socket.io-client: "
            "`Socket<ServerToClientEvents, ClientToServerEvents>`)."
        ),
        "export interface ServerToClientEvents {",
        f"  {TOOL_EVENT_STREAM}: (block: ToolEventStreamBlock) => void;",
        "  /** The kernel's own tool-event snapshot, passed through unchanged. */",
        f"  {CHAT_EVENT}: (event: {{ [key: string]: unknown }}) => void;",
        "}",
        "",
        f"/** Events a browser sends in namespace {json.dumps(NAMESPACE)}, each acknowledged. */",
        "export interface ClientToServerEvents {",
        f"  {JOIN_EVENT}: (",
        "    request: JoinRequest,",
        "    ack: (answer: JoinAnswer) => void,",
        "  ) => void;",
        f"  {LEAVE_EVENT}: (",
        "    request: { conversationId: string },",
        "    ack: (answer: RoomAnswer) => void,",
        "  ) => void;",
        f"  {STOP_EVENT}: (",
        "    request: StopRequest,",
        "    ack: (answer: StopAnswer) => void,",
        "  ) => void;",
        "}",
        "",
        *_pane_state_declarations(),
    ]
    return "\n".join(out) + "\n"


def _union(values: tuple[str, ...]) -> str:
    return " | ".join(json.dumps(value) for value in values)


def _join_declarations() -> list[str]:
    """The join's request and answer, catch-up included (docs/web.md, "Catching up")."""
    seq = "an integer, 0 to 2**53 - 1"
    return [
        "/** One stream a browser already holds part of, in a join's `have`. */",
        "export interface StreamCursor {",
        "  /** the stream's callId; null for the final answer of a call without one */",
        "  callId: string | null;",
        "  taskId: string;",
        f"  /** the highest seq held, the stream's items' and terminal's ({seq}) */",
        "  seq: number;",
        "  /** true when the stream's terminal is held (its seq need not be the highest: a "
        "colleague's blocks carry its own seqs); the relay then sends nothing more of the "
        "stream */",
        "  ended?: boolean;",
        "}",
        "",
        f"/** What `{JOIN_EVENT}` sends. */",
        "export interface JoinRequest {",
        "  /** the conversation id, the room to join */",
        "  conversationId: string;",
        *_doc(
            "per stream, the highest seq the browser holds: a relay that catches up sends "
            "only the blocks above it (without an entry, all it holds of that stream); at "
            f"most {MAX_JOIN_STREAMS:,} entries are read",
            "  ",
        ),
        "  have?: StreamCursor[];",
        "}",
        "",
        "/** A stream of which the relay no longer held blocks the browser lacks. */",
        "export interface MissingBlocks {",
        "  callId: string | null;",
        "  taskId: string;",
        "  /** how many (at most), at least 1 */",
        "  blocks: number;",
        "}",
        "",
        "/** What a join's catch-up sent; absent from a relay that keeps nothing. */",
        "export interface Replay {",
        "  /** blocks sent to this browser before the answer */",
        "  blocks: number;",
        "  /** streams they belong to */",
        "  streams: number;",
        "  /** absent or empty when nothing is missing */",
        "  missing?: MissingBlocks[];",
        *_doc(
            "true when the connection's catch-up budget stopped the catch-up: what was not "
            "sent is in `missing` (the browser is in the room all the same). Also sent to a "
            "join without `have`. A renderer that re-joins with `have` sends only what it "
            "lacks and stays within the budget",
            "  ",
        ),
        "  limited?: true;",
        "}",
        "",
        f"/** What `{JOIN_EVENT}` answers. */",
        "export type JoinAnswer = { ok: true; replay?: Replay } | { ok: false; error: string };",
        "",
    ]


def _stop_declarations() -> list[str]:
    """The stop request and its answer (docs/web.md, "Stopping a call")."""
    return [
        f"/** What `{STOP_EVENT}` sends: stop one running call of a room the browser joined. */",
        "export interface StopRequest {",
        "  v: 1;",
        "  /** the conversation id, a room this browser joined */",
        "  room: string;",
        "  /** the call to stop: its callId (16 lower-case hex digits) */",
        "  callId: string;",
        "}",
        "",
        *_doc(
            "How a relay answers a stop: `stopping` (the worker was asked; the call's terminal "
            "follows), `already_ended`, `unknown` (no running call with that callId in that "
            "room), `refused` (not joined, the application's hook said no, or rate-limited), "
            "`unreachable` (no worker reachable: the pane ends as a gone worker's does)"
        ),
        f"export type StopAnswerWord = {_union(STOP_ANSWERS)};",
        "",
        f"/** What `{STOP_EVENT}` answers; anything else is a failure. */",
        "export interface StopAnswer {",
        "  answer: StopAnswerWord;",
        "  /** a short text saying why, when the relay gives one */",
        "  reason?: string;",
        "}",
        "",
    ]


def _pane_state_declarations() -> list[str]:
    """The vector format of the pane state (``tests/vectors/README.md``)."""
    return [
        "/** A pane's mode: `replay` from a join until its answer, `live` otherwise. */",
        f"export type PaneMode = {_union(get_args(PaneMode))};",
        "",
        "/** A pane's status (`PaneStore.state()` in renderer.js; kernel_ext.viewing.view). */",
        f"export type PaneStatus = {_union(get_args(PaneStatus))};",
        "",
        "/** One rendered block of a task in the pane state. */",
        "export type PaneItem =",
        '  | { kind: "thinking"; seq: number; text: string; folded: true }',
        '  | { kind: "tool_call"; seq: number; tool: string | null }',
        '  | { kind: "text" | "tool_output_append"; seq: number; text: string }',
        "  | {",
        '      kind: "progress";',
        "      seq: number;",
        "      progress: number | null;",
        "      total: number | null;",
        "      text: string | null;",
        "    }",
        '  | { kind: "other"; envelopeKind: string; seq: number; text: string | null };',
        "",
        "/** A pinned final answer. */",
        "export interface PaneFinal {",
        '  from: "done" | "aborted" | "toolReturn";',
        "  taskId: string | null;",
        "  text: string;",
        "}",
        "",
        "/** One stream of a pane: one taskId of its call. */",
        "export interface PaneTask {",
        "  taskId: string;",
        "  ended: boolean;",
        '  outcome: "done" | "aborted" | null;',
        "  final: string | null;",
        "  /** blocks the relay could no longer send (its join answers' `replay.missing`) */",
        "  missing: number;",
        "  items: PaneItem[];",
        "}",
        "",
        "/** The detail pane of one tool call. */",
        "export interface PaneState {",
        "  callId: string;",
        "  /** the call's trace id, from the first block that carried a valid one */",
        "  traceId: string | null;",
        "  mode: PaneMode;",
        "  tool: string | null;",
        "  status: PaneStatus;",
        "  returned: boolean;",
        "  final: PaneFinal | null;",
        "  tasks: PaneTask[];",
        "}",
        "",
        "/** The final answer of a call without a callId. */",
        "export interface OrphanState {",
        "  taskId: string;",
        '  outcome: "done" | "aborted";',
        "  text: string;",
        "}",
        "",
        "/** A room's panes: `PaneStore.state()`, the conformance vectors' format. */",
        "export interface PaneStoreState {",
        "  panes: PaneState[];",
        "  orphans: OrphanState[];",
        "  /** inputs that changed nothing, by reason */",
        "  dropped: {",
        *(f"    {reason}: number;" for reason in DROP_REASONS),
        "  };",
        "}",
    ]
