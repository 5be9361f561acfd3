"""The wire protocol: every rule of protocol.py, bad inputs, and round-trip properties."""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.protocol_helpers import CALL_ID, nested, wire_block

from kernel_ext import BlockTooLargeError, DecodeError, KernelExtError
from kernel_ext.protocol import (
    DEFAULT_MAX_BLOCK_BYTES,
    KNOWN_KINDS,
    MAX_PAYLOAD_DEPTH,
    Block,
    Envelope,
    block_size,
    decode,
    decode_envelope,
    encode,
    fallback_terminal,
    fits,
    pseudo_envelope,
    terminal_envelope,
    well_formed,
    well_formed_json,
)
from kernel_ext.protocol.schema import block_json_schema


def test_wire_names_are_the_specs_camel_case() -> None:
    block = decode(wire_block())
    assert json.loads(encode(block)) == wire_block()
    assert block.call_id == CALL_ID
    assert block.envelope.stream_key == "task-1"


def test_decode_accepts_text_bytes_and_mappings_alike() -> None:
    text = json.dumps(wire_block())
    assert decode(text) == decode(text.encode()) == decode(wire_block())


@pytest.mark.parametrize("state", ["running", "done", "aborted"])
def test_every_state_is_accepted_with_its_payload(state: str) -> None:
    payload = {"done": {"text": "answer"}, "aborted": {"message": "boom"}}.get(state, {})
    assert decode(wire_block(state=state, envelope={"payload": payload})).state == state


def test_unknown_state_is_rejected_naming_the_field() -> None:
    with pytest.raises(DecodeError) as info:
        decode(wire_block(state="finished"))
    assert info.value.field == "state"
    assert "'state'" in str(info.value)


def test_done_block_must_carry_the_final_answer_as_text() -> None:
    with pytest.raises(DecodeError, match=r"payload\.text"):
        decode(wire_block(state="done", envelope={"payload": {"message": "x"}}))
    with pytest.raises(DecodeError, match=r"payload\.text"):
        decode(wire_block(state="done", envelope={"payload": {"text": 42}}))


def test_aborted_block_must_carry_a_message_string() -> None:
    with pytest.raises(DecodeError, match=r"payload\.message"):
        decode(wire_block(state="aborted", envelope={"payload": {"text": "x"}}))


def test_call_id_may_be_null() -> None:
    assert decode(wire_block(callId=None)).call_id is None


@pytest.mark.parametrize("call_id", ["00F067AA0BA902B7", "123", "g0f067aa0ba902b7", 12, ""])
def test_call_id_must_be_sixteen_lower_case_hex_digits(call_id: object) -> None:
    with pytest.raises(DecodeError) as info:
        decode(wire_block(callId=call_id))
    assert info.value.field == "callId"


@pytest.mark.parametrize("kind", sorted(KNOWN_KINDS))
def test_known_kinds_are_known(kind: str) -> None:
    assert decode(wire_block(envelope={"kind": kind})).envelope.is_known_kind


def test_unknown_kind_and_unknown_envelope_fields_are_kept() -> None:
    data = wire_block(envelope={"kind": "hologram", "futureField": {"a": [1, 2]}})
    block = decode(data)
    assert block.envelope.kind == "hologram"
    assert not block.envelope.is_known_kind
    assert json.loads(encode(block))["envelope"]["futureField"] == {"a": [1, 2]}


def test_unknown_block_fields_are_rejected() -> None:
    with pytest.raises(DecodeError) as info:
        decode(wire_block(extra="x"))
    assert info.value.field == "extra"


def test_integral_float_seq_is_that_integer() -> None:
    block = decode(wire_block(envelope={"seq": 7.0}))
    assert block.envelope.seq == 7
    assert isinstance(block.envelope.seq, int)
    assert '"seq":7,' in encode(block)


@pytest.mark.parametrize("seq", [1.5, -1, -1.0, True, False, "3", None, math.inf, math.nan])
def test_bad_seq_is_rejected_naming_envelope_seq(seq: object) -> None:
    with pytest.raises(DecodeError) as info:
        decode(wire_block(envelope={"seq": seq}))
    assert info.value.field == "envelope.seq"


@pytest.mark.parametrize("field", ["v", "callId", "taskId", "state", "ts", "envelope"])
def test_missing_block_field_is_named(field: str) -> None:
    data = wire_block()
    del data[field]
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert info.value.field == field


