"""Every conformance vector in tests/vectors through the Python pane reducer
(kernel_ext.viewing.view).

The same files are run through web/renderer.js by tests/js/renderer.test.mjs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import TESTS
from support.relay_helpers import block as text_block
from support.vectors import VECTOR_FILES, expand, load

from kernel_ext.viewing.view import (
    LABELS,
    MAX_JOIN_STREAMS,
    PaneStore,
    labels_for,
    missing_text,
    trace_url,
)

REQUIRED = {
    "in_order",
    "trace_id",
    "out_of_order",
    "duplicate_seq",
    "blocks_before_snapshot",
    "two_tasks",
    "interleaved_calls",
    "terminal_done",
    "aborted",
    "no_blocks_timeout",
    "returned_without_blocks",
    "null_call_id",
    "unknown_kind",
    "tool_output_append",
    "huge_text",
    "html_text",
    "invalid_input",
    "progress",
    "replay_then_live",
    "reconnect_cursors",
    "hostile_ack",
}
STEP_KINDS = {"block", "snapshot", "tick", "join", "ack", "expect"}


def run_vector(vector: dict[str, Any]) -> tuple[PaneStore, list[tuple[int, Any]]]:
    """Apply the steps; return the store and, at each checkpoint, the step index and what
    it compares: the state for ``expect``, ``{"have": cursors}`` for ``join``."""
    now = 0.0

    def clock() -> float:
        return now

    store = PaneStore(timeout_ms=vector["options"]["timeoutMs"], clock=clock)
    checkpoints: list[tuple[int, Any]] = []
    for index, step in enumerate(vector["steps"]):
        (key,) = step.keys()
        if key == "block":
            store.apply_block(step["block"])
        elif key == "snapshot":
            store.apply_snapshot(step["snapshot"])
        elif key == "tick":
            now = max(now, float(step["tick"]))
            store.tick(now)
        elif key == "join":
            checkpoints.append((index, {"have": store.begin_replay()}))
        elif key == "ack":
            store.end_replay(step["ack"])
        elif key == "expect":
            checkpoints.append((index, store.state()))
        else:
            raise AssertionError(f"unknown step kind {key!r} at step {index}")
    return store, checkpoints


def test_vector_macros_expand_in_inputs() -> None:
    assert expand({"$concat": ["a", {"$repeat": "b", "times": 3}]}) == "abbb"


def test_vector_set_covers_every_required_case() -> None:
    names = {path.stem for path in VECTOR_FILES}
    assert names >= REQUIRED, f"missing vectors: {sorted(REQUIRED - names)}"


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_vector_file_is_well_formed(path: Path) -> None:
    vector = load(path)
    assert vector["name"] == path.stem
    assert vector["description"].strip()
    assert set(vector) == {"name", "description", "options", "steps", "expect"}
    for step in vector["steps"]:
        assert len(step) == 1
        assert next(iter(step)) in STEP_KINDS


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_python_view_reproduces_vector(path: Path) -> None:
    vector = load(path)
    store, checkpoints = run_vector(vector)
    for index, seen in checkpoints:
        step = vector["steps"][index]
        assert seen == step.get("expect", step.get("join")), f"checkpoint at step {index}"
    assert store.state() == vector["expect"]


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_state_is_plain_json_with_integer_seqs(path: Path) -> None:
    store, _ = run_vector(load(path))
    state = store.state()
    # A round trip through JSON changes nothing, and every seq is an int (3.0 in → 3 out).
    assert json.loads(json.dumps(state)) == state
    for pane in state["panes"]:
        for task in pane["tasks"]:
            assert all(type(item["seq"]) is int for item in task["items"])


def test_labels_default_to_chinese_with_english_available() -> None:
    assert labels_for()["thinking"] == "思考中…"
    assert labels_for()["ended"] == "已结束"
    assert labels_for()["noDetails"] == "无过程详情"
    assert labels_for("en")["ended"] == "Ended"
    assert labels_for("xx") == LABELS["zh"]
    assert set(LABELS["zh"]) == set(LABELS["en"])


def test_store_rejects_bad_construction_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_ms"):
        PaneStore(timeout_ms=-1)
    with pytest.raises(ValueError, match="max_panes"):
        PaneStore(max_panes=0)


def test_max_panes_forgets_the_oldest_ended_pane_first() -> None:
    store = PaneStore(max_panes=2)

    def block(call_id: str, state: str = "running") -> dict[str, Any]:
        key = "text" if state != "aborted" else "message"
        return {
            "v": 1,
            "callId": call_id,
            "taskId": "t",
            "state": state,
            "ts": 0,
            "envelope": {"kind": "text", "seq": 1, "payload": {key: "x"}},
        }

    store.apply_block(block("aaaaaaaaaaaaaaaa"))
    store.apply_block(block("bbbbbbbbbbbbbbbb", "done"))
    store.apply_block(block("cccccccccccccccc"))
    assert [pane.call_id for pane in store.panes] == ["aaaaaaaaaaaaaaaa", "cccccccccccccccc"]
    store.apply_block(block("dddddddddddddddd"))
    assert [pane.call_id for pane in store.panes] == ["cccccccccccccccc", "dddddddddddddddd"]


# -- catch-up (docs/web.md "Catching up") ------------------------------------------------


A = "00f067aa0ba902b7"


def test_end_replay_returns_what_changed_missing_first_then_modes() -> None:
    store = PaneStore()
    store.apply_block(text_block(1, call_id=A, task_id="t"))
    assert store.begin_replay() == [{"callId": A, "taskId": "t", "seq": 1}]
    assert store.replaying
    store.apply_block(text_block(1, call_id="a1b2c3d4e5f60718", task_id="u"))
    assert [pane.mode for pane in store.panes] == ["replay", "replay"]
    changed = store.end_replay(
        {"ok": True, "replay": {"missing": [{"callId": A, "taskId": "t", "blocks": 2}]}}
    )
    assert not store.replaying
    assert [(a.outcome, a.call_id, a.task_id) for a in changed] == [
        ("missing", A, "t"),
        ("mode", A, None),
        ("mode", "a1b2c3d4e5f60718", None),
    ]
    assert store.end_replay({"ok": True}) == []  # nothing left to change


def test_have_names_at_most_max_join_streams_streams_the_open_ones_first() -> None:
    assert MAX_JOIN_STREAMS == 1_000
    store = PaneStore()
    store.apply_block(text_block(3, call_id="0000000000000000", task_id="ended", state="done"))
    for index in range(MAX_JOIN_STREAMS):
        store.apply_block(text_block(index, call_id=A, task_id=f"t{index}"))
    store.apply_block(text_block(2, call_id=None, task_id="orphan", state="done"))
    have = store.have()
    assert len(have) == MAX_JOIN_STREAMS
    assert have[0] == {"callId": A, "taskId": "t0", "seq": 0}
    assert {cursor["taskId"] for cursor in have}.isdisjoint({"ended", "orphan"})
    fewer = PaneStore()
    fewer.apply_block(text_block(3, call_id="0000000000000000", task_id="ended", state="done"))
    for index in range(MAX_JOIN_STREAMS - 1):
        fewer.apply_block(text_block(index, call_id=A, task_id=f"t{index}"))
    fewer.apply_block(text_block(2, call_id=None, task_id="orphan", state="done"))
    assert fewer.have()[-1] == {
        "callId": "0000000000000000",
        "taskId": "ended",
        "seq": 3,
        "ended": True,
    }


def test_an_acks_missing_list_is_read_up_to_the_bound_the_rest_counted() -> None:
    store = PaneStore()
    store.apply_block(text_block(1, call_id=A, task_id="t"))
    entry = {"callId": A, "taskId": "t", "blocks": 1}
    store.end_replay({"ok": True, "replay": {"missing": [entry] * MAX_JOIN_STREAMS}})
    assert store.panes[0].tasks["t"].missing == MAX_JOIN_STREAMS
    assert store.dropped["ignoredAck"] == 0
    store.end_replay({"ok": True, "replay": {"missing": [entry] * (MAX_JOIN_STREAMS + 1)}})
    assert store.panes[0].tasks["t"].missing == 2 * MAX_JOIN_STREAMS
    assert store.dropped["ignoredAck"] == 1
    store.end_replay({"ok": True, "replay": {"missing": [None] * 10_000_000}})
    assert store.dropped["ignoredAck"] == 1 + 10_000_000


def test_missing_for_a_pane_the_store_forgot_is_counted_not_applied() -> None:
    store = PaneStore(max_panes=1)
    store.apply_block(text_block(1, call_id=A, task_id="t"))
    store.apply_block(text_block(1, call_id="a1b2c3d4e5f60718", task_id="u"))  # forgets A
    store.end_replay(
        {"ok": True, "replay": {"missing": [{"callId": A, "taskId": "t", "blocks": 3}]}}
    )
    assert store.dropped["ignoredAck"] == 1
    assert [pane.call_id for pane in store.panes] == ["a1b2c3d4e5f60718"]


def test_the_missing_notice_words_singular_and_plural() -> None:
    assert missing_text(LABELS["en"], 1) == "1 earlier block is no longer available"
    assert missing_text(LABELS["en"], 12) == "12 earlier blocks are no longer available"
    assert missing_text(LABELS["zh"], 12) == "12 条较早的内容已不可用"


TRACE_URL_CASES = json.loads((TESTS / "js" / "trace_urls.json").read_text(encoding="utf-8"))[
    "cases"
]


@pytest.mark.parametrize("case", TRACE_URL_CASES, ids=[c["name"] for c in TRACE_URL_CASES])
def test_trace_url_links_as_the_browser_renderer_does(case: dict[str, Any]) -> None:
    # The same cases as renderer.js's traceUrl (tests/js/renderer.test.mjs).
    assert trace_url(case["template"], case["traceId"], case["spanId"]) == case["href"]
