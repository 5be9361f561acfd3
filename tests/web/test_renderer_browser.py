"""The DOM renderer in real headless Chromium (Debian's chromium, driven by Playwright).

The page is the shipped example page, served from the installed package's web directory
on 127.0.0.1, with ``?play=0`` so each test feeds ``window.kx.store`` itself.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from support import ROOT, TESTS
from support.renderer_page import CALL, CJK_FACES, WAIT_MS, block, feed, pane, snapshot
from support.vectors import VECTOR_FILES, load

from kernel_ext.web.font import FONT_FAMILY

pytestmark = [pytest.mark.browser, pytest.mark.network, pytest.mark.timeout(120)]

ARTIFACTS = ROOT / "artifacts"


def test_every_vector_passes_in_chromium_too(page: Any) -> None:
    vectors = [load(path) for path in VECTOR_FILES]
    results = page.evaluate(
        """async (vectors) => {
          const { PaneStore } = await import("./renderer.js");
          return vectors.map((vector) => {
            let now = 0;
            const store = new PaneStore({ timeoutMs: vector.options.timeoutMs, clock: () => now });
            const checkpoints = [];
            for (const step of vector.steps) {
              if ("block" in step) store.applyBlock(step.block);
              else if ("snapshot" in step) store.applySnapshot(step.snapshot);
              else if ("tick" in step) { now = Math.max(now, step.tick); store.tick(now); }
              else if ("join" in step) checkpoints.push({ have: store.beginReplay() });
              else if ("ack" in step) store.endReplay(step.ack);
              else checkpoints.push(store.state());
            }
            return { checkpoints, final: store.state() };
          });
        }""",
        vectors,
    )
    for vector, result in zip(vectors, results, strict=True):
        expected = [
            step.get("expect", step.get("join"))
            for step in vector["steps"]
            if "expect" in step or "join" in step
        ]
        assert result["checkpoints"] == expected, vector["name"]
        assert result["final"] == vector["expect"], vector["name"]


def test_thinking_is_one_folded_line_that_expands(page: Any) -> None:
    feed(
        page,
        snapshot(),
        block(1, "thinking", {"text": "first thought"}),
        block(2, "thinking", {"text": "second thought"}),
        block(3, "text", {"text": "visible text"}),
    )
    thinking = pane(page).locator("details.kx-thinking")
    assert thinking.count() == 1  # consecutive thinking blocks fold into one line
    summary = thinking.locator("summary")
    assert summary.inner_text() == "思考中…"
    assert summary.bounding_box()["height"] < 30  # one line
    assert not thinking.locator("text=first thought").is_visible()
    assert pane(page).locator("p.kx-text", has_text="visible text").is_visible()
    summary.click()
    assert thinking.evaluate("node => node.open") is True
    assert thinking.locator("p", has_text="first thought").is_visible()
    assert thinking.locator("p", has_text="second thought").is_visible()
    # Expanded stays expanded while more blocks arrive.
    feed(page, block(4, "thinking", {"text": "third thought"}))
    feed(page, block(5, "text", {"text": "after"}))
    assert pane(page).locator("details.kx-thinking").nth(0).evaluate("node => node.open")


def test_tool_call_is_one_line_with_name_and_start_marker(page: Any) -> None:
    feed(page, snapshot(), block(1, "tool_call", {"name": "search_orders", "args": {"q": 1}}))
    line = pane(page).locator(".kx-tool-call")
    assert line.inner_text() == "▶ search_orders 开始"
    assert line.bounding_box()["height"] < 30


def test_progress_blocks_are_one_bar_showing_the_latest_report(page: Any) -> None:
    feed(
        page,
        snapshot(),
        block(1, "progress", {"progress": 1, "total": 4, "message": "page 1 of 4"}),
        block(3, "progress", {"progress": 3, "total": 4, "message": "<b>page</b> 3 of 4"}),
        block(2, "progress", {"progress": 2, "total": 4, "message": "page 2 of 4"}),
    )
    bars = pane(page).locator(".kx-progress")
    assert bars.count() == 1  # a run of progress blocks is one bar
    bar = bars.locator("progress.kx-progress-bar")
    assert bar.evaluate("node => [node.value, node.max, node.position]") == [3, 4, 0.75]
    assert bars.locator(".kx-progress-count").inner_text() == "3/4 · 75%"
    assert bars.locator(".kx-progress-text").inner_text() == "<b>page</b> 3 of 4"  # as text
    assert bars.locator("b").count() == 0
    assert bars.first.bounding_box()["height"] < 30  # one line
    # Another kind in between starts a new bar; no total: indeterminate, the count alone.
    feed(page, block(4, "text", {"text": "between"}), block(5, "progress", {"progress": 7}))
    assert bars.count() == 2
    second = bars.nth(1)
    assert second.locator("progress").evaluate("node => node.position") == -1  # indeterminate
    assert second.locator(".kx-progress-count").inner_text() == "7"
    # Over the total: clamped; the terminal pins the answer.
    feed(
        page,
        block(6, "progress", {"progress": 12, "total": 10}),
        block(7, "text", {"text": "crawled 4 pages"}, state="done"),
    )
    assert second.locator("progress").evaluate("node => [node.value, node.max]") == [10, 10]
    assert second.locator(".kx-progress-count").inner_text() == "12/10 · 100%"
    assert pane(page).locator(".kx-final-text").inner_text() == "crawled 4 pages"


def test_final_answer_is_pinned_on_top_and_stream_marked_ended(page: Any) -> None:
    feed(
        page,
        snapshot(),
        block(1, "text", {"text": "working on it"}),
        block(2, "text", {"text": "still working"}),
    )
    assert pane(page).get_attribute("data-status") == "streaming"
    assert not pane(page).locator(".kx-final").is_visible()
    assert not pane(page).locator(".kx-end").is_visible()
    feed(page, block(3, "text", {"text": "The answer is 42."}, state="done"))
    feed(page, block(4, "text", {"text": "late block"}))  # after the terminal: ignored
    final = pane(page).locator(".kx-final")
    final.wait_for(state="visible")
    assert final.locator(".kx-final-label").inner_text() == "最终回复"
    assert final.locator(".kx-final-text").inner_text() == "The answer is 42."
    stream = pane(page).locator(".kx-stream")
    assert final.bounding_box()["y"] < stream.bounding_box()["y"]
    end = pane(page).locator(".kx-end")
    assert end.is_visible()
    assert end.inner_text() == "— 已结束 —"
    assert pane(page).get_attribute("data-status") == "ended"
    assert pane(page).get_attribute("data-mode") == "live"
    assert pane(page).locator(".kx-status").inner_text() == "已结束"
    assert pane(page).locator("p.kx-text").all_inner_texts() == ["working on it", "still working"]


def test_aborted_call_pins_its_message_marked_aborted(page: Any) -> None:
    feed(
        page,
        snapshot(),
        block(1, "thinking", {"text": "t"}),
        block(2, "text", {"message": "the colleague failed"}, state="aborted"),
    )
    final = pane(page).locator(".kx-final")
    assert final.get_attribute("data-from") == "aborted"
    assert final.locator(".kx-final-label").inner_text() == "已中止"
    assert final.locator(".kx-final-text").inner_text() == "the colleague failed"
    assert pane(page).locator(".kx-end").is_visible()


def test_stopped_call_pins_its_message_marked_stopped_not_aborted(page: Any) -> None:
    feed(
        page,
        snapshot(),
        block(1, "thinking", {"text": "t"}),
        block(2, "text", {"message": "stopped by the user", "stopped": True}, state="aborted"),
    )
    final = pane(page).locator(".kx-final")
    assert final.get_attribute("data-from") == "stopped"
    assert final.locator(".kx-final-label").inner_text() == "已停止"
    assert final.locator(".kx-final-text").inner_text() == "stopped by the user"
    colour = final.evaluate("node => getComputedStyle(node).borderLeftColor")
    assert colour == "rgb(140, 149, 159)"  # grey: not the red of a failure
    assert pane(page).locator(".kx-end").is_visible()


def test_output_area_is_monospace_and_follows_its_tail(page: Any) -> None:
    feed(page, snapshot(), block(1, "tool_call", {"name": "run"}))
    feed(
        page, *[block(seq, "tool_output_append", {"text": f"line {seq}\n"}) for seq in range(2, 80)]
    )
    output = pane(page).locator("pre.kx-output")
    assert output.count() == 1  # consecutive chunks share one terminal area
    assert "monospace" in output.evaluate("node => getComputedStyle(node).fontFamily")
    metrics = "node => [node.scrollTop, node.clientHeight, node.scrollHeight]"
    top, height, total = output.evaluate(metrics)
    assert total > height  # it overflows, so following the tail means scrolling
    assert top + height >= total - 4
    assert output.text_content().endswith("line 78\nline 79\n")
    # Scrolled up by the reader: new output does not yank the view down.
    output.evaluate("node => { node.scrollTop = 0; }")
    feed(page, block(80, "tool_output_append", {"text": "line 80\n"}))
    assert output.evaluate("node => node.scrollTop") == 0
    # Back at the bottom: it follows again.
    output.evaluate("node => { node.scrollTop = node.scrollHeight; }")
    feed(
        page,
        *[block(seq, "tool_output_append", {"text": f"line {seq}\n"}) for seq in range(81, 90)],
    )
    top, height, total = output.evaluate(metrics)
    assert top + height >= total - 4
    assert output.text_content().endswith("line 88\nline 89\n")


def test_markup_in_every_field_is_shown_as_text(page: Any) -> None:
    vector = load(TESTS / "vectors" / "html_text.json")
    steps = [step for step in vector["steps"] if "expect" not in step]
    feed(page, *steps)
    room = page.locator("#panes")
    room.locator("details.kx-thinking summary").click()  # expanded content too
    created = room.evaluate(
        "node => node.querySelectorAll('script,img,iframe,svg,style,object,marquee,a,b,i').length"
    )
    assert created == 0
    assert page.evaluate("window.__kxPwned") is None
    text = room.text_content()
    state = vector["expect"]
    expected_pane = state["panes"][0]
    task = expected_pane["tasks"][0]
    shown = [
        expected_pane["callId"],
        expected_pane["tool"],
        expected_pane["final"]["text"],
        task["taskId"],
        state["orphans"][0]["text"],
        task["items"][4]["envelopeKind"],
        *[item.get("text") or item.get("tool") for item in task["items"]],
    ]
    for literal in shown:
        assert literal in text
    # What a reader sees is the literal text, entities not decoded.
    visible = room.inner_text()
    assert "<script>window.__kxPwned=5</script>&lt;not an entity&gt; &amp;" in visible
    assert '<img src=x onerror="window.__kxPwned=7"> is the answer' in visible
    # The data-* attributes carry the raw strings, never markup.
    assert room.locator("section.kx-pane").get_attribute("data-call-id") == expected_pane["callId"]


def test_no_details_after_the_timeout_with_final_answer_from_tool_return(
    page: Any, base_url: str
) -> None:
    page.goto(f"{base_url}/example.html?play=0&lang=en")
    page.wait_for_selector("body[data-ready='1']")
    feed(page, snapshot())
    assert pane(page).locator(".kx-status").inner_text() == "Calling…"
    assert not pane(page).locator(".kx-empty").is_visible()
    page.evaluate("() => window.kx.store.tick(Date.now() + 60000)")
    feed(page, snapshot(toolReturn="Answer from the tool's return value."))
    empty = pane(page).locator(".kx-empty")
    empty.wait_for(state="visible")
    assert empty.inner_text() == "No process details"
    assert pane(page).locator(".kx-final-text").inner_text() == (
        "Answer from the tool's return value."
    )
    assert pane(page).locator(".kx-final-label").inner_text() == "Final answer"


def test_example_page_plays_a_conversation_and_screenshot(browser: Any, base_url: str) -> None:
    context = browser.new_context(viewport={"width": 900, "height": 1000})
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        # English labels: the screenshot stays readable on machines without CJK fonts.
        page.goto(f"{base_url}/example.html?lang=en")
        first = pane(page)
        first.locator(".kx-end").wait_for(state="visible")
        second = pane(page, "a1b2c3d4e5f60718")
        second.locator(".kx-empty").wait_for(state="visible")
        assert first.locator(".kx-final-text").inner_text().startswith("Order 42 shipped")
        assert first.locator(".kx-tool-call").inner_text() == "▶ search_orders started"
        first.locator("details.kx-thinking summary").click()
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "renderer-example.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 0
        assert json.loads(json.dumps(page.evaluate("window.kx.store.state()")))["panes"]
    finally:
        context.close()


def test_the_pane_and_the_page_fall_back_to_common_cjk_fonts(page: Any) -> None:
    feed(page, snapshot())
    pane(page).wait_for()
    families = {
        "pane": pane(page).evaluate("node => getComputedStyle(node).fontFamily"),
        "body": page.evaluate("getComputedStyle(document.body).fontFamily"),
        "--kx-font": page.evaluate(
            "getComputedStyle(document.documentElement).getPropertyValue('--kx-font')"
        ),
    }
    for where, family in families.items():
        faces = [face.strip().strip('"') for face in family.split(",")]
        for face in CJK_FACES:
            assert face in faces, (where, family)
        assert faces[-2:] == ["sans-serif", FONT_FAMILY], (where, family)
        assert faces.index("system-ui") < faces.index("PingFang SC"), (where, family)


# -- catch-up --------------------------------------------------------------------------------

MISSING_NOTICE = ".kx-items > .kx-missing"


def test_a_pane_says_it_catches_up_until_the_join_is_acknowledged(page: Any) -> None:
    feed(page, snapshot(), block(1, "text", {"text": "before the reconnect"}))
    mode = pane(page).locator(".kx-mode")
    assert pane(page).get_attribute("data-mode") == "live"
    assert not mode.is_visible()
    page.evaluate("() => window.kx.store.beginReplay()")
    assert pane(page).get_attribute("data-mode") == "replay"
    assert mode.is_visible()
    assert mode.inner_text() == "同步中…"
    feed(page, block(2, "text", {"text": "caught up"}))
    page.evaluate("() => window.kx.store.endReplay({ ok: true })")
    assert pane(page).get_attribute("data-mode") == "live"
    assert not mode.is_visible()
    texts = pane(page).locator("p.kx-text").all_inner_texts()
    assert texts == ["before the reconnect", "caught up"]


def test_missing_blocks_show_a_notice_where_they_are_missing(page: Any, base_url: str) -> None:
    page.goto(f"{base_url}/example.html?play=0&lang=en")
    page.wait_for_selector("body[data-ready='1']")
    page.evaluate("() => window.kx.store.beginReplay()")
    # The relay kept the stream's first block and its newest: a thinking run on both sides.
    feed(
        page,
        snapshot(),
        block(1, "thinking", {"text": "first thought"}),
        block(5, "thinking", {"text": "fifth thought"}),
        block(6, "text", {"text": "newest text"}),
    )
    missing = [{"callId": CALL, "taskId": "task-1", "blocks": 3}]
    page.evaluate(
        "(missing) => window.kx.store.endReplay({ ok: true, replay: { missing } })", missing
    )
    items = pane(page).locator(".kx-items > *")
    classes = items.evaluate_all("nodes => nodes.map((node) => node.className)")
    assert classes == ["kx-thinking", "kx-missing", "kx-thinking", "kx-text"]
    notice = pane(page).locator(MISSING_NOTICE)
    assert notice.is_visible()
    assert notice.inner_text() == "3 earlier blocks are no longer available"
    assert notice.get_attribute("data-missing") == "3"
    # Live again: a later block goes after the notice, which stays where it is.
    feed(page, block(7, "thinking", {"text": "seventh"}))
    classes = items.evaluate_all("nodes => nodes.map((node) => node.className)")
    assert classes == ["kx-thinking", "kx-missing", "kx-thinking", "kx-text", "kx-thinking"]


def test_the_missing_notice_holds_only_text_whatever_the_ack_or_labels(page: Any) -> None:
    """Hostile acknowledgements and labels cannot put markup into the page: the count is an
    integer or the entry is ignored, and every word goes in as text."""
    result = page.evaluate(
        """async (call) => {
          const { PaneStore, mountPane } = await import("./renderer.js");
          const store = new PaneStore();
          const host = document.createElement("div");
          document.body.append(host);
          const missing = "<img src=x onerror=window.__kxPwned=9>{n}";
          mountPane(host, store, call, { labels: { missing } });
          store.beginReplay();
          store.applyBlock({ v: 1, callId: call, taskId: "t", state: "running", ts: 1,
                             envelope: { v: 1, kind: "text", seq: 1, payload: { text: "x" } } });
          store.endReplay({ ok: true, replay: { missing: [
            { callId: call, taskId: "t", blocks: "<b>7</b>" },
            { callId: call, taskId: "<script>window.__kxPwned=1</script>", blocks: 2 },
            { callId: "<img src=x onerror=window.__kxPwned=2>", taskId: "t", blocks: 2 },
            { callId: call, taskId: "t", blocks: 1e300 },
            { callId: call, taskId: "t", blocks: 9007199254740991 },
            { callId: call, taskId: "t", blocks: 5 },
          ] } });
          const notice = host.querySelector(".kx-missing");
          return {
            text: notice.textContent,
            elements: host.querySelectorAll("img,script,b").length,
            ignored: store.dropped.ignoredAck,
          };
        }""",
        CALL,
    )
    assert result == {
        "text": "<img src=x onerror=window.__kxPwned=9>9007199254740991",
        "elements": 0,
        "ignored": 4,
    }
    assert page.evaluate("window.__kxPwned") is None


def test_a_catch_up_renders_once_per_frame_and_whole_at_the_ack(page: Any) -> None:
    """1,000 blocks of a catch-up cost one render per animation frame, not one per block:
    with the page's frames held back, the whole burst waits for the next frame, and the
    acknowledgement renders the rest at once."""
    result = page.evaluate(
        """(call) => {
          const frames = [];
          window.requestAnimationFrame = (fn) => frames.push(fn);
          window.cancelAnimationFrame = () => {};
          const store = window.kx.store;
          const texts = () =>
            Array.from(document.querySelectorAll("p.kx-text"), (p) => p.textContent);
          const text = (seq) => ({
            v: 1, callId: call, taskId: "task-1", state: "running", ts: 1,
            envelope: { v: 1, kind: "text", seq, payload: { text: `#${seq}` } },
          });
          store.beginReplay();
          for (let seq = 1; seq <= 1000; seq += 1) store.applyBlock(text(seq));
          const beforeFrame = [texts().length, frames.length];
          frames.shift()();
          const afterFrame = [texts().length, frames.length];
          store.applyBlock(text(1001));
          const pendingAgain = frames.length;
          store.endReplay({ ok: true });
          const shown = texts();
          const ends = [shown[0], shown.at(-1)];
          return { beforeFrame, afterFrame, pendingAgain, atAck: shown.length, ends };
        }""",
        CALL,
    )
    # The first block opened the pane (rendered at once); 999 more wait for one frame.
    assert result["beforeFrame"] == [1, 1]
    assert result["afterFrame"] == [1000, 0]
    assert result["pendingAgain"] == 1
    assert result["atAck"] == 1001  # the ack renders what waited, without a frame
    assert result["ends"] == ["#1", "#1001"]
    assert pane(page).get_attribute("data-mode") == "live"
