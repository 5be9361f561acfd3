"""The example page ``kernel-ext relay`` serves, in both languages, in a real headless
Chromium that has no CJK font at all (a fontconfig that knows Latin faces only).

The relay runs as a subprocess; the page's address and how to get it in English come from
its start-up line. The page follows a conversation through the relay; two calls are fed to
its store (one with thinking, a tool call and a final answer, one without details); then
every label of both languages is put into a pane (as text and in a tool call's monospace):
what any page of the renderer can show. Every CJK character laid out is drawn by the
package's own face (which font drew each glyph, as Chromium reports it), the labels'
elements do not look like boxes, and the face is loaded whatever the page's language."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.browser import (
    MISSING,
    Console,
    GlyphAudit,
    is_cjk,
    latin_faces_with,
    latin_only_fonts,
    looks_like_boxes,
    undrawn_cjk,
)
from support.cli_helpers import CLI, STARTUP, cli_env
from support.network import chromium, free_port, wait_listening
from support.renderer_page import block, feed, pane, snapshot

from kernel_ext.viewing.view import LABELS
from kernel_ext.web.font import FONT_FAMILY, page_characters

pytestmark = [pytest.mark.browser, pytest.mark.network, pytest.mark.timeout(120)]

WAIT_MS = 20_000
OTHER = "a1b2c3d4e5f60718"

FACE_STATUS = """(family) => Array.from(document.fonts)
  .filter((face) => face.family.replace(/"/g, "") === family)
  .map((face) => face.status)"""

# Every label of every language, into the first pane: as its text and as a tool call's.
EVERY_LABEL = """(texts) => {
  const items = document.querySelector(".kx-pane .kx-items");
  for (const text of texts) {
    for (const className of ["kx-text", "kx-tool-call"]) {
      const node = document.createElement("p");
      node.className = className;
      node.textContent = text;
      items.append(node);
    }
  }
}"""


@contextmanager
def relay() -> Iterator[re.Match[str]]:
    """``kernel-ext relay`` on a free port (open to every browser, on 127.0.0.1): its
    start-up line, matched by :data:`STARTUP`."""
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "relay", "--port", str(port), "--allow-anyone"],
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
    )
    try:
        wait_listening(port, process=proc, what="kernel-ext relay", timeout=30)
        assert proc.stderr is not None
        lines = []  # the start-up line is printed once it listens (a warning before it)
        found = None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            found = re.search(STARTUP, lines[-1])
            if found:
                break
        assert found, lines
        yield found
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _every_label() -> list[str]:
    return [text for labels in LABELS.values() for text in labels.values()]


def _open(browser: Any, url: str) -> tuple[Any, Console]:
    """A page of ``url`` in a browser context of its own (nothing cached), fed two calls:
    one with thinking, a tool call and its answer, one answered without details (shown as
    such after half a second)."""
    context = browser.new_context(viewport={"width": 900, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    console = Console(page)
    page.goto(url + "&timeout=500")
    page.wait_for_selector("body[data-joined='1']")  # through the relay
    feed(
        page,
        snapshot(),
        block(1, "thinking", {"text": "order 42"}),
        block(2, "tool_call", {"name": "search_orders", "args": {"query": "42"}}),
        block(3, "text", {"text": "Order 42 shipped on Tuesday."}, state="done"),
        snapshot(OTHER, toolReturn="No tracking events yet."),
    )
    pane(page).locator(".kx-end").wait_for(state="visible")
    pane(page, OTHER).locator(".kx-empty").wait_for(state="visible")  # after ?timeout=
    for summary in page.locator("details.kx-thinking summary").all():
        summary.click()  # folded thinking, opened, is shown text too
    return page, console


def _check_drawn(page: Any) -> GlyphAudit:
    """The face loaded; every CJK character laid out drawn by it, every label of both
    languages too (put into the first pane); the audit of what the page showed itself."""
    page.evaluate("document.fonts.ready")
    assert page.evaluate(FACE_STATUS, FONT_FAMILY) == ["loaded"]  # whatever the language
    shown = undrawn_cjk(page)
    assert shown.undrawn == []
    chinese = [text for text in _every_label() if any(is_cjk(char) for char in text)]
    assert chinese  # the default labels
    page.evaluate(EVERY_LABEL, _every_label())
    every = undrawn_cjk(page)
    assert every.undrawn == []
    assert len(every.drawn) == len(shown.drawn) + 2 * len(chinese)  # each one laid out
    return shown


def test_the_relays_example_page_draws_its_chinese_and_says_how_to_get_english(
    tmp_path: Path,
) -> None:
    # Only the package's face has these characters here: any it does not draw is a box.
    assert latin_faces_with(page_characters() + MISSING) == {}
    with relay() as startup, chromium(latin_only_fonts(tmp_path)) as browser:
        address, english = startup.group(4), startup.group(5)
        assert address == f"{startup.group(1)}/kernel_ext/example.html?conversation=ID"
        assert english == "English labels: &lang=en"
        chinese_url = address.replace("=ID", "=conv-1")
        english_url = chinese_url + english.split(": ")[1]  # as the line says

        page, console = _open(browser, chinese_url)
        assert page.evaluate("document.documentElement.lang") == "zh-CN"
        shown = _check_drawn(page)
        for label in ("思考中…", "开始", "最终回复", "已结束", "无过程详情"):
            assert label in shown.drawn, label
        for element in (
            pane(page).locator(".kx-final-label"),
            pane(page).locator(".kx-end"),
            pane(page).locator(".kx-thinking summary"),
            pane(page, OTHER).locator(".kx-empty"),
        ):
            assert not looks_like_boxes(element), element
        page.screenshot(path=str(tmp_path / "example-zh.png"), full_page=True)
        assert console.exceptions == []  # (its errors: the relay has no /favicon.ico)
        page.context.close()

        page, console = _open(browser, english_url)
        assert page.evaluate("document.documentElement.lang") == "en"
        assert pane(page).locator(".kx-final-label").inner_text() == "Final answer"
        assert pane(page).locator(".kx-end").inner_text() == "— Ended —"
        assert _check_drawn(page).drawn == []  # no Chinese of its own
        page.screenshot(path=str(tmp_path / "example-en.png"), full_page=True)
        assert console.exceptions == []  # (its errors: the relay has no /favicon.ico)
        page.context.close()
