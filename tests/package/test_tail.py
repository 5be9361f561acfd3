"""``kernel-ext tail``: the printer on its own, then the command against the real relay.

The relay (kernel_ext.relay) runs under uvicorn on 127.0.0.1; an internal sender pushes
``kx_chat_event`` and ``kx_blocks`` frames exactly as the worker does (docs/contracts.md).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import socketio
from support import ROOT
from support.network import flaky_network, free_port, serve_asgi
from support.relay_helpers import record_joins
from support.timing import wait_until
from support.vectors import VECTOR_FILES, load

from kernel_ext.protocol import block_size
from kernel_ext.viewing.tail import EXIT_FAILED, EXIT_INTERRUPTED, TailPrinter, clean, follow
from kernel_ext.viewing.view import PaneStore

CALL = "00f067aa0ba902b7"
CALL2 = "a1b2c3d4e5f60718"
SECRET = "internal-secret-for-tests"
TOKEN = "browser-token"
CONV = "conv-1"
WAIT = 15.0


def block(
    seq: int,
    kind: str,
    payload: Mapping[str, Any],
    *,
    state: str = "running",
    call_id: str | None = CALL,
    task_id: str = "task-1",
) -> dict[str, Any]:
    return {
        "v": 1,
        "callId": call_id,
        "taskId": task_id,
        "state": state,
        "ts": 1789123456789,
        "envelope": {
            "v": 1,
            "kind": kind,
            "streamKey": task_id,
            "seq": seq,
            "status": state,
            "payload": dict(payload),
        },
    }


def snapshot(call_id: str = CALL, **content: Any) -> dict[str, Any]:
    content.setdefault("toolCall", {"functionCall": {"name": "ask_colleague"}})
    return {"eventId": call_id, "eventScene": "tool", "conversationId": CONV, "content": content}


STORY = [
    block(1, "thinking", {"text": "The user asks about order 42."}),
    block(2, "thinking", {"text": "Check the order system."}),
    block(3, "tool_call", {"name": "search_orders", "args": {"q": "42"}}),
    block(4, "tool_output_append", {"text": "$ search_orders 42\nfound 1 order\n"}),
    block(5, "text", {"text": "Order 42 shipped on Monday."}),
    block(6, "text", {"text": "Order 42 arrives Friday."}, state="done"),
]
STORY_LINES = [
    f"[00f067aa] ── ask_colleague {CALL}",
    "[00f067aa] 思考中…",
    "[00f067aa] ▶ search_orders 开始",
    "[00f067aa] │ $ search_orders 42",
    "[00f067aa] │ found 1 order",
    "[00f067aa] Order 42 shipped on Monday.",
    "[00f067aa] 最终回复：Order 42 arrives Friday.",
    "[00f067aa] ── 已结束 ──",
]


STORY_LINES_EN = [
    f"[00f067aa] ── ask_colleague {CALL}",
    "[00f067aa] Thinking…",
    "[00f067aa] ▶ search_orders started",
    "[00f067aa] │ $ search_orders 42",
    "[00f067aa] │ found 1 order",
    "[00f067aa] Order 42 shipped on Monday.",
    "[00f067aa] Final answer: Order 42 arrives Friday.",
    "[00f067aa] ── Ended ──",
]
# Lone surrogates wherever a block or snapshot may hold one (docs/protocol.md): a UTF-8
# output cannot carry them; tail prints U+FFFD in their place.
LONE_SNAPSHOT = snapshot(toolCall={"functionCall": {"name": "ask\ud800"}})
LONE_STORY = [
    block(1, "tool_call", {"name": "look\udfffup", "args": {"q": "\ud800"}}),
    block(2, "text", {"text": "before \ud800 after"}),
    block(3, "text", {"text": "answer \udc00"}, state="done"),
]
LONE_LINES = [
    f"[00f067aa] ── ask\ufffd {CALL}",
    "[00f067aa] ▶ look\ufffdup 开始",
    "[00f067aa] before \ufffd after",
    "[00f067aa] 最终回复：answer \ufffd",
    "[00f067aa] ── 已结束 ──",
]
CJK = re.compile("[\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef]")


STREAM_1 = {"callId": CALL, "taskId": "task-1"}


def lines_of(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


# -- the printer ---------------------------------------------------------------------------


def test_printer_shows_header_folded_thinking_tool_line_text_final_and_end_marker() -> None:
    out = io.StringIO()
    printer = TailPrinter(out)
    printer.snapshot(snapshot())
    for item in STORY:
        printer.block(item)
    printer.block(block(7, "text", {"text": "after the terminal"}))  # ignored
    assert lines_of(out) == STORY_LINES


def test_printer_interleaves_calls_with_a_tag_per_line_and_english_labels() -> None:
    out = io.StringIO()
    printer = TailPrinter(out, locale="en")
    printer.block(block(1, "tool_call", {"name": "lookup"}))
    printer.block(block(1, "text", {"text": "other call"}, call_id=CALL2))
    printer.block(block(1, "text", {"message": "it broke"}, state="aborted", call_id=CALL2))
    printer.block(block(2, "text", {"text": "second task"}, task_id="task-2"))
    printer.block(block(1, "text", {"text": "orphan answer"}, state="done", call_id=None))
    assert lines_of(out) == [
        f"[00f067aa] ── {CALL}",
        "[00f067aa] ▶ lookup started",
        f"[a1b2c3d4] ── {CALL2}",
        "[a1b2c3d4] other call",
        "[a1b2c3d4] Aborted: it broke",
        "[a1b2c3d4] ── Ended ──",
        "[00f067aa] Task task-2",
        "[00f067aa] second task",
        "[—] Unattributed call · Final answer: orphan answer",
    ]


@pytest.mark.parametrize(
    ("locale", "stopped", "failed"),
    [
        ("zh", "已停止：stopped by the user", "已中止：it broke"),
        ("en", "Stopped: stopped by the user", "Aborted: it broke"),
    ],
)
def test_printer_shows_a_stopped_call_apart_from_a_failed_one(
    locale: str, stopped: str, failed: str
) -> None:
    out = io.StringIO()
    printer = TailPrinter(out, locale=locale)
    payload = {"message": "stopped by the user", "stopped": True}
    printer.block(block(1, "text", payload, state="aborted"))
    printer.block(block(1, "text", {"message": "it broke"}, state="aborted", call_id=CALL2))
    lines = lines_of(out)
    assert f"[00f067aa] {stopped}" in lines
    assert f"[a1b2c3d4] {failed}" in lines


def test_printer_says_no_details_after_timeout_then_the_tool_return() -> None:
    now = 0.0
    out = io.StringIO()
    printer = TailPrinter(out, store=PaneStore(timeout_ms=1000, clock=lambda: now))
    printer.snapshot(snapshot())
    printer.tick(999)
    assert lines_of(out) == [f"[00f067aa] ── ask_colleague {CALL}"]
    printer.tick(1000)
    printer.snapshot(snapshot(toolReturn="answer from the tool"))
    assert lines_of(out)[1:] == [
        "[00f067aa] 无过程详情",
        "[00f067aa] 最终回复：answer from the tool",
    ]


def test_printer_shows_unknown_kinds_neutrally() -> None:
    out = io.StringIO()
    printer = TailPrinter(out)
    printer.block(block(1, "chart", {"series": [1]}))
    printer.block(block(2, "gauge", {"text": "50%"}))
    assert lines_of(out)[1:] == [
        "[00f067aa] [未知类型: chart]",
        "[00f067aa] [未知类型: gauge] 50%",
    ]


def test_printer_draws_each_progress_block_as_a_bar_line() -> None:
    out = io.StringIO()
    printer = TailPrinter(out)
    printer.block(block(1, "progress", {"progress": 3.0, "total": 10, "message": "page 3"}))
    printer.block(block(2, "progress", {"progress": 2.5, "total": 4}))
    printer.block(block(3, "progress", {"progress": 12, "total": 10, "message": "over"}))
    printer.block(block(4, "progress", {"progress": 7, "message": "no total"}))
    printer.block(block(5, "progress", {"progress": -1, "total": 0, "text": "\x1b[2Jx"}))
    assert lines_of(out)[1:] == [
        "[00f067aa] ▕███░░░░░░░▏ 3/10 · 30% page 3",
        "[00f067aa] ▕██████░░░░▏ 2.5/4 · 62%",
        "[00f067aa] ▕██████████▏ 12/10 · 100% over",
        "[00f067aa] ▕··········▏ 7 no total",
        "[00f067aa] ▕··········▏ -1 \\x1b[2Jx",
    ]


def test_printer_never_lets_peer_text_steer_the_terminal() -> None:
    out = io.StringIO()
    printer = TailPrinter(out)
    hostile = "ok\x1b[2J\x1b]52;c;cGF3bmVk\x07\rgone\x9b31m\u202eevil"
    printer.block(block(1, "text", {"text": hostile}))
    printer.block(block(2, "tool_output_append", {"text": "\x1b[31mred\x1b[0m\n"}))
    text = out.getvalue()
    for raw in ("\x1b", "\x07", "\r", "\x9b", "\u202e"):
        assert raw not in text
    assert "[00f067aa] ok\\x1b[2J\\x1b]52;c;cGF3bmVk\\x07\\x0dgone\\x9b31m\\u202eevil" in text
    assert "[00f067aa] │ \\x1b[31mred\\x1b[0m" in text
    assert clean("tab\tand\nnewline") == "tab\tand\nnewline"


def test_printer_json_mode_prints_each_raw_block_on_one_line() -> None:
    out = io.StringIO()
    printer = TailPrinter(out, json_mode=True)
    printer.snapshot(snapshot())  # snapshots are not blocks
    printer.block(STORY[0])
    printer.block(block(2, "text", {"text": "line one\nline two \x1b \x9b \u2028 中文"}))
    printer.block({"not": "a valid block"})  # raw means raw
    lines = lines_of(out)
    assert len(lines) == 3
    assert [json.loads(line) for line in lines] == [
        STORY[0],
        block(2, "text", {"text": "line one\nline two \x1b \x9b \u2028 中文"}),
        {"not": "a valid block"},
    ]
    assert "\x9b" not in out.getvalue()
    assert "\u2028" not in out.getvalue()
    assert "中文" in out.getvalue()


@pytest.mark.parametrize("json_mode", [False, True], ids=["lines", "json"])
def test_printer_prints_a_lone_surrogate_on_a_utf8_output_as_the_replacement_character(
    json_mode: bool,
) -> None:
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True)
    printer = TailPrinter(out, json_mode=json_mode)
    printer.snapshot(LONE_SNAPSHOT)
    for item in LONE_STORY:
        printer.block(item)
    assert not printer.broken
    lines = raw.getvalue().decode("utf-8").splitlines()
    if not json_mode:
        assert lines == LONE_LINES
        return
    shown = [
        block(1, "tool_call", {"name": "look\ufffdup", "args": {"q": "\ufffd"}}),
        block(2, "text", {"text": "before \ufffd after"}),
        block(3, "text", {"text": "answer \ufffd"}, state="done"),
    ]
    assert [json.loads(line) for line in lines] == shown


def test_printer_stops_writing_when_its_output_is_closed() -> None:
    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError

    printer = TailPrinter(ClosedPipe())
    printer.block(STORY[0])
    assert printer.broken
    printer.block(STORY[1])  # no exception either


def _play_vector(vector: dict[str, Any], locale: str = "zh") -> tuple[TailPrinter, str]:
    """Every step of ``vector`` through a printer in ``locale``: the printer and what it
    printed."""
    now = 0.0
    out = io.StringIO()
    store = PaneStore(timeout_ms=vector["options"]["timeoutMs"], clock=lambda: now)
    printer = TailPrinter(out, locale=locale, store=store)
    for step in vector["steps"]:
        if "block" in step:
            printer.block(step["block"])
        elif "snapshot" in step:
            printer.snapshot(step["snapshot"])
        elif "tick" in step:
            now = max(now, float(step["tick"]))
            printer.tick(now)
        elif "join" in step:
            assert printer.joining() == step["join"]["have"]
        elif "ack" in step:
            printer.joined(step["ack"])
    return printer, out.getvalue()


def test_printer_in_english_prints_no_chinese_label() -> None:
    """Every vector whose own data is free of Chinese prints none in English; in Chinese
    (the default) the same vectors do, so the labels were reached."""
    vectors = [load(path) for path in VECTOR_FILES]
    plain = [v for v in vectors if not CJK.search(json.dumps(v["steps"], ensure_ascii=False))]
    assert len(plain) >= len(vectors) - 1
    english = "".join(_play_vector(vector, "en")[1] for vector in plain)
    chinese = "".join(_play_vector(vector, "zh")[1] for vector in plain)
    assert CJK.findall(english) == []
    for label in ("思考中…", "已结束", "最终回复", "已中止", "无过程详情", "未知类型"):
        assert label in chinese, label
    for label in ("Thinking…", "Ended", "Final answer", "Aborted", "No process details"):
        assert label in english, label


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_printer_keeps_the_view_semantics_of_every_vector(path: Path) -> None:
    vector = load(path)
    printer, _ = _play_vector(vector)
    assert printer.store.state() == vector["expect"]


def test_printer_marks_the_lines_of_a_catch_up_and_says_what_is_missing() -> None:
    out = io.StringIO()
    printer = TailPrinter(out, locale="en")
    printer.block(block(1, "text", {"text": "before the reconnect"}))
    assert printer.joining() == [{"callId": CALL, "taskId": "task-1", "seq": 1}]
    printer.block(block(1, "text", {"text": "before the reconnect"}))  # resent: no line
    printer.block(block(9, "text", {"text": "caught up"}))
    printer.block(block(1, "text", {"text": "second task"}, task_id="task-2"))
    missing = [
        {"callId": CALL, "taskId": "task-1", "blocks": 7},
        {"callId": CALL, "taskId": "task-1", "blocks": 5},  # one notice per stream
        {"callId": CALL, "taskId": "task-2", "blocks": 1},
    ]
    printer.joined({"ok": True, "replay": {"blocks": 2, "streams": 2, "missing": missing}})
    printer.block(block(10, "text", {"text": "live again"}))
    assert lines_of(out) == [
        f"[00f067aa] ── {CALL}",
        "[00f067aa] before the reconnect",
        "── Catching up… ──",
        "[00f067aa] caught up",
        "[00f067aa] Task task-2",
        "[00f067aa] second task",
        "[00f067aa] Task task-1 · 12 earlier blocks are no longer available",
        "[00f067aa] Task task-2 · 1 earlier block is no longer available",
        "── Live ──",
        "[00f067aa] live again",
    ]


def test_printer_prints_no_marker_for_a_catch_up_that_brought_nothing() -> None:
    out = io.StringIO()
    printer = TailPrinter(out)
    printer.block(STORY[0])
    printer.joining()
    printer.block(STORY[0])  # only what it already had
    printer.joined({"ok": True, "replay": {"blocks": 1, "streams": 1}})
    printer.joining()
    printer.joined(None)  # no answer
    assert lines_of(out) == [f"[00f067aa] ── {CALL}", STORY_LINES[1]]
    assert printer.store.panes[0].mode == "live"


@pytest.mark.parametrize(
    "ack",
    [
        None,
        5,
        "ok",
        [True],
        {"ok": "yes"},
        {"ok": True, "replay": "everything"},
        {"ok": True, "replay": {"missing": {"callId": CALL}}},
        {"ok": True, "replay": {"blocks": 10**4000, "missing": [None, 1, {"callId": [CALL]}]}},
        {"ok": True, "replay": {"missing": [{**STREAM_1, "blocks": 2**53}]}},
        {"ok": True, "replay": {"missing": [{**STREAM_1, "blocks": 0}]}},
        {"ok": True, "replay": {"missing": [STREAM_1] * 20_000}},
        {"ok": False, "error": "\x1b[2Jforbidden"},
    ],
    ids=lambda ack: type(ack).__name__,
)
def test_printer_takes_any_acknowledgement_without_raising_and_prints_no_notice(ack: Any) -> None:
    out = io.StringIO()
    printer = TailPrinter(out)
    printer.block(STORY[0])
    printer.joining()
    printer.joined(ack)
    assert lines_of(out) == [f"[00f067aa] ── {CALL}", STORY_LINES[1]]
    assert printer.store.panes[0].mode == "live"
    assert printer.store.panes[0].tasks["task-1"].missing == 0


def test_printer_json_mode_keeps_the_cursors_but_prints_only_blocks() -> None:
    out = io.StringIO()
    printer = TailPrinter(out, json_mode=True)
    printer.block(STORY[0])
    assert printer.joining() == [{"callId": CALL, "taskId": "task-1", "seq": 1}]
    printer.block(STORY[1])
    missing = [{"callId": CALL, "taskId": "task-1", "blocks": 3}]
    printer.joined({"ok": True, "replay": {"blocks": 1, "streams": 1, "missing": missing}})
    assert [json.loads(line) for line in lines_of(out)] == STORY[:2]


# -- against the real relay ----------------------------------------------------------------


def authenticate(auth: Any, environ: Any) -> Any:
    return "viewer" if isinstance(auth, Mapping) and auth.get("token") == TOKEN else None


def authorize_join(identity: Any, conversation_id: str) -> bool:
    return conversation_id != "forbidden-conversation"


@asynccontextmanager
async def relay(
    port: int | None = None, *, setup: Callable[[Any], None] | None = None, **options: Any
) -> AsyncIterator[str]:
    """The real relay (``create_app`` with ``options``) on ``port``; its URL. ``setup`` is
    called with its :class:`~kernel_ext.relay.ChatRelay` before it serves."""
    # Imported here: the printer tests above do not need the relay module.
    relay_module = pytest.importorskip("kernel_ext.relay")
    ready = relay_module.create_app(
        SECRET, authenticate=authenticate, authorize_join=authorize_join, **options
    )
    if setup is not None:
        setup(ready.relay)
    async with serve_asgi(ready.app, port) as bound:
        yield f"http://127.0.0.1:{bound}"


@asynccontextmanager
async def internal_sender(url: str) -> AsyncIterator[socketio.AsyncClient]:
    client = socketio.AsyncClient(reconnection=False)
    await client.connect(url, namespaces=["/chat"], auth={"internal": SECRET}, wait_timeout=WAIT)
    try:
        yield client
    finally:
        await client.disconnect()


async def send_blocks(client: socketio.AsyncClient, room: str, blocks: list[Any]) -> None:
    ack = await client.call(
        "kx_blocks", {"v": 1, "room": room, "blocks": blocks}, namespace="/chat", timeout=WAIT
    )
    assert ack == {"ok": True, "accepted": len(blocks), "rejected": 0}


async def send_chat_event(client: socketio.AsyncClient, room: str, event: Any) -> None:
    ack = await client.call(
        "kx_chat_event", {"room": room, "event": event}, namespace="/chat", timeout=WAIT
    )
    assert ack == {"ok": True}


@asynccontextmanager
async def tailing(url: str, printer: TailPrinter, err: io.StringIO) -> AsyncIterator[None]:
    """``follow`` the conversation at ``url`` until the block ends, once it has joined."""
    task = asyncio.create_task(follow(url, CONV, printer, token=TOKEN, err=err, timeout=WAIT))
    try:
        await wait_until(
            lambda: "following conversation" in err.getvalue(),
            WAIT,
            "timed out waiting for the join",
        )
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_follows_a_conversation_live_through_the_relay() -> None:
    out, err = io.StringIO(), io.StringIO()
    async with (
        relay() as url,
        tailing(url, TailPrinter(out), err),
        internal_sender(url) as sender,
    ):
        # Another room's traffic, sent first, must never reach this conversation.
        await send_chat_event(sender, "conv-other", snapshot(CALL2))
        await send_blocks(sender, "conv-other", [block(1, "text", {"t": 1}, call_id=CALL2)])
        await send_chat_event(sender, CONV, snapshot())
        await send_blocks(sender, CONV, STORY[:3])
        await wait_until(
            lambda: "▶ search_orders" in out.getvalue(),
            WAIT,
            "timed out waiting for the first frame",
        )
        await send_blocks(sender, CONV, STORY[3:])
        await wait_until(
            lambda: "已结束" in out.getvalue(), WAIT, "timed out waiting for the terminal"
        )
    assert lines_of(out) == STORY_LINES


async def tail_across_a_restart(
    before: list[dict[str, Any]], printed: str, after: list[dict[str, Any]]
) -> tuple[list[str], str]:
    """``follow`` a relay that sends ``before`` live (until ``printed`` is printed), stops,
    comes back on the same port (holding nothing: its memory went with it) and sends
    ``after``, which ends the call: what tail printed, and its stderr."""
    out, err = io.StringIO(), io.StringIO()
    port = free_port()
    task: asyncio.Task[int] | None = None
    try:
        async with relay(port) as url:
            task = asyncio.create_task(
                follow(url, CONV, TailPrinter(out), token=TOKEN, err=err, timeout=WAIT)
            )
            await wait_until(
                lambda: "following conversation" in err.getvalue(),
                WAIT,
                "timed out waiting for the join",
            )
            async with internal_sender(url) as sender:
                await send_blocks(sender, CONV, before)
                await wait_until(
                    lambda: printed in out.getvalue(), WAIT, "timed out waiting for the blocks"
                )
        async with relay(port) as url:
            await wait_until(
                lambda: "following 'conv-1' again" in err.getvalue(),
                WAIT,
                "timed out waiting for the re-join",
            )
            async with internal_sender(url) as sender:
                await send_blocks(sender, CONV, after)
                await wait_until(
                    lambda: "已结束" in out.getvalue(), WAIT, "timed out waiting for the terminal"
                )
    finally:
        if task is not None:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    return lines_of(out), err.getvalue()


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_joins_again_after_the_relay_restarts() -> None:
    lines, err = await tail_across_a_restart(STORY[:1], "思考中", STORY[2:])
    assert "connection lost; reconnecting…" in err
    # No snapshot was sent, so the header has no tool name; nothing was lost or repeated.
    assert lines == [f"[00f067aa] ── {CALL}", *STORY_LINES[1:]]


async def start_cli(*args: str, **env_vars: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_vars}
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kernel_ext.cli.entry",
        "tail",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )


async def finish(proc: asyncio.subprocess.Process) -> tuple[int, str, str]:
    stdout, stderr = await asyncio.wait_for(proc.communicate(), WAIT)
    assert proc.returncode is not None
    return proc.returncode, stdout.decode(), stderr.decode()


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_json_prints_raw_blocks_and_exits_cleanly_on_ctrl_c() -> None:
    async with relay() as url:
        proc = await start_cli("--url", url, "--conversation", CONV, "--token", TOKEN, "--json")
        try:
            assert proc.stderr is not None
            assert proc.stdout is not None
            first = await asyncio.wait_for(proc.stderr.readline(), WAIT)
            assert b"following conversation 'conv-1'" in first
            async with internal_sender(url) as sender:
                await send_chat_event(sender, CONV, snapshot())
                await send_blocks(sender, CONV, STORY)
            lines = [await asyncio.wait_for(proc.stdout.readline(), WAIT) for _ in STORY]
            assert [json.loads(line) for line in lines] == STORY
            proc.send_signal(signal.SIGINT)
            code, stdout, stderr = await finish(proc)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert code == EXIT_INTERRUPTED
    assert stdout == ""  # nothing after the blocks: the snapshot is not a block
    assert "Traceback" not in stderr
    assert "KeyboardInterrupt" not in stderr


async def tail_the_story(
    *extra: str,
    story: tuple[dict[str, Any], list[dict[str, Any]], list[str]] = (
        snapshot(),
        STORY,
        STORY_LINES,
    ),
    **env_vars: str,
) -> tuple[list[str], int, str, str]:
    """``kernel-ext tail`` (with ``extra`` options and environment variables) following a
    story (its snapshot, blocks and lines) through a real relay until Ctrl-C: its story
    lines, exit code, the rest of its stdout, its stderr."""
    first, blocks, story_lines = story
    async with relay() as url:
        args = ("--url", url, "--conversation", CONV, "--token", TOKEN, *extra)
        proc = await start_cli(*args, **env_vars)
        try:
            assert proc.stderr is not None
            assert proc.stdout is not None
            await asyncio.wait_for(proc.stderr.readline(), WAIT)
            async with internal_sender(url) as sender:
                await send_chat_event(sender, CONV, first)
                await send_blocks(sender, CONV, blocks)
            lines = [await asyncio.wait_for(proc.stdout.readline(), WAIT) for _ in story_lines]
            proc.send_signal(signal.SIGINT)
            code, rest, stderr = await finish(proc)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return [line.decode().rstrip("\n") for line in lines], code, rest, stderr


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_human_output_from_the_command_line() -> None:
    lines, code, _, stderr = await tail_the_story()
    assert lines == STORY_LINES
    assert code == EXIT_INTERRUPTED
    assert "Traceback" not in stderr
    assert "reconnecting" not in stderr  # our own goodbye is not a lost connection


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_prints_lone_surrogates_to_a_utf8_stdout_and_follows_to_the_end() -> None:
    story = (LONE_SNAPSHOT, LONE_STORY, LONE_LINES)
    lines, code, rest, stderr = await tail_the_story(story=story, PYTHONIOENCODING="utf-8")
    assert lines == LONE_LINES
    assert code == EXIT_INTERRUPTED  # still following: a surrogate did not close stdout
    assert rest == ""
    assert "Traceback" not in stderr


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_lang_en_prints_english_labels_and_no_chinese() -> None:
    lines, code, rest, stderr = await tail_the_story("--lang", "en")
    assert code == EXIT_INTERRUPTED
    assert lines == STORY_LINES_EN
    assert CJK.findall(rest + stderr) == []


@pytest.mark.network
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extra", "conversation", "message"),
    [
        (["--token", "wrong"], CONV, "refused the connection: unauthorized (check --token)"),
        ([], CONV, "refused the connection: unauthorized (check --token)"),
        (["--token", TOKEN], "forbidden-conversation", "was refused: forbidden"),
    ],
    ids=["bad-token", "no-token", "join-refused"],
)
async def test_tail_explains_a_refusal_and_exits_non_zero(
    extra: list[str], conversation: str, message: str
) -> None:
    async with relay() as url:
        proc = await start_cli("--url", url, "--conversation", conversation, *extra)
        try:
            code, stdout, stderr = await finish(proc)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert code == EXIT_FAILED
    assert message in stderr
    assert stderr.startswith("kernel-ext tail: ")
    assert "Traceback" not in stderr
    assert stdout == ""


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_explains_an_unreachable_relay_and_exits_non_zero() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = await start_cli("--url", url, "--conversation", CONV, "--timeout", "5")
    code, stdout, stderr = await finish(proc)
    assert code == 2  # the --url cannot be used, as a bad --host/--port of the other commands
    assert stdout == ""
    assert f"kernel-ext tail: cannot connect to {url}" in stderr
    assert "Traceback" not in stderr


# -- catch-up: the relay's memory -------------------------------------------------------------


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_started_mid_call_shows_the_catch_up_then_the_live_blocks() -> None:
    out, err = io.StringIO(), io.StringIO()
    joins: list[Any] = []
    sizes = [block_size(item) for item in STORY]
    # The stream bound one byte short of blocks 1-3: block 2, the oldest running one, gives
    # way (the first block never does).
    bounds = {"max_block_bytes": max(sizes), "replay_stream_bytes": sum(sizes[:3]) - 1}
    async with (
        relay(setup=lambda r: record_joins(r, joins), **bounds) as url,
        internal_sender(url) as sender,
    ):
        await send_blocks(sender, CONV, STORY[:3])
        async with tailing(url, TailPrinter(out), err):
            await send_blocks(sender, CONV, STORY[3:])
            await wait_until(
                lambda: "已结束" in out.getvalue(), WAIT, "timed out waiting for the terminal"
            )
    assert joins == [{"conversationId": CONV, "have": []}]  # it held nothing
    assert lines_of(out) == [
        "── 同步中… ──",
        f"[00f067aa] ── {CALL}",
        *STORY_LINES[1:3],
        "[00f067aa] 1 条较早的内容已不可用",
        "── 实时 ──",
        *STORY_LINES[3:],
    ]
    assert f"following conversation 'conv-1' at {url}, caught up on 2 blocks" in err.getvalue()


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_joins_again_with_what_it_holds_and_gets_only_the_rest() -> None:
    out, err = io.StringIO(), io.StringIO()
    joins: list[Any] = []
    async with (
        relay(setup=lambda r: record_joins(r, joins)) as url,
        internal_sender(url) as sender,
        flaky_network(int(url.rsplit(":", 1)[1])) as network,
        tailing(f"http://127.0.0.1:{network.port}", TailPrinter(out), err),
    ):
        await send_blocks(sender, CONV, STORY[:3])
        await wait_until(
            lambda: "▶ search_orders" in out.getvalue(), WAIT, "timed out waiting for the blocks"
        )
        network.offline()
        await wait_until(
            lambda: "connection lost" in err.getvalue(), WAIT, "tail did not notice the drop"
        )
        await send_blocks(sender, CONV, STORY[3:5])  # while tail is away
        network.online()
        await wait_until(lambda: "following 'conv-1' again" in err.getvalue(), WAIT, "no re-join")
        await send_blocks(sender, CONV, STORY[5:])
        await wait_until(
            lambda: "已结束" in out.getvalue(), WAIT, "timed out waiting for the terminal"
        )
    assert joins == [
        {"conversationId": CONV, "have": []},
        {"conversationId": CONV, "have": [{"callId": CALL, "taskId": "task-1", "seq": 3}]},
    ]
    # Blocks 4 and 5 came from the catch-up, once; nothing was repeated or lost.
    assert lines_of(out) == [
        f"[00f067aa] ── {CALL}",
        *STORY_LINES[1:3],
        "── 同步中… ──",
        *STORY_LINES[3:6],
        "── 实时 ──",
        *STORY_LINES[6:],
    ]
    assert "reconnected; following 'conv-1' again, caught up on 2 blocks" in err.getvalue()


def acknowledging_with(missing: list[Any]) -> Callable[[Any], None]:
    """A fake, for a fault no relay makes: the relay's acknowledgements carry ``missing``
    (whatever it is) in their ``replay``; everything else is the real relay's."""

    def setup(real: Any) -> None:
        join = real.on_join_conversation

        async def on_join_conversation(sid: str, data: Any = None) -> Any:
            ack = await join(sid, data)
            return {**ack, "replay": {**ack["replay"], "missing": missing}}

        real.on_join_conversation = on_join_conversation

    return setup


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_tail_takes_a_hostile_catch_up_acknowledgement_in_its_stride() -> None:
    out, err = io.StringIO(), io.StringIO()
    # 10**99: the largest integers python-engineio parses have 100 digits.
    missing: list[Any] = [None, "x", {"callId": CALL, "taskId": "task-1", "blocks": 10**99}]
    missing += [{"callId": CALL, "taskId": "task-1", "blocks": -1}] * 5_000
    printer = TailPrinter(out)
    async with relay(setup=acknowledging_with(missing)) as url, internal_sender(url) as sender:
        await send_blocks(sender, CONV, STORY[:1])
        async with tailing(url, printer, err):
            pass  # joined: the catch-up and its acknowledgement are behind
    assert lines_of(out) == ["── 同步中… ──", f"[00f067aa] ── {CALL}", STORY_LINES[1], "── 实时 ──"]
    assert printer.store.dropped["ignoredAck"] == len(missing)
    assert "Traceback" not in err.getvalue()


