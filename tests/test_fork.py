"""Workers forked after ``enable()`` (gunicorn ``--preload``, Celery prefork,
``multiprocessing`` with the fork start method): each child's calls reach the browser, each
stream with its one terminal; ``disable()`` in a child returns at once, flushed; the parent's
sender keeps working; what the parent had queued at the fork is sent once, by the parent.

Real processes over 127.0.0.1: the worker is ``tests/fork_worker.py`` in a subprocess (it
forks for real), the relay is uvicorn in this process, the browser a real python-socketio
client.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from network import RedisServer, free_port, need_module, serve_asgi, wait_listening_async
from relay_helpers import SECRET, barrier
from reliability_support import browser_on, one_terminal_last
from test_redis import wait_subscribed

from kernel_ext.relay import allow_all, create_app

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

WORKER = Path(__file__).with_name("fork_worker.py")
CHILDREN = 3


async def run_worker(
    mode: str, port: int, conversation: str, redis_url: str | None = None
) -> tuple[list[dict[str, Any]], str]:
    env = dict(os.environ, KERNEL_EXT_SECRET=SECRET)
    if redis_url is not None:
        env["KERNEL_EXT_TEST_REDIS"] = redis_url
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKER),
        mode,
        f"http://127.0.0.1:{port}",
        conversation,
        str(CHILDREN),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return lines, err.decode()


def done_text(blocks: list[dict[str, Any]]) -> str:
    final = one_terminal_last(blocks)
    assert final["state"] == "done", final
    text: str = final["envelope"]["payload"]["text"]
    return text


def assert_child_calls_arrived(browser: Any, call_ids: list[str]) -> None:
    for index, call_id in enumerate(call_ids, start=1):
        stream = browser.stream(call_id, "t")
        assert [b["state"] for b in stream] == ["running", "running", "done"], stream
        assert done_text(stream) == f"answer {index}"


@pytest.mark.parametrize("mode", ["fork", "fork-thread"])
async def test_children_forked_after_enable_deliver_their_calls_and_disable_at_once(
    mode: str,
) -> None:
    await forked_children_deliver(mode)


@pytest.mark.redis
async def test_children_forked_after_enable_with_the_redis_sender_deliver_their_calls(
    redis_server: RedisServer,
) -> None:
    await forked_children_deliver("fork", redis_server.url)


async def forked_children_deliver(mode: str, redis_url: str | None = None) -> None:
    conversation = f"conv-{mode}"
    ready = create_app(SECRET, authorize_join=allow_all, redis_url=redis_url)
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        if redis_url is not None:
            await wait_subscribed(redis_url, 1)
        lines, err = await run_worker(mode, port, conversation, redis_url)
        children = [line for line in lines if line["who"] == "child" and "call_id" in line]
        starts = [line for line in lines if line["who"] == "child" and "queue_at_start" in line]
        parent = [line for line in lines if line["who"] == "parent"]
        assert len(children) == CHILDREN, (lines, err)
        call_ids = [c["call_id"] for c in sorted(children, key=lambda c: c["index"])]
        expected = [*call_ids, parent[0]["call_id"], parent[-1]["second_call"]]
        await browser.wait_for(
            lambda _: all(
                browser.stream(c) and browser.stream(c)[-1]["state"] != "running" for c in expected
            ),
            timeout=30,
        )
        await barrier(browser, port)

        assert_child_calls_arrived(browser, call_ids)
        # What the parent had queued at the fork is the parent's: sent once, by it.
        assert parent[0]["queued_at_fork"] == 2
        assert all(s["queue_at_start"] == 0 and s["streams_at_start"] == 0 for s in starts)
        first = browser.stream(parent[0]["call_id"], "t")
        assert [b["state"] for b in first] == ["running", "done"]
        assert done_text(first) == "parent answer"
        # The parent's sender still works after the children came and went.
        second = browser.stream(parent[-1]["second_call"], "t")
        assert done_text(second) == "parent second answer"
        assert parent[-1]["statuses"] == [0] * CHILDREN
        assert parent[-1]["flushed"] is True
        # disable() in a child flushed everything within its timeout (a hang would have
        # used it up and reported not flushed), and said nothing alarming.
        assert all(c["flushed"] is True for c in children), children
        assert all(c["counts"].get("unflushed", 0) == 0 for c in children), children
        assert all(c["counts"]["delivered"] == 3 for c in children), children
        assert "Traceback" not in err, err
        assert "TimeoutError" not in err, err
        assert len(browser.blocks) == 3 * CHILDREN + 2 + 2


async def test_a_child_forked_inside_a_call_leaves_that_call_to_the_parent() -> None:
    """The children inherit the parent's running call in their contextvar: what they
    publish for it is dropped (counted ``closed``), never sent as a second stream or a
    second terminal; their own calls arrive."""
    conversation = "conv-fork-in-call"
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        lines, err = await run_worker("fork-in-call", port, conversation)
        children = [line for line in lines if line["who"] == "child" and "call_id" in line]
        parent = [line for line in lines if line["who"] == "parent"]
        assert len(children) == CHILDREN, (lines, err)
        call_ids = [c["call_id"] for c in sorted(children, key=lambda c: c["index"])]
        await browser.wait_for(
            lambda _: all(
                browser.stream(c) and browser.stream(c)[-1]["state"] == "done"
                for c in [*call_ids, parent[-1]["second_call"]]
            ),
            timeout=30,
        )
        await barrier(browser, port)
        assert_child_calls_arrived(browser, call_ids)
        first = browser.stream(parent[0]["call_id"], "t")
        assert [b["envelope"]["payload"].get("text") for b in first] == [
            "parent working",
            "parent answer",
        ]
        assert all(c["counts"]["closed"] == 2 for c in children), children


async def test_a_sigterm_to_a_child_of_an_async_kernel_ends_the_child_not_the_parent() -> None:
    """enable() on a running loop makes the SIGTERM flush a handler of that loop, whose
    wake-up pipe a forked child shares with the parent: the child's SIGTERM must flush and
    end the child, and reach nothing of the parent."""
    conversation = "conv-async-fork"
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        lines, err = await run_worker("async-fork-sigterm", port, conversation)
        (child,) = [line for line in lines if line["who"] == "child"]
        (parent,) = [line for line in lines if line["who"] == "parent"]
        await browser.wait_for(
            lambda _: all(
                browser.stream(c) and browser.stream(c)[-1]["state"] == "done"
                for c in (child["call_id"], parent["second_call"])
            ),
            timeout=30,
        )
        await barrier(browser, port)
        assert_child_calls_arrived(browser, [child["call_id"]])
        assert parent["child_signal"] == signal.SIGTERM
        assert parent["flushed"] is True
        assert done_text(browser.stream(parent["second_call"], "t")) == "parent second answer"
        assert "SIGTERM; flushing the sender" in err


@pytest.mark.parametrize("mode", ["pool-join", "pool-exit", "spawn", "forkserver"])
async def test_a_multiprocessing_pool_delivers_every_childs_call(mode: str) -> None:
    """Nobody calls disable() in the pool's children: they flush when they end (their
    finalizers after close()+join(), the SIGTERM flush when the pool terminates them);
    spawn and forkserver children enable afresh at import."""
    conversation = f"conv-{mode}"
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        lines, err = await run_worker(mode, port, conversation)
        (results,) = [line["results"] for line in lines if "results" in line]
        assert all(r["enabled"] for r in results), results
        assert len({r["pid"] for r in results}) >= 1
        call_ids = [r["call_id"] for r in sorted(results, key=lambda r: r["index"])]
        await browser.wait_for(
            lambda _: all(
                browser.stream(c) and browser.stream(c)[-1]["state"] == "done" for c in call_ids
            ),
            timeout=30,
        )
        await barrier(browser, port)
        assert_child_calls_arrived(browser, call_ids)
        assert "Traceback" not in err, err


async def test_gunicorn_preload_workers_deliver_their_calls() -> None:
    """``gunicorn --preload``: the application (and its ``enable()``) is imported in the
    master, the workers that serve the requests are forked from it."""
    need_module("gunicorn", "pip install gunicorn")
    conversation = "conv-gunicorn"
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        web = free_port()
        env = dict(
            os.environ,
            KERNEL_EXT_SECRET=SECRET,
            KERNEL_EXT_TEST_RELAY=f"http://127.0.0.1:{port}",
            KERNEL_EXT_TEST_CONV=conversation,
        )
        proc = start_gunicorn(web, env)
        try:
            await wait_listening_async(web, process=proc, what="gunicorn", timeout=30)
            answers = [
                await asyncio.to_thread(get, f"http://127.0.0.1:{web}/call/{index}")
                for index in range(1, 7)
            ]
            call_ids = [answer.split()[0] for answer in answers]
            await browser.wait_for(
                lambda _: all(
                    browser.stream(c) and browser.stream(c)[-1]["state"] == "done" for c in call_ids
                ),
                timeout=30,
            )
            await barrier(browser, port)
        finally:
            proc.terminate()
            _, err = await asyncio.to_thread(proc.communicate, timeout=30)
        for index, call_id in enumerate(call_ids, start=1):
            stream = browser.stream(call_id, "t")
            assert [b["state"] for b in stream] == ["running", "running", "done"], stream
            assert done_text(stream) == f"answer {index}"
        assert {answer.split()[1] for answer in answers} != {str(proc.pid)}
        assert b"Traceback" not in err, err.decode()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as response:
        body: bytes = response.read()
    return body.decode()


def start_gunicorn(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "gunicorn", "--preload", "--workers", "2"]
    command += ["--bind", f"127.0.0.1:{port}", "gunicorn_app:app"]
    return subprocess.Popen(
        command,
        cwd=Path(__file__).parent,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
