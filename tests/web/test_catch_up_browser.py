"""Catch-up in real Chromium: pages on the official Socket.IO client (the vendored
``socket.io.esm.min.js``) reloaded, taken offline, opened in a second tab, moved to the other
web process behind Redis, in the middle of a call — each pane comes back whole.

* ``kernel-ext demo`` (every process real; also ``--redis`` on a real redis-server) reloaded
  in the middle of its two ``ask_colleague`` calls: the page's text equals that of a tab that
  never reloaded, each pane ends once and goes ``replay`` → ``live``.
* The shipped example page on ``python -m kernel_ext.relay`` processes (one, or two on a real
  redis-server), a worker sending ``kx_blocks`` frames as the loopback sender does:
  offline for 5 s (Playwright's offline mode drops the WebSocket and fails every reconnect
  meanwhile), a second tab, a reload onto the other web process, a terminal published as a
  1,000-block catch-up starts, a stream over the relay's default 1 MiB bound, a refused
  join.

Waits are Playwright's (DOM state, ``wait_for_function``) or :func:`timing.wait_until`; the
only timed thing is the 5 s the browser is offline, the scenario itself.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.browser import Console
from support.demo_helpers import ENDED, PY_REASON, demo
from support.network import LoopThread, RedisServer, chromium
from support.redis_helpers import wait_subscribed
from support.relay_helpers import CALL, HOOKS, NS, RelayProcess, block, frame, worker

from kernel_ext.demo.script import wording

pytestmark = [pytest.mark.browser, pytest.mark.network, pytest.mark.timeout(180)]

WAIT_MS = 30_000

# Installed before a page's own scripts, again on every load: every tool_event_stream block
# its socket receives (and whether the store was catching up then), every join it sends,
# and each pane's modes in order (data-mode, read after every DOM change).
WATCH = """
window.__kx = { blocks: [], joins: [], modes: {} };
const watch = setInterval(() => {
  const page = window.kx || window.kxDemo;
  if (!page || !page.socket) return;
  clearInterval(watch);
  page.socket.on("tool_event_stream", (block) => {
    window.__kx.blocks.push({ block, replaying: page.store.replaying });
  });
  page.socket.onAnyOutgoing((event, request) => {
    if (event === "join_conversation") window.__kx.joins.push(request);
  });
}, 5);
new MutationObserver(() => {
  for (const pane of document.querySelectorAll("section.kx-pane")) {
    const modes = (window.__kx.modes[pane.dataset.callId] ||= []);
    if (pane.dataset.mode && modes.at(-1) !== pane.dataset.mode) modes.push(pane.dataset.mode);
  }
}).observe(document, { subtree: true, childList: true, attributes: true });
"""

BLOCKS = "() => window.__kx.blocks.map((entry) => entry.block)"


def deliveries(blocks: list[dict[str, Any]]) -> Counter[tuple[Any, ...]]:
    """How often each block arrived, by ``(callId, taskId, state, seq)`` (a terminal's seq
    is the caller's own, not ordered among the running blocks: docs/a2a.md)."""
    return Counter(
        (block["callId"], block["taskId"], block["state"], block["envelope"]["seq"])
        for block in blocks
    )


def in_seq_order(blocks: list[dict[str, Any]]) -> bool:
    """Whether each stream's running blocks arrived in seq order."""
    seqs: dict[tuple[Any, str], list[int]] = {}
    for item in blocks:
        if item["state"] == "running":
            seqs.setdefault((item["callId"], item["taskId"]), []).append(item["envelope"]["seq"])
    return all(found == sorted(found) for found in seqs.values())


def terminals_per_call(blocks: list[dict[str, Any]]) -> Counter[Any]:
    return Counter(block["callId"] for block in blocks if block["state"] != "running")


@contextlib.contextmanager
def tabs(count: int) -> Iterator[tuple[list[Any], list[Console]]]:
    """``count`` tabs of one Chromium, each watched (:data:`WATCH`) and its console kept."""
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1100, "height": 900})
        context.add_init_script(WATCH)
        context.set_default_timeout(WAIT_MS)
        pages = [context.new_page() for _ in range(count)]
        yield pages, [Console(page) for page in pages]


# -- the demo ------------------------------------------------------------------------------

# Every tool node shows blocks and none has ended: the calls are under way.
UNDER_WAY = """(nodes) => {
  const found = document.querySelectorAll(".node-tool");
  return found.length === nodes && Array.from(found).every((node) =>
    node.dataset.status === "streaming" && node.querySelectorAll(".kx-items > *").length > 0);
}"""

PANE_TEXTS = """() => Object.fromEntries(Array.from(document.querySelectorAll(".node-tool"))
  .map((node) => [node.dataset.callId, node.innerText]))"""


