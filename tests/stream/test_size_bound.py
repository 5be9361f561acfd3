"""The size bound end to end: one measure at the worker and the relay, and a refused terminal
is degraded and sent again, never counted delivered (issue: terminal edges, item 1).

Worker (SDK tracer provider, tap, hub, sender) → relay (uvicorn on 127.0.0.1, or a
subprocess behind a real redis-server) → browser (a real python-socketio client). Final
answers of 60,000 to 5,000,000 characters in three alphabets: each pane gets exactly one
terminal, whole when it fits the 64 KiB bound and cut with the visible marker when not.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from support.network import RedisServer, serve_asgi
from support.redis_helpers import wait_subscribed
from support.relay_helpers import SECRET, barrier, terminals
from support.reliability_helpers import (
    DEFAULT_PINGS,
    RUNS,
    WatchedBrowser,
    Worker,
    browser_on,
    report,
    running_relay,
)
from support.timing import wait_until

from kernel_ext.emit import RedisEmitter
from kernel_ext.protocol import DEFAULT_MAX_BLOCK_BYTES, FALLBACK_INVALID, trace_id_hex
from kernel_ext.relay import ChatRelay, allow_all, create_app
from kernel_ext.stream import StreamHub

pytestmark = [pytest.mark.network, pytest.mark.timeout(120 + 60 * RUNS)]

SIZES = [60_000, 65_530, 70_000, 300_000, 5_000_000]
ALPHABETS = {
    "ascii": "abcdefghij",
    "cjk": "中文字符测试答案结果",
    "emoji": "😀🚀🎉🧠💡",
}
MARKER = re.compile(r"…\[truncated (\d+) chars\]\Z")


def answer(alphabet: str, n: int) -> str:
    chars = ALPHABETS[alphabet]
    return (chars * (n // len(chars) + 1))[:n]


def compact_size(block: dict[str, Any]) -> int:
    """The bound's measure, written out here as the test's own oracle."""
    return len(json.dumps(block, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


def check_pane(blocks: list[dict[str, Any]], original: str) -> bool:
    """Exactly one terminal, ``done``, within the bound; the whole answer when the uncut
    block fits, else a prefix of it ending with the marker that counts what was cut.
    Returns whether it was cut."""
    finals = terminals(blocks)
    assert len(finals) == 1, [b["state"] for b in finals]
    final = finals[0]
    assert final["state"] == "done"
    assert compact_size(final) <= DEFAULT_MAX_BLOCK_BYTES
    text = final["envelope"]["payload"]["text"]
    uncut = dict(final, envelope=dict(final["envelope"], payload={"text": original}))
    if compact_size(uncut) <= DEFAULT_MAX_BLOCK_BYTES:
        assert text == original
        return False
    found = MARKER.search(text)
    assert found is not None, text[-80:]
    kept = text[: found.start()]
    assert original.startswith(kept)
    assert int(found.group(1)) == len(original) - len(kept)
    return True


async def publish_answers(worker: Worker, conversation: str) -> dict[str, str]:
    """One tool call per (size, alphabet), each ending with its final answer; returns the
    answers by call id."""
    answers: dict[str, str] = {}
    for size in SIZES:
        for alphabet in ALPHABETS:
            text = answer(alphabet, size)
            with worker.call(conversation) as call:
                worker.hub.publish(f"thinking about a {size}-character {alphabet} answer")
                worker.hub.publish(text, state="done")
            answers[call.call_id] = text
    return answers


async def check_panes(browser: WatchedBrowser, port: int, answers: dict[str, str]) -> int:
    await browser.wait_for(
        lambda _: all(terminals(browser.stream(call_id)) for call_id in answers), timeout=120
    )
    await barrier(browser, port)
    cut = 0
    for call_id, original in answers.items():
        cut += check_pane(browser.stream(call_id), original)
    return cut


async def test_long_answers_reach_the_browser_once_over_the_loopback_relay() -> None:
    ready = create_app(SECRET, authorize_join=allow_all)
    cut = 0
    async with serve_asgi(ready.app) as port, browser_on(port, "conv-size") as browser:
        async with Worker(port, max_running_per_second=None) as worker:
            for _ in range(RUNS):
                answers = await publish_answers(worker, "conv-size")
                cut += await check_panes(browser, port, answers)
            stats = worker.hub.stats()
        assert stats["degraded"] == 0
        assert ready.relay.stats().get("rejected_too_large", 0) == 0
        assert cut == 14 * RUNS  # every answer but the 60,000-character ASCII one is cut
        assert worker.loopback.counts.get("terminals_degraded", 0) == 0
    report(
        "final answers of 60 k–5 M characters (ASCII, CJK, emoji), loopback relay",
        runs=RUNS,
        terminals_expected=15 * RUNS,
        terminals_delivered=len(terminals(browser.blocks)),
        cut_with_marker=cut,
        refused_by_relay=ready.relay.stats().get("rejected_too_large", 0),
    )


@pytest.mark.redis
async def test_long_answers_reach_the_browser_once_over_redis(redis_server: RedisServer) -> None:
    def redis_emitter(hub: StreamHub) -> RedisEmitter:
        return RedisEmitter(redis_server.url, hub=hub)

    cut = 0
    # The browser shares its event loop with the worker, which cuts 5 MB answers: with the
    # short test pings a late pong would drop it (and what went to the room meanwhile).
    async with (
        running_relay(redis_server.url, pings=DEFAULT_PINGS) as relay,
        browser_on(relay.port, "c") as browser,
    ):
        await wait_subscribed(redis_server.url, 1)
        async with Worker(emitter=redis_emitter, max_running_per_second=None) as worker:
            for _ in range(RUNS):
                answers = await publish_answers(worker, "c")
                cut += await check_panes(browser, relay.port, answers)
            assert worker.hub.stats()["degraded"] == 0
        assert cut == 14 * RUNS
    report(
        "final answers of 60 k–5 M characters (ASCII, CJK, emoji), Redis emitter",
        runs=RUNS,
        terminals_expected=15 * RUNS,
        terminals_delivered=len(terminals(browser.blocks)),
        cut_with_marker=cut,
    )


def at_bound_text(worker: Worker, extra: int) -> Callable[[str, str, int], str]:
    """A function of (call id, task id, trace id) giving an ASCII answer whose done block
    measures exactly the bound plus ``extra`` bytes (its traceId counted: a sampled call's
    blocks carry one)."""

    def text_for(call_id: str, task_id: str, trace_id: int) -> str:
        empty: dict[str, Any] = {
            "v": 1,
            "callId": call_id,
            "taskId": task_id,
            "state": "done",
            "ts": 1_000_000_000_000,  # 13 digits, like every ts until the year 2286
            "envelope": {
                "v": 1,
                "kind": "text",
                "streamKey": task_id,
                "seq": 2,
                "status": "done",
                "payload": {"text": ""},
            },
        }
        if trace_id_hex(trace_id) is not None:
            empty["traceId"] = trace_id_hex(trace_id)
        return "y" * (DEFAULT_MAX_BLOCK_BYTES - compact_size(empty) + extra)

    return text_for


async def test_a_terminal_exactly_at_the_bound_passes_unchanged_and_one_byte_more_is_cut() -> None:
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, "conv-edge") as browser:
        async with Worker(port) as worker:
            sent: dict[str, str] = {}
            for extra in (0, 1):
                with worker.call("conv-edge") as call:
                    worker.hub.publish("one running block first", task_id="t")
                    text = at_bound_text(worker, extra)(call.call_id, "t", call.trace_id)
                    worker.hub.publish(text, task_id="t", state="done")
                sent[call.call_id] = text
            await browser.wait_for(
                lambda _: all(terminals(browser.stream(c)) for c in sent), timeout=30
            )
            await barrier(browser, port)
        exact, over = (terminals(browser.stream(c))[0] for c in sent)
        assert compact_size(exact) == DEFAULT_MAX_BLOCK_BYTES
        assert exact["envelope"]["payload"]["text"] == next(iter(sent.values()))
        assert compact_size(over) <= DEFAULT_MAX_BLOCK_BYTES
        assert MARKER.search(over["envelope"]["payload"]["text"])
        assert ready.relay.stats().get("rejected_too_large", 0) == 0
        for call_id in sent:
            assert len(terminals(browser.stream(call_id))) == 1


async def test_a_relay_with_a_smaller_bound_gets_the_terminal_cut_to_its_bound_once() -> None:
    """A configuration mismatch: the relay's bound is 16 KiB, the worker's 64 KiB. The
    relay refuses the worker's terminal as too large; the sender cuts it to the bound the
    relay named and sends it again: one terminal, with the marker, within 16 KiB."""
    small = 16 * 1024
    ready = create_app(SECRET, authorize_join=allow_all, max_block_bytes=small)
    async with serve_asgi(ready.app) as port, browser_on(port, "conv-small") as browser:
        async with Worker(port) as worker:
            original = answer("cjk", 40_000)
            with worker.call("conv-small") as call:
                worker.hub.publish("working")
                worker.hub.publish(original, state="done")
            await browser.wait_for(lambda _: bool(terminals(browser.stream(call.call_id))))
            await wait_until(lambda: worker.sizes()["pending_terminals"] == 0)
            await barrier(browser, port)
            degraded = worker.loopback.counts.get("terminals_degraded", 0)
        (final,) = terminals(browser.stream(call.call_id))
        assert compact_size(final) <= small
        text = final["envelope"]["payload"]["text"]
        found = MARKER.search(text)
        assert found is not None
        assert original.startswith(text[: found.start()])
        assert int(found.group(1)) == len(original) - found.start()
        assert degraded == 1
        assert ready.relay.stats()["rejected_too_large"] == 1


class RefusingTerminalsRelay(ChatRelay):  # type: ignore[misc]
    """A fake for a fault the real relay never shows (it accepts what the protocol accepts):
    every terminal is refused as invalid unless it is the protocol's short fallback."""

    def _check_block(self, raw: Any) -> str | None:
        payload = raw.get("envelope", {}).get("payload", {}) if isinstance(raw, dict) else {}
        if raw.get("state") != "running" and FALLBACK_INVALID not in payload.values():
            return "invalid"
        return super()._check_block(raw)


