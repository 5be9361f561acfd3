"""Test helpers for the wire protocol: a valid wire block to change one field of, and a
payload nested to a given depth."""

from __future__ import annotations

from typing import Any

CALL_ID = "00f067aa0ba902b7"


def wire_block(**overrides: Any) -> dict[str, Any]:
    """A valid running ``thinking`` block on the wire, with ``overrides`` (``envelope``: a
    mapping of envelope fields to change, or anything else to stand for the envelope)."""
    envelope = {
        "v": 1,
        "kind": "thinking",
        "streamKey": "task-1",
        "seq": 1,
        "status": "running",
        "payload": {"text": "hmm"},
    }
    envelope_override = overrides.pop("envelope", {})
    if not isinstance(envelope_override, dict):
        overrides["envelope"] = envelope_override
    else:
        envelope.update(envelope_override)
    block = {
        "v": 1,
        "callId": CALL_ID,
        "taskId": "task-1",
        "state": "running",
        "ts": 1789123456789,
        "envelope": envelope,
    }
    block.update(overrides)
    return block


def nested(depth: int) -> Any:
    """A value ``depth`` mappings deep."""
    value: Any = "leaf"
    for _ in range(depth):
        value = {"n": value}
    return value
