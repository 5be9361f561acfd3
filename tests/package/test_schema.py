"""The JSON Schema of a block (``kernel-ext schema``) is standard draft 2020-12 and agrees
with the protocol's decoder, checked with the ``jsonschema`` package; the TypeScript
declarations shipped for front-end code are the ones the models generate.

The oracle is :func:`kernel_ext.protocol.decode`: every block of every conformance vector
and every invalid case of the protocol is valid against the schema exactly when ``decode``
accepts it, except the rules JSON Schema cannot express
(:data:`kernel_ext.protocol.schema.NOT_EXPRESSIBLE`), whose cases are listed here one by one.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from jsonschema_specifications import REGISTRY
from support.protocol_helpers import CALL_ID, nested, wire_block
from support.vectors import VECTOR_FILES, load

from kernel_ext.errors import BlockTooLargeError, DecodeError
from kernel_ext.protocol import DEFAULT_MAX_BLOCK_BYTES, MAX_PAYLOAD_DEPTH, decode
from kernel_ext.protocol.schema import DRAFT, NOT_EXPRESSIBLE, block_json_schema
from kernel_ext.viewing.view import DROP_REASONS
from kernel_ext.web import DECLARATIONS, asset_path
from kernel_ext.web.typescript import declarations

SCHEMA = block_json_schema()
REPLAY_ANSWER = {
    "ok": True,
    "replay": {
        "blocks": 2,
        "streams": 1,
        "missing": [{"callId": None, "taskId": "t", "blocks": 1}],
    },
}
VALIDATOR = Draft202012Validator(SCHEMA)


def _vocabulary() -> frozenset[str]:
    """Every keyword of draft 2020-12: the properties of the meta-schemas of its vocabularies."""
    words: set[str] = set()
    for part in Draft202012Validator.META_SCHEMA["allOf"]:
        meta = REGISTRY.contents(f"https://json-schema.org/draft/2020-12/{part['$ref']}")
        words |= set(meta["properties"])
    return frozenset(words)


VOCABULARY = _vocabulary()
# Where a keyword's value is a schema, a list of schemas or a map of name -> schema (the
# applicator and unevaluated vocabularies, core's $defs, content's contentSchema).
ONE_SCHEMA = {"additionalProperties", "contains", "contentSchema", "else", "if", "items", "not"}
ONE_SCHEMA |= {"propertyNames", "then", "unevaluatedItems", "unevaluatedProperties"}
SCHEMA_LIST = {"allOf", "anyOf", "oneOf", "prefixItems"}
SCHEMA_MAP = {"$defs", "properties", "patternProperties", "dependentSchemas"}


def keywords(schema: Any, where: str = "#") -> Iterator[tuple[str, str]]:
    """Each ``(path, keyword)`` of ``schema`` and its subschemas (not the names of
    properties, nor the values of ``const``, ``enum``, ``default``, ``examples``)."""
    if isinstance(schema, bool):
        return
    assert isinstance(schema, dict), where
    for key, value in schema.items():
        yield where, key
        if key in ONE_SCHEMA:
            yield from keywords(value, f"{where}/{key}")
        elif key in SCHEMA_LIST:
            for index, item in enumerate(value):
                yield from keywords(item, f"{where}/{key}/{index}")
        elif key in SCHEMA_MAP:
            for name, item in value.items():
                yield from keywords(item, f"{where}/{key}/{name}")


def accepts(block: Any) -> bool:
    try:
        decode(block)
    except DecodeError:
        return False
    return True


# -- standard JSON Schema ----------------------------------------------------------------


def test_the_schema_declares_draft_2020_12_and_is_a_valid_schema() -> None:
    assert SCHEMA["$schema"] == DRAFT == Draft202012Validator.META_SCHEMA["$id"]
    Draft202012Validator.check_schema(SCHEMA)


def test_the_schema_uses_only_keywords_of_draft_2020_12() -> None:
    found = list(keywords(SCHEMA))
    assert ("#/$defs/Envelope/properties/seq", "minimum") in found  # the walk reaches seq
    unknown = sorted({f"{path}: {word}" for path, word in found if word not in VOCABULARY})
    assert unknown == []


def test_the_keyword_check_catches_a_pydantic_keyword() -> None:
    leaked = {"properties": {"seq": {"type": "integer", "ge": 0}}}
    assert [word for _, word in keywords(leaked) if word not in VOCABULARY] == ["ge"]


def test_a_negative_seq_is_invalid() -> None:  # issue 15: "ge" let seq -5 through
    block = wire_block(envelope={"seq": -5})
    assert not VALIDATOR.is_valid(block)
    assert not accepts(block)


def test_the_schema_names_what_it_cannot_express() -> None:
    for rule in NOT_EXPRESSIBLE:
        assert rule in SCHEMA["description"]


def test_kernel_ext_schema_prints_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kernel_ext.cli.entry", "schema"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert json.loads(out) == SCHEMA


# -- the vectors and the protocol's cases ------------------------------------------------

# Vector blocks decode refuses for a rule JSON Schema cannot express (NOT_EXPRESSIBLE).
VECTOR_EXCEPTIONS = {("huge_text", 3): "over the size bound"}


def vector_blocks() -> Iterator[tuple[str, int, Any]]:
    for path in VECTOR_FILES:
        for index, step in enumerate(load(path)["steps"]):
            if "block" in step:
                yield path.stem, index, step["block"]


VECTOR_BLOCKS = list(vector_blocks())


@pytest.mark.parametrize(
    ("vector", "step", "block"), VECTOR_BLOCKS, ids=[f"{v}-{s}" for v, s, _ in VECTOR_BLOCKS]
)
def test_every_vector_block_is_valid_exactly_when_the_protocol_accepts_it(
    vector: str, step: int, block: Any
) -> None:
    if (vector, step) in VECTOR_EXCEPTIONS:
        with pytest.raises(BlockTooLargeError):
            decode(block)
        assert VALIDATOR.is_valid(block)
        return
    assert VALIDATOR.is_valid(block) == accepts(block)


def test_the_vectors_hold_valid_and_invalid_blocks() -> None:
    valid = [block for *_, block in VECTOR_BLOCKS if accepts(block)]
    assert len(valid) >= 40
    assert len(VECTOR_BLOCKS) - len(valid) >= 10
    assert set(VECTOR_EXCEPTIONS) <= {(v, s) for v, s, _ in VECTOR_BLOCKS}


def _without(field: str) -> dict[str, Any]:
    block = wire_block()
    del block[field]
    return block


def _without_envelope(field: str) -> dict[str, Any]:
    block = wire_block()
    del block["envelope"][field]
    return block


def _terminal(state: str, payload: Any) -> dict[str, Any]:
    return wire_block(state=state, envelope={"payload": payload, "status": state})


VALID = {
    "running": wire_block(),
    "done": _terminal("done", {"text": "the answer"}),
    "aborted": _terminal("aborted", {"message": "gone"}),
    "null callId": wire_block(callId=None),
    "unknown kind and envelope fields": wire_block(envelope={"kind": "x-new", "extra": [1]}),
    "no envelope v, no payload": _without_envelope("payload"),
    "integral float seq": wire_block(envelope={"seq": 3.0}),
    "integral float v": wire_block(v=1.0),
    f"payload nested {MAX_PAYLOAD_DEPTH} levels": wire_block(
        envelope={"payload": nested(MAX_PAYLOAD_DEPTH)}
    ),
}

INVALID: dict[str, Any] = {
    **{f"no {field}": _without(field) for field in ("v", "callId", "taskId", "state", "ts")},
    "no envelope": _without("envelope"),
    **{f"no envelope.{f}": _without_envelope(f) for f in ("kind", "streamKey", "seq", "status")},
    "ts a string": wire_block(ts="now"),
    "ts 1.5": wire_block(ts=1.5),
    "ts -1": wire_block(ts=-1),
    "ts true": wire_block(ts=True),
    "taskId a number": wire_block(taskId=5),
    "taskId empty": wire_block(taskId=""),
    "taskId 513 characters": wire_block(taskId="t" * 513),
    "v 2": wire_block(v=2),
    "envelope a string": wire_block(envelope="text"),
    "state paused": wire_block(state="paused"),
    "an unknown block field": wire_block(extra=1),
    **{
        f"seq {json.dumps(seq)}": wire_block(envelope={"seq": seq})
        for seq in (1.5, -1, -1.0, -5, True, False, "3", None)
    },
    **{
        f"callId {json.dumps(call_id)}": wire_block(callId=call_id)
        for call_id in (CALL_ID.upper(), "123", "g" + CALL_ID[1:], 12, "")
    },
    "envelope.kind empty": wire_block(envelope={"kind": ""}),
    "envelope.kind 65 characters": wire_block(envelope={"kind": "k" * 65}),
    "envelope.streamKey 513 characters": wire_block(envelope={"streamKey": "s" * 513}),
    "envelope.status 65 characters": wire_block(envelope={"status": "s" * 65}),
    "envelope.v 0": wire_block(envelope={"v": 0}),
    "envelope.payload a list": wire_block(envelope={"payload": ["x"]}),
    "done without text": _terminal("done", {"message": "m"}),
    "done with a number": _terminal("done", {"text": 5}),
    "done without payload": wire_block(state="done", envelope={"payload": None}),
    "aborted without message": _terminal("aborted", {"text": "t"}),
    "aborted with a list": _terminal("aborted", {"message": ["m"]}),
    **{f"a JSON {type(v).__name__}": v for v in (None, [wire_block()], "block", 42)},
}

# decode refuses these for a rule of NOT_EXPRESSIBLE; a JSON Schema validator accepts them.
NOT_EXPRESSIBLE_CASES = {
    "size bound": wire_block(envelope={"payload": {"text": "x" * DEFAULT_MAX_BLOCK_BYTES}}),
    "nested too deeply": wire_block(envelope={"payload": nested(MAX_PAYLOAD_DEPTH + 1)}),
    "a number a double cannot hold": json.loads(json.dumps(wire_block()).replace('"hmm"', "1e999")),
    "ts 1.0": wire_block(ts=1.0),
    "envelope.v 1.0": wire_block(envelope={"v": 1.0}),
}


@pytest.mark.parametrize("name", VALID)
def test_a_valid_block_is_valid(name: str) -> None:
    assert accepts(VALID[name])
    VALIDATOR.validate(VALID[name])


@pytest.mark.parametrize("name", INVALID)
def test_each_invalid_case_of_the_protocol_is_invalid(name: str) -> None:
    assert not accepts(INVALID[name])
    assert not VALIDATOR.is_valid(INVALID[name])


@pytest.mark.parametrize("name", NOT_EXPRESSIBLE_CASES)
def test_what_json_schema_cannot_express_is_left_to_the_decoder(name: str) -> None:
    """Each case here is a rule of NOT_EXPRESSIBLE: decode refuses it, the schema cannot.
    (A schema that learns to refuse one fails this test: move the case to INVALID.)"""
    assert not accepts(NOT_EXPRESSIBLE_CASES[name])
    assert VALIDATOR.is_valid(NOT_EXPRESSIBLE_CASES[name])


# -- TypeScript declarations --------------------------------------------------------------


def test_the_shipped_typescript_declarations_are_the_generated_ones() -> None:
    shipped = asset_path(DECLARATIONS).read_text(encoding="utf-8")
    assert shipped == declarations(), (
        "kernel_ext/web/tool_event_stream.d.ts is stale: regenerate it with "
        "`kernel-ext schema --typescript > kernel_ext/web/tool_event_stream.d.ts`"
    )


def test_kernel_ext_schema_typescript_prints_them() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kernel_ext.cli.entry", "schema", "--typescript"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out == declarations()


_STATEMENT = re.compile(
    r"export (?:interface [A-Za-z]\w*(?: extends [A-Za-z]\w*)? \{|type [A-Za-z]\w* =)"
)


def _top_level_statements(text: str) -> list[str]:
    """The top-level statements of a declaration file, comments removed; fails on a
    bracket that does not close, a string that does not end, or a comment left open."""
    code = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL))
    assert "/*" not in code
    assert "*/" not in code
    closing = {"}": "{", ")": "(", "]": "[", ">": "<"}
    statements: list[str] = []
    stack: list[str] = []
    start = index = 0
    while index < len(code):
        char = code[index]
        if char == '"':
            index = code.index('"', index + 1) + 1  # ValueError: a string that does not end
            continue
        if char in "{([<":
            stack.append(char)
        elif char in closing and code[index - 1 : index + 1] != "=>":
            assert stack, f"{char!r} closes nothing at {index}"
            assert stack.pop() == closing[char], f"unbalanced {char!r} at {index}"
        statement = code[start : index + 1].strip()
        ends = char == ";" or (char == "}" and statement.startswith("export interface"))
        if not stack and ends:
            statements.append(" ".join(statement.split()))
            start = index + 1
        index += 1
    assert not stack, f"{stack} left open"
    assert not code[start:].strip(), "text after the last statement"
    return statements


def test_the_declarations_are_well_formed_typescript_statements() -> None:
    statements = _top_level_statements(asset_path(DECLARATIONS).read_text(encoding="utf-8"))
    assert all(_STATEMENT.match(each) for each in statements), statements
    names = {re.split(r"[ <=]", each.split(" ", 2)[2], maxsplit=1)[0] for each in statements}
    assert {"Block", "Envelope", "ToolEventStreamBlock", "ServerToClientEvents"} <= names
    assert {"ThinkingPayload", "ToolCallPayload", "DonePayload", "AbortedPayload"} <= names
    assert {"JoinRequest", "StreamCursor", "JoinAnswer", "Replay", "MissingBlocks"} <= names
    assert {"PaneMode", "PaneState", "PaneTask", "PaneStoreState"} <= names


def _members(name: str) -> set[str]:
    """The member names of the declared interface ``name``, an inline object's excluded."""
    text = asset_path(DECLARATIONS).read_text(encoding="utf-8")
    body = text.split(f"export interface {name} {{\n", 1)[1].split("\n}\n", 1)[0]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.DOTALL)
    return set(re.findall(r"^  (\w+)\??:", body, flags=re.MULTILINE))


