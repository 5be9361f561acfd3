"""Stopping one colleague from its pane, in ``kernel-ext demo``, end to end in real headless
Chromium (issue 35, points 1, 4, 5 and 6): every process of the demo real, the colleagues
a2a-sdk servers, the agent the pydantic-ai worker.

The page asks both colleagues; Chromium clicks the stop button in the carrier's pane while
the carrier works. Then: the carrier's A2A task is ``canceled`` at its a2a-sdk server
(``tasks/get`` over the wire), the carrier's pane gets exactly one terminal, ``aborted``
and stopped, and its node reads 已停止; the orders desk's pane goes on to ``done``; the
agent's reply arrives, quotes the orders desk and says the carrier was stopped — in Chinese
and in English.

Behind Redis the same, with the browser that clicks on a second web process of its own (the
worker connected to the demo's): the stop crosses Redis to the web process that owns the
call, and everything else crosses back.

The test waits on the page's state and on the socket's blocks (Playwright waits), and polls
the colleague's task and the second web process's readiness with a deadline; no sleep
synchronises anything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.browser import Console
from support.demo_helpers import PY_REASON, Demo, demo
from support.network import RedisServer, chromium, free_port, started

from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK
from kernel_ext.demo.script import wording

WAIT_MS = 60_000
STEP_DELAY = "1.0"  # seconds per beat: each call takes about 10 s, time enough to click stop

# Every tool_event_stream block the page's socket receives, by callId: its states.
RECORD = """() => {
  window.__blocks = {};
  window.kxDemo.socket.on("tool_event_stream", (block) => {
    for (const b of Array.isArray(block) ? block : [block]) {
      if (!b || typeof b.callId !== "string") continue;
      (window.__blocks[b.callId] = window.__blocks[b.callId] || []).push(b.state);
    }
  });
}"""

# The tool node of the colleague titled `title`, as the page shows it.
NODE = """(title) => Array.from(document.querySelectorAll(".node-tool")).find(
  (node) => (node.querySelector(".node-arg") || {}).textContent === `→ ${title}`)"""

STOPPABLE = f"""(title) => {{
  const node = ({NODE})(title);
  if (!node || node.querySelectorAll(".kx-items > *").length === 0) return false;
  const button = node.querySelector(".kx-pane .kx-head button.kx-stop");
  return Boolean(button && !button.disabled);
}}"""

NODE_STATE = f"""(title) => {{
  const node = ({NODE})(title);
  if (!node) return null;
  const pane = window.kxDemo.store.pane(node.dataset.callId);
  return {{
    callId: node.dataset.callId,
    status: node.dataset.status,
    outcome: node.dataset.outcome || "",
    label: node.querySelector(".node-state").textContent,
    stopControls: node.querySelectorAll(".kx-stop").length,
    tasks: pane ? pane.toJSON().tasks.map((t) => ({{ taskId: t.taskId, outcome: t.outcome }})) : [],
    states: window.__blocks[node.dataset.callId] || [],
  }};
}}"""

ENDED_BOTH = f"""([orders, carrier]) => {{
  const ended = (title) => {{
    const node = ({NODE})(title);
    return Boolean(node) && node.dataset.status === "ended";
  }};
  return ended(orders) && ended(carrier) &&
    document.querySelectorAll(".node-message[data-role='assistant']").length === 1;
}}"""


def _colleague_url(running: Demo, key: str) -> str:
    """The URL of the demo's colleague ``key``, read from its process's command line."""
    for line in running.err:
        match = re.search(rf"colleague-{key} started \(pid (\d+)\)", line)
        if match:
            argv = Path(f"/proc/{match.group(1)}/cmdline").read_bytes().split(b"\0")
            port = argv[argv.index(b"--port") + 1].decode()
            return f"http://127.0.0.1:{port}/"
    raise AssertionError(f"no colleague-{key} in the demo's output")


def _task_state_at_peer(url: str, task_id: str) -> int:
    """The A2A task's state as its a2a-sdk server reports it (``tasks/get``)."""
    from a2a.client import create_client
    from a2a.types import GetTaskRequest

    async def ask() -> int:
        client = await create_client(url)
        try:
            task = await client.get_task(GetTaskRequest(id=task_id))
        finally:
            await client.close()
        return int(task.status.state)

    # Playwright's sync API runs an event loop in this thread: the client runs in another.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, ask()).result(timeout=30)


def _until_canceled(url: str, task_id: str, timeout: float = 30) -> int:
    """Poll the peer until the task is ``canceled`` or ``timeout`` passed; its last state.
    (The pane's terminal leaves before the worker's ``tasks/cancel``.)"""
    from a2a.types import TaskState

    deadline = time.monotonic() + timeout
    while True:
        state = _task_state_at_peer(url, task_id)
        if state == TaskState.TASK_STATE_CANCELED or time.monotonic() > deadline:
            return state
        time.sleep(0.1)  # the poll's pace


