"""Every conformance vector in tests/vectors through the Python pane reducer (kernel_ext.view).

The same files are run through web/renderer.js by tests/js/renderer.test.mjs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kernel_ext.view import LABELS, PaneStore, labels_for

VECTORS = Path(__file__).parent / "vectors"
VECTOR_FILES = sorted(VECTORS.glob("*.json"))
REQUIRED = {
    "in_order",
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
}


def expand(value: Any) -> Any:
    """Expand the vectors' string macros ($repeat, $concat) everywhere in ``value``."""
    if isinstance(value, list):
        return [expand(item) for item in value]
    if isinstance(value, dict):
        if set(value) == {"$repeat", "times"}:
            return str(value["$repeat"]) * int(value["times"])
        if set(value) == {"$concat"}:
            return "".join(expand(part) for part in value["$concat"])
        return {key: expand(item) for key, item in value.items()}
    return value


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = expand(json.loads(path.read_text(encoding="utf-8")))
    return data


def run_vector(vector: dict[str, Any]) -> tuple[PaneStore, list[tuple[int, dict[str, Any]]]]:
    """Apply the steps; return the store and the (step index, state) at each checkpoint."""
    now = 0.0

    def clock() -> float:
        return now

    store = PaneStore(timeout_ms=vector["options"]["timeoutMs"], clock=clock)
    checkpoints: list[tuple[int, dict[str, Any]]] = []
    for index, step in enumerate(vector["steps"]):
        (key,) = step.keys()
        if key == "block":
            store.apply_block(step["block"])
        elif key == "snapshot":
            store.apply_snapshot(step["snapshot"])
        elif key == "tick":
            now = max(now, float(step["tick"]))
            store.tick(now)
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
        assert next(iter(step)) in {"block", "snapshot", "tick", "expect"}


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_python_view_reproduces_vector(path: Path) -> None:
    vector = load(path)
    store, checkpoints = run_vector(vector)
    for index, state in checkpoints:
        assert state == vector["steps"][index]["expect"], f"checkpoint at step {index}"
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
