"""Intruders at the relay (real python-socketio server and clients on 127.0.0.1; the last
test drives the demo page in real headless Chromium).

* A browser that emits the internal frames (``kx_blocks``, ``kx_chat_event``), blocks
  (``tool_event_stream``), ``chat_event``, or ``connect``/``disconnect`` as ordinary events,
  for its own room and for another, reaches no one: the other browsers' first item is a
  legit marker sent afterwards; everything is counted.
* Connections without or with a wrong credential are refused; a join the hook refuses
  gets nothing of that room; 200 guesses of the internal secret are all refused, counted,
  logged (1st, 2nd, 4th … time) and each compared with ``hmac.compare_digest``.
* Oversized frames and deeply nested payloads are refused without harm to the others: a
  legit stream flowing meanwhile arrives whole and in order.
* Markup and script in every envelope field, through worker → relay → the demo page:
  shown as text, nothing parsed or run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import socketio
from support.network import chromium, free_port, wait_listening
from support.relay_helpers import (
    NS,
    SECRET,
    Browser,
    barrier,
    block,
    browsers,
    frame,
    relay_server,
    worker,
)
from support.reliability_helpers import RUNS, report
from support.timing import CALL_TIMEOUT, wait_until

import kernel_ext.relay._log as relay_log
import kernel_ext.relay.auth as relay_auth

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

C1, C2 = "conv-1", "conv-2"


def marker(room: str) -> dict[str, Any]:
    return block(1, task_id=f"marker-{room}", text=f"the first legit block of {room}")


async def send_markers(port: int, *rooms: str) -> None:
    async with worker(port) as sender:
        for room in rooms:
            ack = await sender.call("kx_blocks", frame(room, [marker(room)]), namespace=NS)
            assert ack == {"ok": True, "accepted": 1, "rejected": 0}


async def test_a_browser_sending_internal_frames_or_blocks_reaches_no_one() -> None:
    async with (
        relay_server() as (port, relay),
        browsers(port, C1, C1, C2) as (attacker, same_room, other_room),
    ):
        forbidden = dropped = 0
        for i in range(20 * RUNS):
            for room in (C1, C2):
                attack = block(i, task_id=f"forged-{room}", state="done", text="<b>forged</b>")
                await attacker.client.emit("tool_event_stream", attack, namespace=NS)
                await attacker.client.emit("chat_event", {"eventId": "x"}, namespace=NS)
                dropped += 2
                acks = [
                    await attacker.client.call("kx_blocks", frame(room, [attack]), namespace=NS),
                    await attacker.client.call(
                        "kx_chat_event", {"room": room, "event": {"eventId": "x"}}, namespace=NS
                    ),
                ]
                assert acks == [{"ok": False, "error": "forbidden"}] * 2
                forbidden += 2
        await send_markers(port, C1, C2)
        for browser, room in ((same_room, C1), (other_room, C2), (attacker, C1)):
            await browser.wait_for(lambda blocks: len(blocks) >= 1)
            await barrier(browser, port)
            assert browser.blocks == [marker(room)], browser.name
            assert browser.chat_events == []
        stats = relay.stats()
    assert stats["rejected_unknown_event"] == dropped
    assert stats["rejected_not_internal"] == forbidden
    assert stats["blocks_emitted"] == 2  # the markers, nothing else
    report(
        "intruder: a browser sends internal frames, blocks and chat events (own and other room)",
        attempts=dropped + forbidden,
        reached_anyone=0,
        counted=stats["rejected_unknown_event"] + stats["rejected_not_internal"],
    )


async def test_connect_and_disconnect_sent_as_events_are_dropped_and_counted() -> None:
    """Regression: python-socketio hands a client's ordinary ``disconnect`` event to the
    same handler as a real disconnect (the relay then forgot the browser while it stayed
    connected), and a ``connect`` event ran the credential check again inside the
    connection (an unhandled refusal per guess, or a browser turning itself internal)."""
    async with relay_server() as (port, relay), browsers(port, C1) as (attacker,):
        for args in ("bye", ({}, {"internal": "a guess"}), ({}, {"internal": SECRET}), None):
            for event in ("disconnect", "connect"):
                ack = await attacker.client.call(event, args, namespace=NS, timeout=CALL_TIMEOUT)
                assert ack is None  # answered (dropped), not left hanging
        stats = relay.stats()
        assert stats["rejected_unknown_event"] == 8
        assert (stats["browsers"], stats["internal"]) == (1, 0)
        assert "rejected_bad_secret" not in stats
        # Still an ordinary browser: it may join, and still may not send frames.
        assert await attacker.join(C2) == {"ok": True}
        nack = await attacker.client.call("kx_blocks", frame(C2, [block(1)]), namespace=NS)
        assert nack == {"ok": False, "error": "forbidden"}


def token_only(auth: Any, environ: Any) -> Any:
    if isinstance(auth, dict) and auth.get("token") == "good-token":
        return {"user": "alice"}
    return None


def own_conversations(identity: Any, conversation: str) -> bool:
    return conversation == C1  # alice's


async def test_missing_or_wrong_credentials_are_refused_and_a_refused_join_gets_nothing() -> None:
    async with relay_server(authenticate=token_only, authorize_join=own_conversations) as (
        port,
        relay,
    ):
        refused = 0
        for auth in (None, {}, {"token": "bad"}, {"token": None}, "token", {"internal": "x"}):
            intruder = Browser(reconnect=False)
            with pytest.raises(socketio.exceptions.ConnectionError):
                await intruder.connect(port, auth=auth)
            await intruder.close()
            refused += 1
        alice, mallory = Browser("alice"), Browser("mallory")
        try:
            await alice.connect(port, auth={"token": "good-token"})
            await mallory.connect(port, auth={"token": "good-token"})
            assert await alice.join(C1) == {"ok": True}
            assert await mallory.join(C2) == {"ok": False, "error": "forbidden"}
            async with worker(port) as sender:
                await sender.call("kx_blocks", frame(C2, [block(1, text="secret")]), namespace=NS)
            await send_markers(port, C1)
            await alice.wait_for(lambda blocks: len(blocks) >= 1)
            await barrier(mallory, port)
            assert alice.blocks == [marker(C1)]
            assert mallory.blocks == []
        finally:
            await alice.close()
            await mallory.close()
        stats = relay.stats()
    assert stats["browser_refused"] == refused - 1  # the last one was a wrong internal secret
    assert stats["rejected_bad_secret"] == 1
    assert stats["join_refused"] == 1


async def test_guessing_the_internal_secret_is_refused_counted_logged_and_constant_time(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import hmac

    compared: list[tuple[type, type]] = []

    def compare_digest(a: Any, b: Any) -> bool:
        compared.append((type(a), type(b)))
        return hmac.compare_digest(a, b)

    monkeypatch.setattr(relay_auth, "hmac", types.SimpleNamespace(compare_digest=compare_digest))
    caplog.set_level(logging.WARNING, logger="kernel_ext.relay")
    attempts = 200
    guesses = [f"{SECRET[:-1]}{i}" for i in range(attempts - 5)]
    guesses += [SECRET + "x", SECRET[:1], "", "ü" * len(SECRET), "\ud800" + SECRET[1:]]
    assert SECRET not in guesses
    seen_before = relay_log.rare.counts().get("relay_bad_secret", 0)
    async with relay_server() as (port, relay), browsers(port, C1) as (watcher,):
        for guess in guesses:
            client = socketio.AsyncClient(reconnection=False)
            with pytest.raises(socketio.exceptions.ConnectionError):
                await asyncio.wait_for(
                    client.connect(
                        f"http://127.0.0.1:{port}",
                        namespaces=[NS],
                        auth={"internal": guess},
                        transports=["websocket"],
                        wait_timeout=CALL_TIMEOUT,
                    ),
                    timeout=2 * CALL_TIMEOUT,
                )
            with contextlib.suppress(Exception):
                await client.disconnect()
        # The real sender is not locked out by the guessing.
        await send_markers(port, C1)
        await watcher.wait_for(lambda blocks: len(blocks) >= 1)
        stats = relay.stats()
    assert watcher.blocks == [marker(C1)]
    assert stats["rejected_bad_secret"] == attempts
    assert stats["internal_connects"] == 1
    # Every guess (and the real secret) went through hmac.compare_digest, on bytes.
    assert compared.count((bytes, bytes)) == attempts + 1
    # Logged on the 1st, 2nd, 4th … occurrence of the reason in this process.
    seen_after = seen_before + attempts
    assert relay_log.rare.counts()["relay_bad_secret"] == seen_after
    powers = [n for n in range(seen_before + 1, seen_after + 1) if n & (n - 1) == 0]
    logged = [r for r in caplog.records if "bad_secret" in r.getMessage()]
    assert len(logged) == len(powers)
    report(
        "intruder: internal secret guessed",
        attempts=attempts,
        accepted=0,
        counted=stats["rejected_bad_secret"],
        log_lines=len(logged),
        constant_time_compares=compared.count((bytes, bytes)) - 1,
        throttled=False,
    )


async def test_oversized_and_deeply_nested_frames_are_refused_without_harm_to_others() -> None:
    """A legit stream of 200 blocks flows to a watcher while intruders send frames over the
    server's message bound (their connections are closed), a block over the relay's size
    bound, a payload nested past the protocol's depth bound, and a packet nested so deep
    that python-socketio cannot decode it (dropped and logged by the library)."""
    bound = 256 * 1024
    async with (
        relay_server(max_http_buffer_size=bound, max_block_bytes=8 * 1024) as (port, relay),
        browsers(port, C1, C1) as (watcher, noisy),
        worker(port) as legit,
        worker(port) as bad_sender,
    ):
        noisy.client.reconnection = False

        async def stream() -> None:
            for seq in range(1, 201):
                ack = await legit.call("kx_blocks", frame(C1, [block(seq)]), namespace=NS)
                assert ack == {"ok": True, "accepted": 1, "rejected": 0}

        async def attacks() -> None:
            nested = '["kx_blocks",' + "[" * 50_000 + "]" * 50_000 + "]"
            await noisy.client.eio.send("2" + NS + "," + nested)  # a raw Socket.IO EVENT
            await bad_sender.eio.send("2" + NS + "," + nested)
            deep: Any = "x"
            for _ in range(40):
                deep = {"d": deep}
            too_deep = block(1, task_id="deep")
            too_deep["envelope"]["payload"]["deep"] = deep
            too_big = block(1, task_id="big", text="x" * 10_000)
            ack = await bad_sender.call("kx_blocks", frame(C1, [too_deep, too_big]), namespace=NS)
            assert ack == {
                "ok": True,
                "accepted": 0,
                "rejected": 2,
                "refused": [
                    {"index": 0, "reason": "invalid"},
                    {"index": 1, "reason": "too_large"},
                ],
                "maxBlockBytes": 8 * 1024,
            }
            with contextlib.suppress(Exception):
                await noisy.client.emit("tool_event_stream", "x" * (bound + 1), namespace=NS)
            with contextlib.suppress(Exception):
                await bad_sender.emit("kx_blocks", frame(C1, ["x" * (bound + 1)]), namespace=NS)

        await asyncio.gather(stream(), attacks())
        await wait_until(lambda: not noisy.client.connected and not bad_sender.connected)
        await watcher.wait_for(lambda blocks: len(blocks) >= 200)
        await barrier(watcher, port)
        stats = relay.stats()
    assert [b["envelope"]["seq"] for b in watcher.blocks] == list(range(1, 201))
    assert stats["rejected_invalid"] == 1  # nested past the depth bound
    assert stats["rejected_too_large"] == 1
    report(
        "intruder: oversized and deeply nested frames while a legit stream flows",
        legit_blocks_sent=200,
        legit_blocks_delivered=len(watcher.blocks),
        oversized_connections_closed=2,
    )


# -- markup in every field, through the whole path into the demo page in Chromium ----------

CALL = "00f067aa0ba902b7"
ROOM = "demo-intruder"
POISON = {
    "tool": '<img src=x onerror="window.__kxPwned=1">',
    "colleague": "<script>window.__kxPwned=2</script>",
    "task": '<iframe src="javascript:window.__kxPwned=3"></iframe>',
    "thinking": '<svg onload="window.__kxPwned=4"></svg>',
    "tool_call": '<a href="javascript:window.__kxPwned=5">x</a>',
    "text": "<script>window.__kxPwned=6</script>&lt;not an entity&gt; &amp;",
    "kind": '<b onclick="window.__kxPwned=7">k</b>',
    "output": "<style>body{display:none}</style>",
    "final": '<img src=x onerror="window.__kxPwned=8"> is the answer',
    "message": "<marquee>user</marquee><i>text</i>",
}


def poisoned_blocks() -> list[dict[str, Any]]:
    task = POISON["task"]

    def one(seq: int, kind: str, payload: dict[str, Any], state: str = "running") -> Any:
        return {
            "v": 1,
            "callId": CALL,
            "taskId": task,
            "state": state,
            "ts": 1789123456789 + seq,
            "envelope": {
                "v": 1,
                "kind": kind,
                "streamKey": POISON["kind"],
                "seq": seq,
                "status": POISON["kind"][:60] if state == "running" else state,
                "payload": payload,
            },
        }

    return [
        one(1, "thinking", {"text": POISON["thinking"]}),
        one(2, "tool_call", {"name": POISON["tool_call"], "args": {"q": POISON["text"]}}),
        one(3, "text", {"text": POISON["text"]}),
        one(4, "tool_output_append", {"text": POISON["output"] + "\n"}),
        one(5, POISON["kind"][:60], {"text": POISON["text"]}),
        one(6, "text", {"text": POISON["final"]}, state="done"),
    ]


class SenderThread:
    """An internal sender on an event loop of its own (Playwright's sync API owns this one)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _send(self) -> list[Any]:
        snapshot = {
            "eventId": CALL,
            "eventScene": "tool",
            "conversationId": ROOM,
            "content": {
                "toolCall": {
                    "functionCall": {
                        "name": POISON["tool"],
                        "arguments": {"colleague": POISON["colleague"]},
                    }
                }
            },
        }
        message = {
            "eventId": "m-1",
            "eventScene": "message",
            "content": {"role": "user", "text": POISON["message"]},
        }
        async with worker(self.port) as sender:
            acks = [
                await sender.call("kx_chat_event", {"room": ROOM, "event": message}, namespace=NS),
                await sender.call("kx_chat_event", {"room": ROOM, "event": snapshot}, namespace=NS),
                await sender.call("kx_blocks", frame(ROOM, poisoned_blocks()), namespace=NS),
            ]
        return acks

    def send(self) -> list[Any]:
        return self.run(self._send())  # type: ignore[no-any-return]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def demo_web() -> Iterator[int]:
    """The demo's web process (relay + page) as a subprocess on 127.0.0.1."""
    port = free_port()
    env = {"KERNEL_EXT_SECRET": SECRET, "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernel_ext.demo.web", "--port", str(port), "--lang", "en"],
        env=env,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_listening(port, process=proc, what="demo web", timeout=20)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.browser
def test_markup_in_every_field_is_shown_as_text_in_the_browser(demo_web: int) -> None:
    sender = SenderThread(demo_web)
    try:
        with chromium() as browser:
            page = browser.new_page()
            page.set_default_timeout(20_000)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"http://127.0.0.1:{demo_web}/?c={ROOM}&auto=0")
            page.wait_for_selector("body[data-joined='1']")
            acks = sender.send()
            assert acks[:2] == [{"ok": True}, {"ok": True}]
            assert acks[2] == {"ok": True, "accepted": 6, "rejected": 0}
            page.wait_for_selector(".node-tool[data-status='ended']")
            flow = page.locator("#flow")
            for summary in flow.locator("details summary").all():
                summary.click()  # folded content too
            created = flow.evaluate(
                "n => n.querySelectorAll('script,img,iframe,svg,style,object,marquee,a,b,i').length"
            )
            pwned = page.evaluate("window.__kxPwned")
            visible = flow.inner_text()
            text = flow.text_content() or ""
    finally:
        sender.close()
    assert errors == []
    assert created == 0
    assert pwned is None
    for name in ("tool", "thinking", "tool_call", "final", "message", "output", "text"):
        assert POISON[name].strip() in text, name
    assert POISON["final"] in visible
    assert POISON["text"] in visible  # entities not decoded either
    report(
        "intruder: markup and script in every field, worker → relay → demo page (Chromium)",
        fields=len(POISON),
        elements_created=created,
        scripts_run=0 if pwned is None else 1,
    )