@asynccontextmanager
async def refusing_relay() -> AsyncIterator[tuple[int, ChatRelay]]:
    import socketio

    sio = socketio.AsyncServer(async_mode="asgi", cors_allowed_origins=[])
    relay = RefusingTerminalsRelay(SECRET, authorize_join=allow_all)
    sio.register_namespace(relay)
    async with serve_asgi(socketio.ASGIApp(sio)) as port:
        yield port, relay


async def test_a_terminal_the_relay_refuses_goes_again_as_the_short_fallback_once() -> None:
    async with refusing_relay() as (port, relay), browser_on(port, "conv-x") as browser:
        async with Worker(port) as worker:
            with worker.call("conv-x") as call:
                worker.hub.publish("working")
                worker.hub.publish("an answer this relay will not take", state="done")
            await browser.wait_for(lambda _: bool(terminals(browser.stream(call.call_id))))
            await wait_until(lambda: worker.sizes()["pending_terminals"] == 0)
            await barrier(browser, port)
            counts = dict(worker.loopback.counts)
            losses = worker.losses()
        (final,) = terminals(browser.stream(call.call_id))
        assert final["state"] == "done"
        assert final["envelope"]["payload"] == {"text": FALLBACK_INVALID}
        assert counts["terminals_degraded"] == 1
        assert "rejected" not in losses  # the terminal was not counted lost
        assert relay.stats()["rejected_invalid"] == 1
