"""``kernel-ext demo`` end to end in real headless Chromium (Debian's chromium, Playwright).

The demo runs as a subprocess (every process of it real); the page opens a conversation by
itself, then the test sends a message through the page's box. It watches, with Playwright
waits on what a MutationObserver records after every DOM change (no sleeps, no timings):
two concurrent calls each streaming into its own pane before any final answer,
thinking folded, the final answers pinned on top with the stream marked ended (已结束), and
one more call filling live after the message. Screenshots go to ``artifacts/``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from network import chromium
from test_demo import PY_REASON, demo

from kernel_ext.demo.script import SECOND_QUESTION

pytestmark = [pytest.mark.browser, pytest.mark.network, pytest.mark.timeout(180)]

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
WAIT_MS = 30_000

# Installed before the page's own scripts: after every DOM change (so after every socket
# message the page handled, whatever the frame rate) it records which tool nodes were seen
# live (blocks shown, final answer not yet) and the most nodes seen live at once.
WATCH = """
window.__kx = { liveBeforeFinal: [], mostLiveAtOnce: 0 };
new MutationObserver(() => {
  let live = 0;
  for (const node of document.querySelectorAll(".node-tool")) {
    const final = node.querySelector(".kx-final");
    if (!final || !final.hidden || node.querySelectorAll(".kx-items > *").length === 0) continue;
    live += 1;
    if (!window.__kx.liveBeforeFinal.includes(node.dataset.callId)) {
      window.__kx.liveBeforeFinal.push(node.dataset.callId);
    }
  }
  window.__kx.mostLiveAtOnce = Math.max(window.__kx.mostLiveAtOnce, live);
}).observe(document, { subtree: true, childList: true, attributes: true, characterData: true });
"""

ENDED = """([nodes, answers]) =>
  document.querySelectorAll(".node-tool[data-status='ended']").length === nodes &&
  document.querySelectorAll(".node-message[data-role='assistant']").length === answers"""

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


def _by_colleague(nodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {node["colleague"]: node for node in nodes}


def _check_ended(node: dict[str, Any], final: str) -> None:
    assert node["status"] == "ended", node
    assert node["finalText"] == final, node
    assert node["finalShown"], node
    assert node["finalPinned"], node  # the final answer sits above the process stream
    assert node["endShown"], node
    assert "已结束" in node["endText"], node


def test_the_page_shows_colleagues_working_live_in_each_calls_pane() -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    ARTIFACTS.mkdir(exist_ok=True)
    with demo("--step-delay", "0.4", "--time-limit", "150") as running:
        running.wait_for("Open http://")
        url = f"http://127.0.0.1:{running.port}/"
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 1100, "height": 960})
            page.add_init_script(WATCH)
            page.set_default_timeout(WAIT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))

            # The page starts the first conversation by itself: two calls at once.
            page.goto(url, timeout=WAIT_MS)
            page.wait_for_function("() => window.__kx.mostLiveAtOnce >= 2")
            page.wait_for_function(ENDED, arg=[2, 1], timeout=WAIT_MS)
            first = _by_colleague(page.evaluate(SUMMARY))
            orders, carrier = first["→ Orders desk"], first["→ Carrier (third-party)"]
            assert orders["callId"] != carrier["callId"]
            live = page.evaluate("() => window.__kx.liveBeforeFinal")
            assert orders["callId"] in live  # blocks were on screen before its answer
            assert carrier["callId"] in live
            for node in (orders, carrier):
                assert node["callId"] == node["paneCallId"]
                assert len(node["callId"]) == 16
            _check_ended(orders, "Order 42 shipped on Monday; it arrives Friday.")
            _check_ended(carrier, "Plain answer without envelopes.")
            assert orders["tools"] == ["search_orders", "fetch_order"]
            assert orders["thinking"] == [{"open": False, "summary": "思考中…"}]
            assert orders["texts"] == ["Order 42 shipped on Monday."]
            assert carrier["tools"] == []
            assert carrier["thinking"] == []
            assert carrier["texts"] == [
                "Reading your question",
                "Looking it up",
                "Writing the answer",
            ]
            page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)

            # A message from the box: one more call, filling live before its answer.
            page.fill("#message", SECOND_QUESTION)
            page.click("#send")
            page.wait_for_function(ENDED, arg=[3, 2], timeout=WAIT_MS)
            nodes = page.evaluate(SUMMARY)
            third = nodes[2]
            assert third["callId"] in page.evaluate("() => window.__kx.liveBeforeFinal")
            assert third["colleague"] == "→ Orders desk"
            assert third["callId"] not in {orders["callId"], carrier["callId"]}
            _check_ended(third, "Order 42 shipped on Monday; it arrives Friday.")
            assert third["thinking"] == [{"open": False, "summary": "思考中…"}]
            assert page.input_value("#message") == ""
            page.screenshot(path=str(ARTIFACTS / "demo-after-message.png"), full_page=True)
            assert errors == []
        running.proc.send_signal(signal.SIGTERM)
        assert running.finish() == 143