@pytest.mark.parametrize("field", ["kind", "streamKey", "seq", "status"])
def test_missing_envelope_field_is_named(field: str) -> None:
    data = wire_block()
    del data["envelope"][field]
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert info.value.field == f"envelope.{field}"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ts", "now"),
        ("ts", 1.5),
        ("ts", -1),
        ("ts", True),
        ("taskId", 5),
        ("taskId", ""),
        ("v", 2),
        ("envelope", "text"),
    ],
)
def test_wrong_types_are_rejected(field: str, value: object) -> None:
    with pytest.raises(DecodeError) as info:
        decode(wire_block(**{field: value}))
    assert info.value.field is not None
    assert info.value.field.startswith(field)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_in_payload_are_rejected(literal: str) -> None:
    text = json.dumps(wire_block()).replace('"hmm"', literal)
    with pytest.raises(DecodeError, match="non-finite"):
        decode(text)


@pytest.mark.parametrize("data", ["{", "", "null", "[]", '"block"', "42", b"\xff\xfe"])
def test_non_json_or_non_object_input_is_a_decode_error(data: str | bytes) -> None:
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert info.value.field is None


def test_non_mapping_python_object_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="expected a JSON object"):
        decode([wire_block()])  # type: ignore[arg-type]


def test_payload_nested_up_to_the_limit_is_accepted() -> None:
    # payload itself is the first level
    block = decode(wire_block(envelope={"payload": nested(MAX_PAYLOAD_DEPTH)}))
    assert block.envelope.payload["n"]["n"]


@pytest.mark.parametrize("depth", [MAX_PAYLOAD_DEPTH + 1, 200, 5000])
def test_deeply_nested_payload_is_rejected(depth: int) -> None:
    with pytest.raises(DecodeError, match="nested"):
        decode(wire_block(envelope={"payload": nested(depth)}))
    text = "[" * depth + "]" * depth
    with pytest.raises(DecodeError):
        decode(
            '{"v":1,"callId":null,"taskId":"t","state":"running","ts":1,"envelope":' + text + "}"
        )


def test_oversized_input_is_rejected_by_decode_not_truncated() -> None:
    data = json.dumps(wire_block(envelope={"payload": {"text": "x" * DEFAULT_MAX_BLOCK_BYTES}}))
    with pytest.raises(BlockTooLargeError):
        decode(data)
    assert decode(data, max_bytes=2 * DEFAULT_MAX_BLOCK_BYTES).envelope.payload["text"]


def test_huge_payload_text_is_truncated_with_a_visible_marker() -> None:
    block = decode(
        wire_block(envelope={"payload": {"text": "é" * 100_000, "note": "keep"}}), max_bytes=10**7
    )
    encoded = encode(block)
    assert len(encoded.encode()) <= DEFAULT_MAX_BLOCK_BYTES
    payload = json.loads(encoded)["envelope"]["payload"]
    assert payload["note"] == "keep"
    assert payload["text"].startswith("éé")
    assert payload["text"].endswith("chars]")
    assert "…[truncated " in payload["text"]
    removed = int(payload["text"].rsplit("…[truncated ", 1)[1].split()[0])
    assert len(payload["text"]) - len(f"…[truncated {removed} chars]") + removed == 100_000
    # the truncated form is still a valid block
    assert decode(encoded).envelope.payload["note"] == "keep"


def test_final_answer_is_truncated_the_same_way_and_stays_a_done_block() -> None:
    block = Block(
        v=1,
        call_id=CALL_ID,
        task_id="t",
        state="done",
        ts=1,
        envelope=terminal_envelope("done", "t", 9, "a" * 200_000),
    )
    decoded = decode(encode(block, max_bytes=4096), max_bytes=4096)
    assert decoded.state == "done"
    assert decoded.envelope.payload["text"].endswith("chars]")


def test_block_whose_bulk_is_not_strings_is_rejected_with_a_clear_error() -> None:
    block = decode(
        wire_block(envelope={"payload": {"numbers": list(range(30_000))}}), max_bytes=10**7
    )
    with pytest.raises(BlockTooLargeError, match="over the bound"):
        encode(block)


def test_size_bound_is_configurable() -> None:
    block = decode(wire_block(envelope={"payload": {"text": "y" * 2000}}))
    assert len(encode(block, max_bytes=1000)) <= 1000
    assert len(encode(block)) > 2000


def test_pseudo_envelope_has_the_designed_shape() -> None:
    env = pseudo_envelope("task-9", 4, "working on it")
    assert env.model_dump(by_alias=True) == {
        "v": 1,
        "kind": "text",
        "streamKey": "task-9",
        "seq": 4,
        "status": "running",
        "payload": {"text": "working on it"},
    }


def test_terminal_envelopes_carry_text_or_message() -> None:
    assert terminal_envelope("done", "t", 1, "ok").payload == {"text": "ok"}
    assert terminal_envelope("aborted", "t", 1, "bad").payload == {"message": "bad"}