# -- the link to the trace -----------------------------------------------------------------

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
JAEGER = "https://jaeger.example/trace/{traceId}?uiFind={spanId}"


def traced(seq: int, trace_id: Any = TRACE, **kw: Any) -> dict[str, Any]:
    return {**block(seq, "text", {"text": f"step {seq}"}, **kw), "traceId": trace_id}


def test_the_printer_prints_a_calls_link_to_its_span_once_it_has_a_trace_id() -> None:
    out = io.StringIO()
    printer = TailPrinter(out, locale="en", trace_url=JAEGER)
    printer.block(traced(1, None))  # no trace id yet: no link
    printer.block(traced(2))
    printer.block(traced(3))  # printed once
    assert lines_of(out) == [
        f"[00f067aa] ── {CALL}",
        "[00f067aa] step 1",
        f"[00f067aa] ↗ https://jaeger.example/trace/{TRACE}?uiFind={CALL}",
        "[00f067aa] step 2",
        "[00f067aa] step 3",
    ]


@pytest.mark.parametrize("template", [None, "javascript:alert(1)//{traceId}", "/t/{traceId}"])
def test_the_printer_prints_no_link_without_a_web_address_template(template: str | None) -> None:
    out = io.StringIO()
    printer = TailPrinter(out, locale="en", trace_url=template)
    printer.block(traced(1))
    assert lines_of(out) == [f"[00f067aa] ── {CALL}", "[00f067aa] step 1"]
