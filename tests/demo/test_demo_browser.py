"""``kernel-ext demo`` end to end in real headless Chromium (Debian's chromium, Playwright).

The demo runs as a subprocess (every process of it real, ``--fast``); the page talks
through the vendored official Socket.IO client. The page opens a conversation by itself,
then the test sends a message through the page's box. It watches, with Playwright waits on
what a MutationObserver records after every DOM change (no sleeps, no timings): two
concurrent calls each streaming into its own pane before any final answer, thinking
folded, the final answers pinned on top with the stream marked ended (已结束), and one more
call filling live after the message. Three ways in:

* over WebSocket (the client starts on long-polling and upgrades), in Chinese (a Chinese
  browser, no ``--lang``), with the agent on each kernel (``--kernel pydantic-ai``, the
  default, and ``langgraph``);
* behind a proxy that refuses WebSocket upgrades: the client stays on long-polling and the
  page works the same;
* with ``--lang en`` in a Chinese browser: ``<html lang="en">`` and no Chinese character in
  the visible text but the switch's "中文".

Then the page's language: an English browser gets the English page, whose switch reloads it
in Chinese in the same conversation, the follow-up answered in Chinese; and, in a Chromium
that has no CJK font at all, every Chinese character of the Chinese page and of the English
one (its switch's "中文") drawn in the page's own font (which font drew each glyph, as
Chromium reports it, and screenshots compared with boxes).

No console error and no uncaught exception in any of them (behind the proxy, only the
browser's own report of the refused WebSocket handshake). Screenshots go to ``artifacts/``.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support import ROOT
from support.browser import (
    MISSING,
    Console,
    latin_faces_with,
    latin_only_fonts,
    looks_like_boxes,
    undrawn_cjk,
)
from support.demo_helpers import CJK, ENDED, PY_REASON, Demo, demo
from support.network import chromium, no_websocket_proxy
from support.renderer_page import CJK_FACES

from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK
from kernel_ext.demo.script import DEFAULT_KERNEL, KERNELS, wording
from kernel_ext.web.font import FONT_FAMILY, page_characters

pytestmark = [pytest.mark.browser, pytest.mark.network, pytest.mark.timeout(180)]

ARTIFACTS = ROOT / "artifacts"
WAIT_MS = 30_000
REFUSED_WEBSOCKET = re.compile(r"^WebSocket connection to 'ws://127\.0\.0\.1:\d+/socket\.io/")

# Installed before the page's own scripts: after every DOM change (so after every socket
# message the page handled, whatever the frame rate) it records which tool nodes were seen
# live (blocks shown, final answer not yet), the most nodes seen live at once, and the
# nodes seen live with a stop button in their pane.
WATCH = """
window.__kx = { liveBeforeFinal: [], mostLiveAtOnce: 0, stopWhileLive: [] };
new MutationObserver(() => {
  let live = 0;
  for (const node of document.querySelectorAll(".node-tool")) {
    const final = node.querySelector(".kx-final");
    if (!final || !final.hidden || node.querySelectorAll(".kx-items > *").length === 0) continue;
    live += 1;
    if (!window.__kx.liveBeforeFinal.includes(node.dataset.callId)) {
      window.__kx.liveBeforeFinal.push(node.dataset.callId);
    }
    const stop = node.querySelector(".kx-pane .kx-head button.kx-stop");
    if (stop && !stop.disabled && !window.__kx.stopWhileLive.includes(node.dataset.callId)) {
      window.__kx.stopWhileLive.push(node.dataset.callId);
    }
  }
  window.__kx.mostLiveAtOnce = Math.max(window.__kx.mostLiveAtOnce, live);
}).observe(document, { subtree: true, childList: true, attributes: true, characterData: true });
"""

SUMMARY = """() => Array.from(document.querySelectorAll(".node-tool")).map((node) => {
  const final = node.querySelector(".kx-final");
  const stream = node.querySelector(".kx-stream");
  const end = node.querySelector(".kx-end");
  const thinking = Array.from(node.querySelectorAll("details.kx-thinking"));
  return {
    callId: node.dataset.callId,
    paneCallId: node.querySelector(".kx-pane").dataset.callId,
    colleague: (node.querySelector(".node-arg") || {}).textContent || null,
    status: node.dataset.status,
    finalText: final.querySelector(".kx-final-text").textContent,
    finalShown: !final.hidden && final.offsetHeight > 0,
    finalPinned: Boolean(final.compareDocumentPosition(stream) & Node.DOCUMENT_POSITION_FOLLOWING),
    endShown: !end.hidden && end.offsetHeight > 0,
    endText: end.textContent,
    tools: Array.from(node.querySelectorAll(".kx-tool-name")).map((n) => n.textContent),
    texts: Array.from(node.querySelectorAll(".kx-text")).map((n) => n.textContent),
    thinking: thinking.map((d) => ({
      open: d.open, summary: d.querySelector("summary").textContent,
    })),
  };
})"""

TRANSPORT = "() => document.getElementById('connection').dataset.transport"


@contextmanager
def demo_page(
    running: Demo,
    port: int | None = None,
    locale: str = "zh-CN",
    env: dict[str, str] | None = None,
) -> Iterator[tuple[Any, Console]]:
    """A Chromium page on the demo (through ``port`` when given, e.g. a proxy's), with the
    watcher installed, once the demo printed its URL; the browser's language is ``locale``
    (``navigator.languages``), its process environment ``env``."""
    running.wait_for("Open http://")
    with chromium(env) as browser:
        page = browser.new_page(viewport={"width": 1100, "height": 960}, locale=locale)
        page.add_init_script(WATCH)
        page.set_default_timeout(WAIT_MS)
        console = Console(page)
        page.goto(f"http://127.0.0.1:{port or running.port}/", timeout=WAIT_MS)
        page.wait_for_function("() => document.body.dataset.ready === '1'")
        yield page, console


def _by_colleague(nodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {node["colleague"]: node for node in nodes}


def _check_ended(node: dict[str, Any], final: str, ended: str = "已结束") -> None:
    assert node["status"] == "ended", node
    assert node["finalText"] == final, node
    assert node["finalShown"], node
    assert node["finalPinned"], node  # the final answer sits above the process stream
    assert node["endShown"], node
    assert ended in node["endText"], node


def _check_first_question(page: Any, lang: str, thinking: str, ended: str) -> list[str]:
    """The page's own first question: two calls, both ended with their colleague's work
    and final answer; returns their callIds."""
    words = wording(lang)
    page.wait_for_function(ENDED, arg=[2, 1], timeout=WAIT_MS)
    first = _by_colleague(page.evaluate(SUMMARY))
    orders = first[f"→ {words.title('orders')}"]
    carrier = first[f"→ {words.title('carrier')}"]
    assert orders["callId"] != carrier["callId"]
    for node in (orders, carrier):
        assert node["callId"] == node["paneCallId"]
        assert len(node["callId"]) == 16
    orders_script, carrier_script = ORDERS_DESK[lang], CARRIER[lang]
    _check_ended(orders, orders_script.answer, ended)
    _check_ended(carrier, carrier_script.answer, ended)
    assert orders["tools"] == ["search_orders", "fetch_order", "track_parcel"]
    assert orders["thinking"] == [{"open": False, "summary": thinking}] * 3
    assert orders["texts"] == [
        step.payload["text"] for step in orders_script.steps if step.kind == "text"
    ]
    assert carrier["tools"] == []
    assert carrier["thinking"] == []
    assert carrier["texts"] == [step.text for step in carrier_script.steps]
    return [orders["callId"], carrier["callId"]]


def _send_second_question(page: Any, lang: str, ended: str) -> dict[str, Any]:
    """A message from the box: one more call, to the orders desk, ended; returns it."""
    words = wording(lang)
    page.fill("#message", words.questions[1])
    page.click("#send")
    page.wait_for_function(ENDED, arg=[3, 2], timeout=WAIT_MS)
    third = page.evaluate(SUMMARY)[2]
    assert third["colleague"] == f"→ {words.title('orders')}"
    # It asked on which day order 42 shipped, and that is what it is answered.
    _check_ended(third, ORDERS_DESK[lang].reply(words.questions[1])[1], ended)
    answers = page.locator(".node-message[data-role='assistant'] .bubble").all_inner_texts()
    assert ORDERS_DESK[lang].reply(words.questions[1])[1] in answers[-1]
    assert page.input_value("#message") == ""
    return third  # type: ignore[no-any-return]


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_page_shows_colleagues_working_live_in_each_calls_pane(kernel: str) -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    if kernel == "langgraph":
        pytest.importorskip("langgraph", reason="--kernel langgraph needs langgraph")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = "" if kernel == DEFAULT_KERNEL else f"-{kernel}"
    with demo("--fast", "--kernel", kernel, "--time-limit", "150") as running:
        with demo_page(running) as (page, console):
            assert page.evaluate("document.documentElement.lang") == "zh-CN"
            family = page.evaluate("getComputedStyle(document.body).fontFamily")
            assert [face for face in CJK_FACES if face not in family] == [], family
            # The official client starts on long-polling and upgrades to WebSocket.
            page.wait_for_function(f"() => ({TRANSPORT})() === 'websocket'")
            assert page.evaluate("window.kxDemo.socket.io.engine.transport.name") == "websocket"
            assert page.evaluate("typeof window.kxDemo.socket.emitWithAck") == "function"
            # The page starts the first conversation by itself: two calls at once.
            page.wait_for_function("() => window.__kx.mostLiveAtOnce >= 2")
            first = _check_first_question(page, "zh", "思考中…", "已结束")
            live = page.evaluate("() => window.__kx.liveBeforeFinal")
            assert set(first) <= set(live)  # blocks were on screen before each answer
            # The demo turns the panes' stop control on: there while each call ran, gone after.
            assert set(first) <= set(page.evaluate("() => window.__kx.stopWhileLive"))
            assert page.locator(".node-tool .kx-stop").count() == 0
            page.screenshot(path=str(ARTIFACTS / f"demo{shot}.png"), full_page=True)

            third = _send_second_question(page, "zh", "已结束")
            assert third["callId"] in page.evaluate("() => window.__kx.liveBeforeFinal")
            assert third["callId"] not in first
            steps, _ = ORDERS_DESK["zh"].reply(wording("zh").questions[1])
            thought = sum(1 for step in steps if step.kind == "thinking")
            assert third["thinking"] == [{"open": False, "summary": "思考中…"}] * thought
            assert page.evaluate(TRANSPORT) == "websocket"
            page.screenshot(path=str(ARTIFACTS / f"demo{shot}-after-message.png"), full_page=True)
            assert console.exceptions == []
            assert console.errors == []
        running.proc.send_signal(signal.SIGTERM)
        assert running.finish() == 143


def test_behind_a_proxy_that_blocks_websocket_the_page_works_on_long_polling() -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    with demo("--fast", "--time-limit", "150") as running:
        running.wait_for("Open http://")
        with (
            no_websocket_proxy(running.port) as proxy,
            demo_page(running, proxy.port) as (
                page,
                console,
            ),
        ):
            first = _check_first_question(page, "zh", "思考中…", "已结束")
            third = _send_second_question(page, "zh", "已结束")
            assert third["callId"] not in first
            # The client tried to upgrade, was refused, and stayed on long-polling.
            assert proxy.refused >= 1
            assert proxy.forwarded >= 3
            assert page.evaluate(TRANSPORT) == "polling"
            assert page.evaluate("window.kxDemo.socket.io.engine.transport.name") == "polling"
            assert console.exceptions == []
            unexpected = [e for e in console.errors if not REFUSED_WEBSOCKET.match(e)]
            assert unexpected == []
        running.proc.send_signal(signal.SIGTERM)
        assert running.finish() == 143


def test_with_lang_en_the_page_is_english_and_shows_no_chinese() -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    ARTIFACTS.mkdir(exist_ok=True)
    with demo("--fast", "--lang", "en", "--time-limit", "150") as running:
        with demo_page(running) as (page, console):
            assert page.evaluate("document.documentElement.lang") == "en"
            _check_first_question(page, "en", "Thinking…", "Ended")
            _send_second_question(page, "en", "Ended")
            for summary in page.locator("details.kx-thinking summary").all():
                summary.click()  # folded thinking, opened, is visible text too
            assert page.locator("#langs button").all_inner_texts() == ["中文", "English"]
            assert page.get_attribute("#langs [aria-current='true']", "data-lang") == "en"
            page.evaluate("document.getElementById('langs').style.display = 'none'")
            visible = page.evaluate("document.body.innerText")
            page.evaluate("document.getElementById('langs').style.display = ''")
            assert CJK.findall(visible) == []
            assert CJK.findall(page.title()) == []
            assert page.input_value("#message") == ""
            placeholder = page.get_attribute("#message", "placeholder")
            assert placeholder == wording("en").page["placeholder"]
            assert "--lang en" in page.inner_text("#tail-command")
            page.screenshot(path=str(ARTIFACTS / "demo-en.png"), full_page=True)
            assert console.exceptions == []
            assert console.errors == []
        running.proc.send_signal(signal.SIGTERM)
        assert running.finish() == 143


def test_the_page_speaks_the_browsers_language_and_its_switch_keeps_the_conversation() -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    with demo("--fast", "--time-limit", "150") as running:  # no --lang
        with demo_page(running, locale="en-US") as (page, console):
            assert page.evaluate("navigator.languages") == ["en-US"]
            assert page.evaluate("document.documentElement.lang") == "en"
            assert page.title() == wording("en").page["title"]
            _check_first_question(page, "en", "Thinking…", "Ended")
            address = page.evaluate("location.search")
            assert page.get_attribute("#langs [aria-current='true']", "data-lang") == "en"

            # The switch: the same conversation, reloaded in Chinese, not asked again.
            with page.expect_navigation():
                page.click("#langs button[data-lang='zh']")
            page.wait_for_function("() => document.body.dataset.joined === '1'")
            assert page.evaluate("document.documentElement.lang") == "zh-CN"
            assert page.evaluate("location.search") == f"{address}&lang=zh"
            page.wait_for_function(ENDED, arg=[2, 1], timeout=WAIT_MS)  # its history, back
            states = page.locator(".node-tool .node-state").all_inner_texts()
            assert states == ["已结束", "已结束"]  # the pane's labels follow the page
            placeholder = page.get_attribute("#message", "placeholder")
            assert placeholder == wording("zh").page["placeholder"]
            # What the user clicks is Chinese now, and so is the answer to it.
            assert page.locator(".suggestion").all_inner_texts() == [wording("zh").questions[1]]
            third = _send_second_question(page, "zh", "已结束")
            assert third["texts"]
            assert all(CJK.search(text) for text in third["texts"])
            users = page.locator(".node-message[data-role='user']").all_inner_texts()
            assert len(users) == 2  # the first question was not sent again

            # A language the demo does not speak in the address: the browser's again.
            page.goto(page.url.replace("lang=zh", "lang=fr"))
            page.wait_for_function("() => document.body.dataset.ready === '1'")
            assert page.evaluate("document.documentElement.lang") == "en"
            # A browser that prefers no language the demo speaks: English.
            french = page.context.browser.new_page(locale="fr-FR")
            french.goto(f"http://127.0.0.1:{running.port}/?auto=0")
            french.wait_for_function("() => document.body.dataset.ready === '1'")
            assert french.evaluate("navigator.languages") == ["fr-FR"]
            assert french.evaluate("document.documentElement.lang") == "en"
            french.close()
            assert console.exceptions == []
            assert console.errors == []
        running.proc.send_signal(signal.SIGTERM)
        assert running.finish() == 143


PROBE = """() => {
  const probe = document.createElement("span");
  probe.id = "probe";
  probe.style.cssText = "position: fixed; top: 8px; left: 8px; font-size: 40px; background: #fff;";
  document.body.append(probe);
}"""

FACE_STATUS = """(family) => Array.from(document.fonts)
  .filter((face) => face.family.replace(/"/g, "") === family)
  .map((face) => face.status)"""


def test_both_languages_render_in_the_pages_own_font_without_any_cjk_font_on_the_machine(
    tmp_path: Path,
) -> None:
    """Chinese, then the same conversation in English in a browser that never saw the page:
    every CJK character the page lays out (its words, the panes' labels and what the
    colleagues said, thinking opened, the placeholder, the switch's "中文") is drawn by the
    page's own face, and the elements that hold them do not look like boxes."""
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    # Only the page's face has these characters: any it does not draw is a box.
    assert latin_faces_with(page_characters() + MISSING) == {}
    env = latin_only_fonts(tmp_path)
    ARTIFACTS.mkdir(exist_ok=True)
    with demo("--fast", "--time-limit", "150") as running:
        with demo_page(running, locale="zh-CN", env=env) as (page, console):
            _check_first_question(page, "zh", "思考中…", "已结束")
            page.evaluate("document.fonts.ready")
            assert page.evaluate(FACE_STATUS, FONT_FAMILY) == ["loaded"]
            # 订 and 单 are in the page's font; 龘 and 齉 in no font Chromium has here.
            page.evaluate(PROBE)  # one place for each character, in the page's fonts
            probe = page.locator("#probe")
            shots = []
            for char in ("订", "单", MISSING, "齉"):
                probe.evaluate("(node, char) => { node.textContent = char; }", char)
                shots.append(probe.screenshot())
            ding, dan, missing, missing_too = shots
            tofu = missing == missing_too  # no CJK font: every such character is one box
            assert tofu
            drawn_apart = ding != dan  # the page's own font draws each character
            assert drawn_apart
            assert [shot == missing for shot in (ding, dan)] == [False, False]
            probe.evaluate("(node) => node.remove()")
            # What the page laid out itself is drawn too, not boxes: each element's picture
            # differs from the same element holding as many characters no font has.
            for selector in ("#send", "#langs [aria-current='true']", ".kx-tool-start", ".who"):
                element = page.locator(selector).first
                assert CJK.search(element.inner_text()), selector
                assert not looks_like_boxes(element), selector
            for summary in page.locator("details.kx-thinking summary").all():
                summary.click()  # folded thinking, opened, is shown text too
            audit = undrawn_cjk(page)
            assert audit.undrawn == []
            shown = "".join(audit.drawn)
            for text in ("已结束", "思考中…", wording("zh").page["placeholder"], "中文"):
                assert text in shown, text
            page.screenshot(path=str(ARTIFACTS / "demo-zh-without-cjk-fonts.png"), full_page=True)
            conversation = page.evaluate("window.kxDemo.conversationId")

            # English, first visit (a browser context of its own: nothing cached).
            context = page.context.browser.new_context(
                viewport={"width": 1100, "height": 960}, locale="en-US"
            )
            english = context.new_page()
            english.set_default_timeout(WAIT_MS)
            english_console = Console(english)
            english.goto(f"http://127.0.0.1:{running.port}/?c={conversation}&lang=en")
            english.wait_for_function("() => document.body.dataset.joined === '1'")
            english.wait_for_function(ENDED, arg=[2, 1], timeout=WAIT_MS)
            assert english.evaluate("document.documentElement.lang") == "en"
            assert english.locator("#langs button").all_inner_texts() == ["中文", "English"]
            # Loaded though the page is English: the switch shows "中文".
            assert english.evaluate(FACE_STATUS, FONT_FAMILY) == ["loaded"]
            assert not looks_like_boxes(english.locator("#langs button[data-lang='zh']"))
            audit = undrawn_cjk(english)
            assert audit.undrawn == []
            # The switch, and the conversation so far: it was in Chinese.
            assert audit.drawn[0] == "中文"
            assert wording("zh").questions[0] in audit.drawn
            english.screenshot(
                path=str(ARTIFACTS / "demo-en-without-cjk-fonts.png"), full_page=True
            )
            context.close()
            assert english_console.exceptions == []
            assert english_console.errors == []
            assert console.exceptions == []
            assert console.errors == []
        running.proc.send_signal(signal.SIGTERM)
        assert running.finish() == 143