def test_decode_envelope_alone() -> None:
    env = decode_envelope(
        {"kind": "text", "streamKey": "s", "seq": 2.0, "status": "running", "payload": {}}
    )
    assert env.seq == 2
    assert env.v == 1
    with pytest.raises(DecodeError) as info:
        decode_envelope({"kind": "text", "streamKey": "s", "seq": -2, "status": "x"})
    assert info.value.field == "seq"


def test_errors_are_one_family() -> None:
    assert issubclass(DecodeError, KernelExtError)
    assert issubclass(BlockTooLargeError, DecodeError)


def test_models_are_immutable() -> None:
    block = decode(wire_block())
    with pytest.raises(Exception, match="frozen"):
        block.state = "done"  # type: ignore[misc]


def test_schema_describes_the_wire_names() -> None:
    schema = block_json_schema()
    assert set(schema["required"]) >= {"callId", "taskId", "state", "ts", "envelope"}
    assert schema["properties"]["state"]["enum"] == ["running", "done", "aborted"]
    envelope = schema["$defs"]["Envelope"]
    assert {"streamKey", "seq", "payload", "kind"} <= set(envelope["properties"])


# --- properties -------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@st.composite
def blocks(draw: st.DrawFn) -> Block:
    state = draw(st.sampled_from(["running", "done", "aborted"]))
    payload = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=5))
    if state == "done":
        payload["text"] = draw(texts)
    elif state == "aborted":
        payload["message"] = draw(texts)
    envelope = Envelope(
        v=draw(st.integers(min_value=1, max_value=3)),
        kind=draw(st.sampled_from([*sorted(KNOWN_KINDS), "future_kind"])),
        stream_key=draw(texts),
        seq=draw(st.integers(min_value=0, max_value=2**40)),
        status=draw(st.sampled_from(["running", "done", "aborted", "x"])),
        payload=payload,
    )
    return Block(
        v=1,
        call_id=draw(st.none() | st.from_regex(r"\A[0-9a-f]{16}\Z")),
        task_id=draw(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30)),
        state=state,
        ts=draw(st.integers(min_value=0, max_value=2**50)),
        envelope=envelope,
    )


@settings(max_examples=300, deadline=None)
@given(blocks())
def test_decode_inverts_encode_for_any_valid_block(block: Block) -> None:
    assert decode(encode(block)) == block


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_arbitrary_input_either_decodes_or_raises_decode_error(data: bytes | str) -> None:
    with contextlib.suppress(DecodeError):
        decode(data)


@settings(max_examples=100, deadline=None)
@given(blocks(), st.integers(min_value=600, max_value=5000))
def test_encode_never_exceeds_the_bound_or_raises_too_large(block: Block, bound: int) -> None:
    try:
        encoded = encode(block, max_bytes=bound)
    except BlockTooLargeError:
        return
    assert len(encoded.encode()) <= bound
    assert decode(encoded, max_bytes=bound).call_id == block.call_id


# -- the one size measure (issue: terminal edges, item 1) ---------------------------------


def _done_block(text: str, **payload: Any) -> dict[str, Any]:
    return wire_block(state="done", envelope={"payload": {"text": text, **payload}})