def test_the_declared_pane_state_has_the_keys_of_the_reducers_state() -> None:
    """Every key of the vectors' states, at each level, is declared, and nothing else."""
    states = [load(path)["expect"] for path in VECTOR_FILES]
    panes = [pane for state in states for pane in state["panes"]]
    tasks = [task for pane in panes for task in pane["tasks"]]
    orphans = [orphan for state in states for orphan in state["orphans"]]
    assert _members("PaneStoreState") == {key for state in states for key in state}
    assert _members("PaneState") == {key for pane in panes for key in pane}
    assert _members("PaneTask") == {key for task in tasks for key in task}
    assert _members("OrphanState") == {key for orphan in orphans for key in orphan}
    assert _members("PaneFinal") == {
        key for pane in panes if pane["final"] for key in pane["final"]
    }
    assert {key for state in states for key in state["dropped"]} == set(DROP_REASONS)
    assert all(f"    {reason}: number;" in declarations() for reason in DROP_REASONS)


@pytest.mark.skipif(shutil.which("tsc") is None, reason="no TypeScript compiler (tsc) on PATH")
def test_the_declarations_type_check_with_tsc(tmp_path: Path) -> None:
    """With a TypeScript compiler at hand: the file compiles under --strict, every valid
    vector block is a ``ToolEventStreamBlock``, every vector state a ``PaneStoreState``,
    every join's ``have`` fits a ``JoinRequest``; a done block without text, a pane in an
    unknown mode and a cursor without a seq do not."""
    (tmp_path / DECLARATIONS).write_text(declarations(), encoding="utf-8")
    vectors = [load(path) for path in VECTOR_FILES]
    valid = [block for *_, block in VECTOR_BLOCKS if accepts(block)]
    names = "DoneBlock, JoinAnswer, JoinRequest, PaneState, PaneStoreState, ToolEventStreamBlock"
    head = f'import type {{ {names} }} from "./tool_event_stream";'
    lines = [head]
    lines += [
        f"export const b{i}: ToolEventStreamBlock = {json.dumps(b)};" for i, b in enumerate(valid)
    ]
    lines += [
        f"export const s{i}: PaneStoreState = {json.dumps(v['expect'])};"
        for i, v in enumerate(vectors)
    ]
    joins = [
        {"conversationId": "c", **step["join"]}
        for v in vectors
        for step in v["steps"]
        if "join" in step
    ]
    lines += [
        f"export const j{i}: JoinRequest = {json.dumps(join)};" for i, join in enumerate(joins)
    ]
    answers = [{"ok": True}, {"ok": False, "error": "forbidden"}, REPLAY_ANSWER]
    lines += [f"export const a{i}: JoinAnswer = {json.dumps(a)};" for i, a in enumerate(answers)]
    good = tmp_path / "good.ts"
    good.write_text("\n".join(lines) + "\n", encoding="utf-8")
    pane = {**vectors[0]["expect"]["panes"][0], "mode": "paused"}
    done = _terminal("done", {"message": "no text"})
    bad = {
        "'text' is missing": f"export const bad: DoneBlock = {json.dumps(done)};",
        '"paused"': f"export const bad: PaneState = {json.dumps(pane)};",
        "'seq' is missing": 'export const bad: JoinRequest = {conversationId: "c", have: '
        '[{callId: null, taskId: "t"}]};',
    }
    tsc = [str(shutil.which("tsc")), "--noEmit", "--strict"]
    run = subprocess.run([*tsc, str(good)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for index, (expected, line) in enumerate(bad.items()):
        path = tmp_path / f"bad{index}.ts"
        path.write_text(f"{head}\n{line}\n", encoding="utf-8")
        run = subprocess.run([*tsc, str(path)], capture_output=True, text=True, timeout=120)
        assert run.returncode != 0, line
        assert expected in run.stdout, run.stdout + run.stderr
