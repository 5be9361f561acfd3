"""A pane's link to its span (the renderer's ``traceUrl`` option) in real headless Chromium.

The page is the shipped example page (``?play=0``), the fixture ``page`` of
tests/web/conftest.py; each test mounts a room of its own with the template under test on
the page's store.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from support.renderer_page import CALL, block, feed

pytestmark = [pytest.mark.browser, pytest.mark.network, pytest.mark.timeout(120)]

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"

MOUNT = """async (template) => {
  const { mountRoom } = await import("./renderer.js");
  const node = document.createElement("div");
  node.id = "traced";
  document.body.append(node);
  const options = template === null ? { locale: "en" } : { locale: "en", traceUrl: template };
  mountRoom(node, window.kx.store, options);
}"""


def traced(seq: int, trace_id: Any = TRACE, *, call_id: str = CALL, **kw: Any) -> dict[str, Any]:
    """A text block carrying ``trace_id`` as its traceId (``...``: none at all)."""
    step = block(seq, "text", {"text": f"step {seq}"}, call_id=call_id, **kw)
    if trace_id is not ...:
        step["block"]["traceId"] = trace_id
    return step


def mount(tab: Any, template: str | None) -> Any:
    """A room of the page's store mounted with ``template`` as its ``traceUrl``."""
    tab.evaluate(MOUNT, template)
    return tab.locator("#traced")


def assert_no_link(room: Any) -> None:
    """The pane's head shows its callId as plain text, and the room holds no link."""
    head = room.locator(".kx-call-id")
    head.wait_for()
    assert room.locator("a").count() == 0
    assert head.text_content() == CALL


def test_the_call_id_links_to_its_span_and_opens_it_in_a_new_tab(page: Any, base_url: str) -> None:
    template = f"{base_url}/example.html?play=0&trace={{traceId}}&span={{spanId}}"
    room = mount(page, template)
    feed(page, traced(1))
    link = room.locator(f"section.kx-pane[data-call-id='{CALL}'] .kx-call-id a.kx-trace")
    expected = f"{base_url}/example.html?play=0&trace={TRACE}&span={CALL}"
    assert link.get_attribute("href") == expected
    assert link.get_attribute("target") == "_blank"
    assert link.get_attribute("rel") == "noopener noreferrer"
    assert link.text_content() == CALL
    with page.context.expect_page() as opened:
        link.click()
    tab = opened.value
    tab.wait_for_load_state()
    assert tab.url == expected
    assert tab.evaluate("window.opener") is None  # noopener: the trace tab cannot reach back
    tab.close()


def test_no_link_without_a_template(page: Any) -> None:
    room = mount(page, None)
    feed(page, traced(1))
    assert_no_link(room)


def test_no_link_until_a_block_brings_the_trace_id(page: Any) -> None:
    room = mount(page, "https://jaeger.example/trace/{traceId}?uiFind={spanId}")
    feed(page, traced(1, ...), traced(2, None), traced(3, "0" * 32), traced(4, TRACE.upper()))
    assert_no_link(room)
    feed(page, traced(5))
    link = room.locator(".kx-call-id a.kx-trace")
    assert link.get_attribute("href") == f"https://jaeger.example/trace/{TRACE}?uiFind={CALL}"
    feed(page, traced(6, "0af7651916cd43dd8448eb211c80319c"))  # a later one changes nothing
    assert link.get_attribute("href") == f"https://jaeger.example/trace/{TRACE}?uiFind={CALL}"


@pytest.mark.parametrize(
    "template",
    [
        "javascript:window.__kxPwned=1//{traceId}",
        "JavaScript:window.__kxPwned=2//{traceId}",
        " javascript:window.__kxPwned=3//{traceId}",
        "java\tscript:window.__kxPwned=4//{traceId}",
        "data:text/html,<script>window.opener.__kxPwned=5</script>{traceId}",
        "/relative/{traceId}",
    ],
)
def test_a_template_that_is_no_web_address_gives_no_link(page: Any, template: str) -> None:
    room = mount(page, template)
    feed(page, traced(1))
    assert_no_link(room)
    assert page.evaluate("window.__kxPwned") is None


def test_markup_in_a_template_stays_in_the_address_encoded(page: Any) -> None:
    template = 'https://x.example/"><img src=x onerror="window.__kxPwned=6">/{traceId}'
    room = mount(page, template)
    feed(page, traced(1))
    link = room.locator("a.kx-trace")
    href = link.get_attribute("href")
    assert href is not None
    assert href.startswith("https://x.example/%22%3E%3Cimg%20src=x")
    assert href.endswith(f"/{TRACE}")
    for character in '"<> ':
        assert character not in href
    assert room.evaluate("node => node.querySelectorAll('img,script,iframe').length") == 0
    assert link.evaluate("node => node.childNodes.length") == 1  # the callId, as text
    assert page.evaluate("window.__kxPwned") is None


def test_hostile_ids_in_blocks_give_no_link(page: Any) -> None:
    room = mount(page, "https://x.example/{traceId}/{spanId}")
    hostile_call = '<b id="x">call</b>'
    feed(
        page,
        traced(1, '"><img src=x onerror="window.__kxPwned=7">'),
        traced(1, TRACE, call_id=hostile_call),  # a valid trace id, a callId that is not a span id
        traced(1, quote("4bf92f35") + "%00" * 12, call_id="53995c3f42cd8ad8"),
    )
    room.locator("section.kx-pane").nth(2).wait_for()
    assert room.locator("a").count() == 0
    assert room.evaluate("node => node.querySelectorAll('img,script,b').length") == 0
    assert page.evaluate("window.__kxPwned") is None
    trace_of = "(callId) => window.kx.store.pane(callId).traceId"
    assert page.evaluate(trace_of, CALL) is None  # a traceId with markup is none
    assert page.evaluate(trace_of, hostile_call) == TRACE  # kept, but no span id to link