@pytest.mark.parametrize("through", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_the_demo_reloaded_in_the_middle_of_its_calls_shows_each_pane_whole(
    through: str, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    question = wording("zh").questions[0]
    extra = ["--redis", request.getfixturevalue("redis_server").url] if through == "redis" else []
    # 0.5 s a beat: each call streams for several seconds, long enough to reload in it.
    with demo("--step-delay", "0.5", "--time-limit", "170", *extra) as running:
        running.wait_for("Open http://")
        base = f"http://127.0.0.1:{running.port}"
        with tabs(2) as ((steady, reloaded), consoles):
            # A tab that never reloads starts the conversation (without sending).
            steady.goto(f"{base}/?auto=0")
            steady.wait_for_selector("body[data-joined='1']")
            conversation = steady.evaluate("window.kxDemo.conversationId")
            # Its address names the conversation now: a reload would come back to it.
            assert steady.evaluate("location.search") == f"?c={conversation}"
            reloaded.goto(f"{base}/?c={conversation}")
            reloaded.wait_for_selector("body[data-joined='1']")
            reloaded.fill("#message", question)
            reloaded.click("#send")
            reloaded.wait_for_function(UNDER_WAY, arg=2)
            reloaded.reload()
            reloaded.wait_for_selector("body[data-joined='1']")
            for page in (steady, reloaded):
                page.wait_for_function(ENDED, arg=[2, 1])

            # The same conversation, the question not sent again, the same text throughout.
            assert reloaded.evaluate("window.kxDemo.conversationId") == conversation
            assert reloaded.inner_text("#flow") == steady.inner_text("#flow")
            panes = reloaded.evaluate(PANE_TEXTS)
            assert panes == steady.evaluate(PANE_TEXTS)
            assert len(panes) == 2
            assert reloaded.locator(".node-message[data-role='user']").count() == 1
            # Each pane: every block once, its terminal once; caught up, then live.
            got = reloaded.evaluate("window.__kx.blocks")
            blocks = [entry["block"] for entry in got]
            assert deliveries(blocks) == deliveries(steady.evaluate(BLOCKS))
            assert max(deliveries(blocks).values()) == 1
            assert in_seq_order(blocks)
            assert terminals_per_call(blocks) == Counter(dict.fromkeys(panes, 1))
            assert reloaded.locator(".kx-end:visible").count() == 2
            for call_id in panes:
                replayed = [e["replaying"] for e in got if e["block"]["callId"] == call_id]
                assert replayed[0] is True, replayed  # caught up …
                assert replayed[-1] is False, replayed  # … in the middle of the call
            assert reloaded.evaluate("window.__kx.modes") == {
                call_id: ["replay", "live"] for call_id in panes
            }
            assert reloaded.evaluate("window.__kx.joins") == [
                {"conversationId": conversation, "have": []}
            ]
            for console in consoles:
                assert console.exceptions == []
                assert console.errors == []


# -- the example page on relay processes ---------------------------------------------------------

ROOM = "conv-1"
PANE = f"section.kx-pane[data-call-id='{CALL}']"


class Worker:
    """An internal sender connected to a relay process, sending ``kx_blocks`` frames as the
    loopback sender does, from a loop of its own (this thread is Playwright's)."""

    def __init__(self, runner: LoopThread, port: int) -> None:
        self.runner = runner
        self._stack = contextlib.AsyncExitStack()
        self.client = runner.run(self._stack.enter_async_context(worker(port)))

    def send(self, blocks: list[dict[str, Any]], room: str = ROOM) -> None:
        """Send ``blocks`` (at most 100 a frame); return once the relay emitted them."""
        for start in range(0, len(blocks), 100):
            part = blocks[start : start + 100]
            ack = self.runner.run(
                self.client.call("kx_blocks", frame(room, part), namespace=NS, timeout=20)
            )
            assert ack == {"ok": True, "accepted": len(part), "rejected": 0}, ack

    def close(self) -> None:
        self.runner.run(self._stack.aclose())


@contextlib.contextmanager
def relays(*webs: RelayProcess) -> Iterator[tuple[LoopThread, Worker]]:
    """The relay processes started and ready; a loop and a worker on the first one."""
    runner = LoopThread()
    sender: Worker | None = None
    try:
        for web in webs:
            web.start()
        for web in webs:
            runner.run(web.wait_ready())
        sender = Worker(runner, webs[0].port)
        yield runner, sender
    finally:
        if sender is not None:
            sender.close()
        for web in webs:
            web.stop()
        runner.close()


def page_url(web: RelayProcess, room: str = ROOM, token: str | None = None) -> str:
    """The example page that ``python -m kernel_ext.relay`` serves, following ``room``."""
    auth = f"&token={token}" if token else ""
    return f"http://127.0.0.1:{web.port}/kernel_ext/example.html?conversation={room}{auth}"


def opened(page: Any, url: str) -> Any:
    """``page`` at ``url``, once its join was acknowledged."""
    page.goto(url)
    page.wait_for_selector("body[data-joined='1']")
    return page


def running(first: int, last: int) -> list[dict[str, Any]]:
    """Running blocks ``first`` to ``last`` of the call's stream."""
    return [block(seq) for seq in range(first, last + 1)]


def received(page: Any) -> int:
    return int(page.evaluate("window.__kx.blocks.length"))


def offline_for(page: Any, seconds: float, meanwhile: Callable[[], None]) -> None:
    """The page's browser offline for ``seconds`` — Playwright's offline mode: its
    WebSocket drops and every reconnect fails until it is back — calling ``meanwhile`` once
    the page noticed."""
    page.context.set_offline(True)
    page.wait_for_function("() => !window.kx.socket.connected && window.kx.socket.active")
    back = time.monotonic() + seconds
    meanwhile()
    time.sleep(max(0.0, back - time.monotonic()))  # the scenario: offline this long
    page.context.set_offline(False)


def test_a_page_offline_for_5_s_mid_call_has_no_hole_and_ends_once() -> None:
    web = RelayProcess()
    with relays(web) as (_, sender), tabs(1) as ((page,), consoles):
        opened(page, page_url(web))
        sender.send(running(1, 3))
        page.wait_for_function("() => window.__kx.blocks.length === 3")
        offline_for(page, 5, lambda: sender.send(running(4, 12)))
        page.wait_for_function("() => window.__kx.joins.length === 2")
        page.wait_for_selector(f"{PANE}[data-mode='live']")
        sender.send([*running(13, 14), block(15, state="done", text="the answer")])
        page.locator(f"{PANE} .kx-end").wait_for(state="visible")

        blocks = page.evaluate(BLOCKS)
        assert [b["envelope"]["seq"] for b in blocks] == list(range(1, 16))  # each once
        assert page.evaluate("window.__kx.joins") == [
            {"conversationId": ROOM, "have": []},
            {"conversationId": ROOM, "have": [{"callId": CALL, "taskId": "task-1", "seq": 3}]},
        ]
        pane = page.locator(PANE)
        assert pane.locator(".kx-text").all_inner_texts() == [f"block {n}" for n in range(1, 15)]
        assert pane.locator(".kx-missing").count() == 0
        assert pane.locator(".kx-final-text").inner_text() == "the answer"
        assert page.locator(".kx-end:visible").count() == 1
        # Opened live; caught up after the drop; live again.
        assert page.evaluate("window.__kx.modes") == {CALL: ["live", "replay", "live"]}
        assert consoles[0].exceptions == []


def test_a_second_tab_opened_mid_call_shows_what_the_first_shows() -> None:
    web = RelayProcess()
    with relays(web) as (_, sender), tabs(2) as ((first, second), consoles):
        opened(first, page_url(web))
        sender.send(running(1, 5))
        first.wait_for_function("() => window.__kx.blocks.length === 5")
        opened(second, page_url(web))
        sender.send([*running(6, 8), block(9, state="done", text="the answer")])
        for page in (first, second):
            page.locator(f"{PANE} .kx-end").wait_for(state="visible")

        assert second.locator(PANE).inner_text() == first.locator(PANE).inner_text()
        assert second.evaluate(BLOCKS) == first.evaluate(BLOCKS)  # each once, in order
        caught_up = [e["replaying"] for e in second.evaluate("window.__kx.blocks")]
        assert caught_up == [True] * 5 + [False] * 4
        assert second.evaluate("window.__kx.modes") == {CALL: ["replay", "live"]}
        for console in consoles:
            assert console.exceptions == []


@pytest.mark.redis
def test_a_reload_onto_the_other_web_process_behind_redis_shows_the_same_pane(
    redis_server: RedisServer,
) -> None:
    web1, web2 = (RelayProcess(redis_url=redis_server.url) for _ in range(2))
    with relays(web1, web2) as (runner, sender), tabs(2) as ((steady, moved), consoles):
        runner.run(wait_subscribed(redis_server.url, 2))
        opened(steady, page_url(web1))
        opened(moved, page_url(web1))
        sender.send(running(1, 4))  # the worker is on web 1
        for page in (steady, moved):
            page.wait_for_function("() => window.__kx.blocks.length === 4")
        opened(moved, page_url(web2))  # reloaded, and the balancer sends it to web 2
        sender.send([*running(5, 6), block(7, state="done", text="the answer")])
        for page in (steady, moved):
            page.locator(f"{PANE} .kx-end").wait_for(state="visible")

        assert moved.locator(PANE).inner_text() == steady.locator(PANE).inner_text()
        assert moved.evaluate(BLOCKS) == steady.evaluate(BLOCKS)  # each once, in order
        assert moved.evaluate("window.__kx.modes") == {CALL: ["replay", "live"]}
        for console in consoles:
            assert console.exceptions == []


def test_a_terminal_published_as_a_1000_block_catch_up_starts_is_shown_once() -> None:
    """The terminal goes out as soon as the page's join did: it reaches the relay before the
    join (then it comes in the catch-up, the pane still in "replay") or after it (live, right
    behind the catch-up) — the page shows it once either way (both happen, run to run)."""
    web = RelayProcess()
    with relays(web) as (_, sender), tabs(1) as ((page,), consoles):
        sender.send(running(1, 1_000))
        page.goto(page_url(web))
        page.wait_for_function("() => window.__kx.joins.length === 1")
        sender.send([block(1_001, state="done", text="the answer")])
        page.locator(f"{PANE} .kx-end").wait_for(state="visible")
        page.wait_for_selector(f"{PANE}[data-mode='live']")

        seqs = [b["envelope"]["seq"] for b in page.evaluate(BLOCKS)]
        assert seqs == list(range(1, 1_002))  # the terminal once, last
        pane = page.locator(PANE)
        assert pane.locator(".kx-text").count() == 1_000
        assert pane.locator(".kx-final-text").inner_text() == "the answer"
        assert page.locator(".kx-end:visible").count() == 1
        assert page.evaluate("window.__kx.modes") == {CALL: ["replay", "live"]}
        assert consoles[0].exceptions == []


def test_a_stream_over_the_relays_default_bound_shows_what_is_missing() -> None:
    """20 running blocks of 60,000 characters after a short first one: 1.2 MB, over the
    1 MiB a relay holds of a stream by default; the oldest running blocks gave way."""
    web = RelayProcess()
    with relays(web) as (_, sender), tabs(1) as ((page,), consoles):
        big = [block(seq, text=f"{seq}:" + "x" * 60_000) for seq in range(2, 22)]
        sender.send([block(1, text="first"), *big, block(22, state="done", text="the answer")])
        opened(page, page_url(web))
        page.locator(f"{PANE} .kx-end").wait_for(state="visible")

        seqs = [b["envelope"]["seq"] for b in page.evaluate(BLOCKS)]
        kept = seqs[1:-1]
        gone = 20 - len(kept)
        assert gone > 0
        assert seqs == [1, *range(22 - len(kept), 22), 22]  # first, the newest, terminal
        pane = page.locator(PANE)
        classes = pane.locator(".kx-items > *").evaluate_all(
            "nodes => nodes.map((n) => n.className)"
        )
        assert classes == ["kx-text", "kx-missing", *["kx-text"] * len(kept)]
        assert pane.locator(".kx-missing").inner_text() == f"{gone} 条较早的内容已不可用"
        assert pane.locator(".kx-final-text").inner_text() == "the answer"
        state = page.evaluate("window.kx.store.state()")
        assert [task["missing"] for task in state["panes"][0]["tasks"]] == [gone]
        assert consoles[0].exceptions == []


def test_a_refused_join_shows_nothing_of_the_room() -> None:
    web = RelayProcess(hooks=HOOKS)
    with relays(web) as (_, sender), tabs(2) as ((refused, member), consoles):
        for room in ("conv-of-bob", "conv-of-alice"):
            sender.send(running(1, 3), room=room)
        member_url = page_url(web, "conv-of-alice", "token-of-alice")
        opened(member, member_url)  # the relay does catch up: the member gets its room's
        member.wait_for_function("() => window.__kx.blocks.length === 3")
        refused.goto(page_url(web, "conv-of-bob", "token-of-alice"))
        refused.wait_for_function(
            "() => document.getElementById('connection').textContent.includes('join refused')"
        )
        sender.send(running(4, 4), room="conv-of-bob")  # live, after the refusal
        # A round trip on the refused page's socket: anything sent to it arrived before.
        refused.evaluate(
            """() => window.kx.socket.timeout(10000).emitWithAck(
                 "leave_conversation", { conversationId: "__barrier__" })"""
        )
        status = refused.inner_text("#connection")
        assert status.startswith("conv-of-bob · join refused: forbidden"), status
        assert refused.evaluate("window.__kx.blocks") == []
        assert refused.locator("section.kx-pane").count() == 0
        assert refused.evaluate("window.__kx.joins") == [
            {"conversationId": "conv-of-bob", "have": []}
        ]
        for console in consoles:
            assert console.exceptions == []