def test_block_size_is_the_utf8_length_of_the_compact_json() -> None:
    block = _done_block("中文 😀 \x01 \ud800")
    expected = json.dumps(block, ensure_ascii=False, separators=(",", ":"))
    assert block_size(block) == len(expected.encode("utf-8", "surrogatepass"))
    spaced = json.dumps(block, ensure_ascii=False)  # default separators: the old relay's
    assert block_size(block) < len(spaced.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("text", ["x" * 20_000, "中" * 20_000, "😀" * 20_000, "\x01" * 20_000])
def test_fits_agrees_with_block_size_on_every_alphabet(text: str) -> None:
    block = _done_block(text)
    size = block_size(block)
    assert fits(block, size)
    assert not fits(block, size - 1)


def test_decode_accepts_a_block_exactly_at_the_bound_and_refuses_one_byte_more() -> None:
    empty = _done_block("")
    at_bound = _done_block("y" * (4096 - block_size(empty)))
    assert block_size(at_bound) == 4096
    assert decode(at_bound, max_bytes=4096).state == "done"
    with pytest.raises(BlockTooLargeError):
        decode(at_bound, max_bytes=4095)
    text = json.dumps(at_bound, indent=4)  # whitespace does not count: the measure does
    assert decode(text, max_bytes=4096).state == "done"


@pytest.mark.parametrize(
    "text",
    [
        "a" * 30_000 + "😀" * 30_000,
        "😀" * 30_000 + "a" * 30_000,
        "\x01" * 70_000,
        "中文字符" * 10_000 + "abc" * 10_000,
    ],
)
def test_encode_cuts_any_mix_of_characters_to_the_bound_with_one_marker(text: str) -> None:
    block = decode(_done_block(text), max_bytes=10**7)
    encoded = encode(block, max_bytes=8192)
    wire = json.loads(encoded)
    assert block_size(wire) <= 8192
    cut = wire["envelope"]["payload"]["text"]
    assert cut.count("…[truncated") == 1
    kept, _, rest = cut.partition("…[truncated ")
    assert text.startswith(kept)
    assert int(rest.split()[0]) == len(text) - len(kept)
    # Cut again to a smaller bound: still one marker, counting everything cut.
    again = json.loads(encode(decode(wire), max_bytes=4096))["envelope"]["payload"]["text"]
    kept_again, _, rest_again = again.partition("…[truncated ")
    assert again.count("…[truncated") == 1
    assert text.startswith(kept_again)
    assert int(rest_again.split()[0]) == len(text) - len(kept_again)


def test_fallback_terminal_is_a_valid_short_block_for_any_task_id() -> None:
    # A lone surrogate too, also one left by cutting a surrogate pair at 512 characters.
    for task_id in ["t", "x" * 600, "", "t\ud800", "x" * 511 + "\ud83d\ude00"]:
        for state in ("done", "aborted"):
            wire = fallback_terminal("00f067aa0ba902b7", task_id, state, 1, 3, too_large=True)
            block = decode(wire)
            assert block.state == state
            assert block_size(wire) <= 2048  # fits any sane bound, even with a 512-char id


@pytest.mark.parametrize(
    ("field", "wire"),
    [
        ("taskId", wire_block(taskId="t\ud800")),
        ("envelope.kind", wire_block(envelope={"kind": "te\udfffxt"})),
        ("envelope.streamKey", wire_block(envelope={"streamKey": "s\ud800"})),
        ("envelope.status", wire_block(envelope={"status": "\udc00"})),
    ],
)
def test_a_lone_surrogate_is_refused_in_the_blocks_own_strings(
    field: str, wire: dict[str, Any]
) -> None:
    with pytest.raises(DecodeError) as info:
        decode(wire)
    assert info.value.field == field


def test_a_lone_surrogate_is_kept_in_payload_strings() -> None:
    payload = {"text": "before \ud800 after", "nested": [{"name": "look\udfffup"}]}
    block = decode(wire_block(envelope={"payload": payload}))
    assert block.envelope.payload == payload
    assert decode(encode(block)) == block


LONE_CASES = [
    ("before \ud800 after", "before \ufffd after"),  # a lone high surrogate
    ("\udfff", "\ufffd"),  # a lone low one
    ("\udc00\ud800", "\ufffd\ufffd"),  # low then high: two lone ones, not a pair
    ("a\ud83d\ude00b", "a\U0001f600b"),  # a pair: the character it stands for
    ("\ud800\ud83d\ude00\ud800", "\ufffd\U0001f600\ufffd"),
    ("\ufeff中文 é", "\ufeff中文 é"),  # no surrogate: unchanged
]


@pytest.mark.parametrize(("text", "expected"), LONE_CASES)
def test_well_formed_replaces_each_lone_surrogate_and_joins_a_pair_as_json_reads_it(
    text: str, expected: str
) -> None:
    assert well_formed(text) == expected
    # What a JSON parser makes of the same text escaped (json.dumps' ensure_ascii) agrees
    # wherever the parsed text is well formed.
    parsed = json.loads(json.dumps(text))
    if well_formed(parsed) == parsed:
        assert parsed == expected


@settings(max_examples=500, deadline=None)
@given(st.text())  # any code point, lone surrogates included
def test_well_formed_text_always_encodes_and_is_the_text_itself_when_it_already_did(
    text: str,
) -> None:
    result = well_formed(text)
    result.encode("utf-8")  # never raises
    assert well_formed(result) == result
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        assert result != text
    else:
        assert result is text


def test_well_formed_json_replaces_in_every_string_keys_included_and_leaves_the_input_alone() -> (
    None
):
    value = {"a": ["x", {"k\ud800": ("\udc00", 1, None, 2.5)}], "b": True}
    before = repr(value)
    assert well_formed_json(value) == {"a": ["x", {"k\ufffd": ["\ufffd", 1, None, 2.5]}], "b": True}
    assert repr(value) == before
    clean = {"a": ["é", {"中": (1,)}], "b": None}
    assert well_formed_json(clean) is clean
    assert well_formed_json("x\ud800") == "x\ufffd"
    assert well_formed_json(3) == 3


def test_well_formed_json_takes_any_depth() -> None:
    deep: list[Any] = ["\ud800"]
    for _ in range(5_000):
        deep = [deep]
    fixed = well_formed_json(deep)
    for _ in range(5_000):
        fixed = fixed[0]
    assert fixed == ["\ufffd"]