def _until_ready(port: int, timeout: float = 60) -> None:
    """Poll the web process at ``port`` until its relay is ready (``/readyz``)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the web process on {port} was not ready in time"
        time.sleep(0.1)  # the poll's pace


@contextmanager
def _page(browser: Any, port: int, conversation: str, locale: str) -> Iterator[tuple[Any, Console]]:
    """A page of the conversation ``conversation`` on the web process at ``port`` (it sends
    nothing by itself), joined, its socket's blocks recorded."""
    page = browser.new_page(viewport={"width": 1100, "height": 960}, locale=locale)
    page.set_default_timeout(WAIT_MS)
    console = Console(page)
    page.goto(f"http://127.0.0.1:{port}/?c={conversation}", timeout=WAIT_MS)
    page.wait_for_function("() => document.body.dataset.ready === '1'")
    page.evaluate(RECORD)
    page.wait_for_function("() => document.body.dataset.joined === '1'")
    yield page, console
    page.close()


def _stop_the_carrier_and_check(
    asking: Any, stopping: Any, running: Demo, lang: str, consoles: list[Console]
) -> None:
    """``asking`` asks both colleagues; ``stopping`` (the same page or another) stops the
    carrier from its pane; then everything the module docstring says."""
    words = wording(lang)
    orders, carrier = words.title("orders"), words.title("carrier")
    asking.fill("#message", words.questions[0])
    asking.click("#send")
    stopping.wait_for_function(STOPPABLE, arg=carrier, timeout=WAIT_MS)
    stopping.evaluate(
        f"(title) => ({NODE})(title).querySelector('button.kx-stop').click()", carrier
    )
    for page in {id(p): p for p in (asking, stopping)}.values():
        page.wait_for_function(ENDED_BOTH, arg=[orders, carrier], timeout=WAIT_MS)

    carrier_url = _colleague_url(running, "carrier")
    for page in {id(p): p for p in (asking, stopping)}.values():
        stopped = page.evaluate(NODE_STATE, carrier)
        assert stopped["outcome"] == "stopped", stopped
        assert stopped["label"] == ("已停止" if lang == "zh" else "Stopped"), stopped
        assert stopped["stopControls"] == 0, stopped
        [task] = stopped["tasks"]
        assert task["outcome"] == "stopped", stopped
        # The pane ended once: one terminal, the stopped aborted block.
        assert [s for s in stopped["states"] if s != "running"] == ["aborted"], stopped
        went_on = page.evaluate(NODE_STATE, orders)
        assert (went_on["status"], went_on["outcome"]) == ("ended", ""), went_on
        assert [t["outcome"] for t in went_on["tasks"]] == ["done"], went_on
        assert [s for s in went_on["states"] if s != "running"] == ["done"], went_on
        [reply] = page.locator(".node-message[data-role='assistant'] .bubble").all_inner_texts()
        assert f"{orders}{words.colon}{ORDERS_DESK[lang].answer}" in reply
        assert words.stopped_one.format(title=carrier) in reply
        assert CARRIER[lang].answer not in reply
    from a2a.types import TaskState

    assert _until_canceled(carrier_url, task["taskId"]) == TaskState.TASK_STATE_CANCELED
    for console in consoles:
        assert console.exceptions == []
        assert console.errors == []


@pytest.mark.browser
@pytest.mark.network
@pytest.mark.timeout(240)
@pytest.mark.parametrize("lang", ["zh", "en"])
def test_chromium_stops_one_colleague_and_the_agent_answers_with_the_other(lang: str) -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    locale = "zh-CN" if lang == "zh" else "en-US"
    with demo("--step-delay", STEP_DELAY, "--time-limit", "200") as running:
        running.wait_for("Open http://")
        with (
            chromium() as browser,
            _page(browser, running.port, f"demo-stop-{lang}", locale) as (
                page,
                console,
            ),
        ):
            _stop_the_carrier_and_check(page, page, running, lang, [console])


@pytest.mark.browser
@pytest.mark.network
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_behind_redis_a_browser_on_another_web_process_stops_the_colleague(
    redis_server: RedisServer,
) -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)
    with demo(
        "--redis", redis_server.url, "--step-delay", STEP_DELAY, "--time-limit", "200"
    ) as running:
        running.wait_for("Open http://")
        started("network")
        other_port = free_port()
        # A second web process of the demo on the same Redis, with no worker of its own.
        other = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kernel_ext.demo.web",
                "--port",
                str(other_port),
                "--redis",
                redis_server.url,
            ],
            env={**os.environ, "KERNEL_EXT_SECRET": "s" * 40},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            _until_ready(other_port)
            with chromium() as browser:
                conversation = "demo-stop-redis"
                with (
                    _page(browser, other_port, conversation, "zh-CN") as (stopping, console),
                    _page(browser, running.port, conversation, "zh-CN") as (asking, asked),
                ):
                    _stop_the_carrier_and_check(asking, stopping, running, "zh", [console, asked])
        finally:
            other.terminate()
            other.wait(timeout=20)
