"""Test helpers for the shipped example page in Chromium, not playing its script
(``?play=0``): blocks and snapshots fed to its ``window.kx.store`` in order, a call's pane,
and the CJK faces its font stack falls back to. Its fixtures (the served page, the browser,
a fresh page) are tests/web/conftest.py's."""

from __future__ import annotations

from typing import Any

WAIT_MS = 10_000
"""How long a Playwright wait on the page lasts, in ms."""
CALL = "00f067aa0ba902b7"

FEED = """(steps) => {
  for (const step of steps) {
    if ("block" in step) window.kx.store.applyBlock(step.block);
    else if ("snapshot" in step) window.kx.store.applySnapshot(step.snapshot);
  }
}"""


def block(
    seq: int,
    kind: str,
    payload: dict[str, Any],
    *,
    state: str = "running",
    call_id: str = CALL,
    task_id: str = "task-1",
) -> dict[str, Any]:
    return {
        "block": {
            "v": 1,
            "callId": call_id,
            "taskId": task_id,
            "state": state,
            "ts": 1,
            "envelope": {
                "v": 1,
                "kind": kind,
                "streamKey": task_id,
                "seq": seq,
                "status": state,
                "payload": payload,
            },
        }
    }


def snapshot(call_id: str = CALL, **content: Any) -> dict[str, Any]:
    content.setdefault("toolCall", {"functionCall": {"name": "ask_colleague"}})
    return {"snapshot": {"eventId": call_id, "eventScene": "tool", "content": content}}


def feed(page: Any, *steps: dict[str, Any]) -> None:
    page.evaluate(FEED, list(steps))


def pane(page: Any, call_id: str = CALL) -> Any:
    return page.locator(f"section.kx-pane[data-call-id='{call_id}']")


CJK_FACES = ("PingFang SC", "Microsoft YaHei", "Noto Sans CJK SC", "Source Han Sans SC")
"""Common CJK faces (macOS, Windows, Linux) the font stack falls back to."""
