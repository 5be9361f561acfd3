"""The renderer's stop control in real headless Chromium, on the shipped example page following
a conversation live (``?conversation=…&stop=1``) over the vendored official Socket.IO client.

The server is a stand-in for the relay's side of ``stop_call`` (``support.stop_helpers``: a
real python-socketio server on 127.0.0.1 that records each request and acknowledges it with
the answer a test chose); the blocks reach the page through it, as the relay's would.
Whether a request was *not* sent is read after a later event of the same connection arrived
(Socket.IO keeps a connection's order): a ``probe`` the page emits, or the next join.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from support.renderer_page import block, snapshot
from support.stop_helpers import CALL, CONV, NO_ACK, StandInRelay, stand_in_relay

pytestmark = [pytest.mark.browser, pytest.mark.network, pytest.mark.timeout(120)]

WAIT_MS = 20_000
PROBE = "(n) => window.kx.socket.emit('probe', n)"


def running(call_id: str = CALL, seq: int = 1) -> dict[str, Any]:
    return dict(block(seq, "text", {"text": f"working on it ({seq})"}, call_id=call_id)["block"])


def pane(page: Any, call_id: str = CALL) -> Any:
    return page.locator(f"section.kx-pane[data-call-id='{call_id}']")


@contextlib.contextmanager
def example(
    browser: Any, relay: StandInRelay, *, stop: bool = True, lang: str = "en"
) -> Iterator[Any]:
    """The example page following :data:`CONV` on ``relay``, joined; page errors fail."""
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    query = f"conversation={CONV}&lang={lang}" + ("&stop=1" if stop else "")
    try:
        page.goto(f"{relay.url}/example.html?{query}")
        page.wait_for_selector("body[data-joined='1']")
        yield page
        assert errors == []
        assert page.evaluate("window.__kxPwned") is None
    finally:
        context.close()


def sent_nothing_more(page: Any, relay: StandInRelay, stops: int, probe: int = 1) -> None:
    """The page emits a probe; once it arrived, no request beyond the first ``stops`` did."""
    page.evaluate(PROBE, probe)
    relay.wait_for("probes", probe)
    assert len(relay.stops) == stops, relay.stops


def test_the_control_is_on_a_running_pane_only_when_the_page_turns_it_on(browser: Any) -> None:
    with stand_in_relay() as relay:
        with example(browser, relay, stop=False) as page:
            relay.emit_block(running())
            pane(page).locator("p.kx-text").wait_for()
            assert pane(page).locator(".kx-stop, .kx-stop-box").count() == 0
            assert pane(page).get_attribute("data-stop") is None
        with example(browser, relay) as page:
            relay.emit_block(running())
            button = pane(page).locator(".kx-head button.kx-stop")
            button.wait_for()
            assert button.is_visible()
            assert button.is_enabled()
            assert button.evaluate("node => [node.tagName, node.type]") == ["BUTTON", "button"]
            assert button.inner_text() == "Stop"
            assert button.get_attribute("aria-label") == "Stop this call"
            assert pane(page).get_attribute("data-stop") == "idle"
        assert relay.stops == []


def test_one_click_sends_one_request_and_says_stopping_until_the_terminal(browser: Any) -> None:
    with stand_in_relay() as relay, example(browser, relay, lang="zh") as page:
        relay.emit_block(running())
        button = pane(page).locator("button.kx-stop")
        assert button.inner_text() == "停止"
        assert button.get_attribute("aria-label") == "停止这次调用"
        button.click()
        assert relay.wait_for("stops", 1) == [{"v": 1, "room": CONV, "callId": CALL}]
        page.wait_for_selector(f"section.kx-pane[data-call-id='{CALL}'][data-stop='stopping']")
        assert button.is_disabled()
        assert button.inner_text() == "正在停止…"
        assert button.get_attribute("aria-label") == "正在停止…"
        assert not pane(page).locator(".kx-stop-note").is_visible()
        # A second click (forced onto the disabled button) and more blocks send nothing.
        button.click(force=True)
        relay.emit_block(running(seq=2))
        pane(page).locator("p.kx-text").nth(1).wait_for()
        assert button.is_disabled()
        sent_nothing_more(page, relay, stops=1)
        # The terminal: the control goes.
        relay.emit_block(dict(block(3, "text", {"message": "stopped"}, state="aborted")["block"]))
        pane(page).locator(".kx-end").wait_for(state="visible")
        assert pane(page).locator(".kx-stop, .kx-stop-box").count() == 0
        assert pane(page).get_attribute("data-stop") is None
        sent_nothing_more(page, relay, stops=1, probe=2)


# One pane per acknowledgement: what its note says, and whether its button is back.
HOSTILE_REASON = "<img src=x onerror=window.__kxPwned=1> rate limit"
ANSWERS: list[tuple[str, Any, str, bool]] = [
    ("a000000000000001", {"answer": "already_ended"}, "The call had already ended", False),
    ("a000000000000002", {"answer": "unknown"}, "Unknown call", True),
    (
        "a000000000000003",
        {"answer": "refused", "reason": HOSTILE_REASON},
        f"You may not stop this call ({HOSTILE_REASON})",
        True,
    ),
    (
        "a000000000000004",
        {"answer": "unreachable", "reason": "r" * 300},
        f"No worker reachable ({'r' * 200}…)",
        True,
    ),
    ("a000000000000005", {"answer": "yes"}, "No usable answer to the stop request", True),
    ("a000000000000006", "stopping", "No usable answer to the stop request", True),
    ("a000000000000007", {}, "No usable answer to the stop request", True),
]


def test_each_answer_other_than_stopping_is_shown_in_its_pane(browser: Any) -> None:
    answers = {call_id: ack for call_id, ack, _, _ in ANSWERS}
    with stand_in_relay(answers=answers) as relay, example(browser, relay) as page:
        for call_id, *_ in ANSWERS:
            relay.emit_block(running(call_id))
            pane(page, call_id).locator("button.kx-stop").click()
        relay.wait_for("stops", len(ANSWERS))
        for call_id, _, text, back in ANSWERS:
            note = pane(page, call_id).locator(".kx-stop-note")
            note.wait_for(state="visible")
            assert note.inner_text() == text, call_id
            assert note.get_attribute("role") == "status"
            button = pane(page, call_id).locator("button.kx-stop")
            if back:
                assert button.is_enabled(), call_id
                assert button.inner_text() == "Stop", call_id
            else:
                assert button.count() == 0, call_id
        assert pane(page, ANSWERS[0][0]).get_attribute("data-stop") == "over"
        assert page.locator("#panes img").count() == 0
        assert Counter(stop["callId"] for stop in relay.stops) == dict.fromkeys(answers, 1)
        # A button that is back sends again; the next answer replaces the note.
        relay.answers["a000000000000002"] = {"answer": "stopping"}
        pane(page, "a000000000000002").locator("button.kx-stop").click()
        relay.wait_for("stops", len(ANSWERS) + 1)
        page.wait_for_selector(
            "section.kx-pane[data-call-id='a000000000000002'][data-stop='stopping']"
        )
        assert not pane(page, "a000000000000002").locator(".kx-stop-note").is_visible()


def test_no_answer_within_the_timeout_is_a_failure_the_pane_says(browser: Any) -> None:
    with stand_in_relay(answer=NO_ACK) as relay, example(browser, relay) as page:
        relay.emit_block(running())
        # Until an answer comes the control says the stop is under way, and takes no click.
        button = pane(page).locator("button.kx-stop")
        button.click()
        relay.wait_for("stops", 1)
        assert pane(page).get_attribute("data-stop") == "sending"
        assert button.is_disabled()
        assert button.inner_text() == "Stopping…"
        button.click(force=True)
        sent_nothing_more(page, relay, stops=1)
        # The page's own pane, with a short wait for the answer.
        page.evaluate(
            """async (call) => {
              const { mountPane, stopSender } = await import("./renderer.js");
              const host = document.createElement("div");
              host.id = "short";
              document.body.append(host);
              const stop = stopSender(window.kx.socket, "conv-1", { timeoutMs: 500 });
              mountPane(host, window.kx.store, call, { locale: "en", stop });
            }""",
            CALL,
        )
        page.locator("#short button.kx-stop").click()
        relay.wait_for("stops", 2)
        note = page.locator("#short .kx-stop-note")
        note.wait_for(state="visible")
        assert note.inner_text() == "No usable answer to the stop request"
        assert page.locator("#short button.kx-stop").is_enabled()


def test_the_control_goes_when_the_tool_returns(browser: Any) -> None:
    with stand_in_relay() as relay, example(browser, relay) as page:
        relay.emit("chat_event", snapshot(CALL)["snapshot"])
        button = pane(page).locator("button.kx-stop")
        button.wait_for()  # a call that has begun, without blocks yet, runs
        returned = snapshot(CALL, toolReturn="the answer")["snapshot"]
        relay.emit("chat_event", returned)
        pane(page).locator(".kx-final-text").wait_for()
        assert pane(page).locator(".kx-stop, .kx-stop-box").count() == 0
        assert pane(page).get_attribute("data-stop") is None


def test_a_click_while_disconnected_sends_nothing_and_says_so(browser: Any) -> None:
    with stand_in_relay() as relay, example(browser, relay) as page:
        relay.emit_block(running())
        button = pane(page).locator("button.kx-stop")
        button.wait_for()
        page.context.set_offline(True)
        page.wait_for_function("() => !window.kx.socket.connected && window.kx.socket.active")
        button.click()
        note = pane(page).locator(".kx-stop-note")
        note.wait_for(state="visible")
        assert note.inner_text() == "Not connected: the stop was not sent"
        assert note.get_attribute("data-answer") == "offline"
        assert button.is_enabled()
        # Back online: the client re-joins and sends what it buffered — no stop request.
        page.context.set_offline(False)
        relay.wait_for("joins", 2)
        sent_nothing_more(page, relay, stops=0)


def test_hostile_call_ids_get_no_control_and_never_become_html(browser: Any) -> None:
    markup = "<img src=x onerror=window.__kxPwned=2>"
    hostile = ["\ud800", markup, "f" * 100_000, "00F067AA0BA902B7"]  # no span id among them
    with stand_in_relay() as relay, example(browser, relay) as page:
        for call_id in [*hostile, CALL]:
            relay.emit_block(running(call_id))
        pane(page).locator("button.kx-stop").wait_for()
        assert page.locator("section.kx-pane").count() == len(hostile) + 1
        assert page.locator("button.kx-stop").count() == 1  # the span id's pane only
        assert page.locator("#panes img").count() == 0
        shown = page.locator("section.kx-pane").nth(1)
        assert shown.get_attribute("data-call-id") == markup
        assert shown.locator(".kx-call-id").inner_text() == markup
        pane(page).locator("button.kx-stop").click()
        assert relay.wait_for("stops", 1) == [{"v": 1, "room": CONV, "callId": CALL}]
