"""Workers forked after ``enable()`` (gunicorn ``--preload``, Celery prefork,
``multiprocessing`` with the fork start method): each child's calls reach the browser, each
stream with its one terminal; ``disable()`` in a child returns at once, flushed; the parent's
sender keeps working; what the parent had queued at the fork is sent once, by the parent.

Real processes over 127.0.0.1: the worker is ``tests/support/fork_worker.py`` in a subprocess (it
forks for real), the relay is uvicorn in this process, the browser a real python-socketio
client. Each scenario runs ``KERNEL_EXT_RELIABILITY_RUNS`` times (3 in CI, 20 in the soak)
and reports its figures (docs/reliability.md).
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
from support import SUPPORT
from support.network import RedisServer, free_port, need_module, serve_asgi, wait_listening_async
from support.redis_helpers import wait_subscribed
from support.relay_helpers import SECRET, barrier, run_script, terminals
from support.reliability_helpers import RUNS, WatchedBrowser, browser_on, one_terminal_last, report
from support.timing import wait_until

from kernel_ext.relay import allow_all, create_app

pytestmark = [pytest.mark.network, pytest.mark.timeout(60 + 40 * RUNS)]

WORKER = SUPPORT / "fork_worker.py"
CHILDREN = 3


async def run_worker(
    mode: str, port: int, conversation: str, run: int = 0, redis_url: str | None = None
) -> tuple[list[dict[str, Any]], str]:
    env = {"KERNEL_EXT_TEST_REDIS": redis_url} if redis_url is not None else None
    url = f"http://127.0.0.1:{port}"
    code, out, err = await run_script(
        WORKER, mode, url, conversation, str(CHILDREN), str(run), env=env, timeout=90
    )
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def done_text(blocks: list[dict[str, Any]]) -> str:
    final = one_terminal_last(blocks)
    assert final["state"] == "done", final
    text: str = final["envelope"]["payload"]["text"]
    return text


def assert_child_calls_arrived(browser: WatchedBrowser, call_ids: list[str]) -> None:
    for index, call_id in enumerate(call_ids, start=1):
        stream = browser.stream(call_id, "t")
        assert [b["state"] for b in stream] == ["running", "running", "done"], stream
        assert done_text(stream) == f"answer {index}"


async def ended(browser: WatchedBrowser, call_ids: list[str]) -> None:
    """Each call's stream has its terminal at the browser (then a barrier: nothing more of
    them is on its way)."""
    await browser.wait_for(
        lambda _: all(terminals(browser.stream(c)) for c in call_ids),
        timeout=30,
    )


def who(lines: list[dict[str, Any]], name: str, key: str) -> list[dict[str, Any]]:
    return [line for line in lines if line["who"] == name and key in line]


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
    disable_seconds: list[float] = []
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        if redis_url is not None:
            await wait_subscribed(redis_url, 1)
        for run in range(RUNS):
            lines, err = await run_worker(mode, port, conversation, run, redis_url)
            children = sorted(who(lines, "child", "call_id"), key=lambda c: c["index"])
            starts = who(lines, "child", "queue_at_start")
            first, last = (
                who(lines, "parent", "queued_at_fork")[0],
                who(lines, "parent", "flushed")[0],
            )
            assert len(children) == CHILDREN, (lines, err)
            call_ids = [c["call_id"] for c in children]
            await ended(browser, [*call_ids, first["call_id"], last["second_call"]])
            await barrier(browser, port)

            assert_child_calls_arrived(browser, call_ids)
            # What the parent had queued at the fork is the parent's: sent once, by it.
            assert first["queued_at_fork"] == 2
            assert all(s["queue_at_start"] == 0 and s["streams_at_start"] == 0 for s in starts)
            own = browser.stream(first["call_id"], "t")
            assert [b["state"] for b in own] == ["running", "done"]
            assert done_text(own) == "parent answer"
            # The parent's sender still works after the children came and went.
            assert done_text(browser.stream(last["second_call"], "t")) == "parent second answer"
            assert last["statuses"] == [0] * CHILDREN
            assert last["flushed"] is True
            # disable() in a child flushed everything within its timeout (a hang would
            # have used the timeout up and reported not flushed), and said nothing alarming.
            assert all(c["flushed"] is True for c in children), children
            assert all(c["counts"].get("unflushed", 0) == 0 for c in children), children
            assert all(c["counts"]["delivered"] == 3 for c in children), children
            assert "Traceback" not in err, err
            assert "TimeoutError" not in err, err
            disable_seconds += [c["disable_seconds"] for c in children]
        delivered = len(browser.blocks)
        terminal_count = len(terminals(browser.blocks))
    calls = RUNS * (CHILDREN + 2)
    assert delivered == RUNS * (3 * CHILDREN + 2 + 2)
    assert terminal_count == calls
    report(
        f"workers forked after enable() ({mode}{', Redis sender' if redis_url else ''})",
        runs=RUNS,
        children=RUNS * CHILDREN,
        terminals_expected=calls,
        terminals_delivered=terminal_count,
        blocks_delivered=delivered,
        child_disable_max_s=max(disable_seconds),
    )


async def test_a_child_forked_inside_a_call_leaves_that_call_to_the_parent() -> None:
    """The children inherit the parent's running call in their contextvar: what they
    publish for it is dropped (counted ``closed``), never sent as a second stream or a
    second terminal; their own calls arrive."""
    conversation = "conv-fork-in-call"
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        lines, err = await run_worker("fork-in-call", port, conversation)
        children = sorted(who(lines, "child", "call_id"), key=lambda c: c["index"])
        first, last = who(lines, "parent", "queued_at_fork")[0], who(lines, "parent", "flushed")[0]
        assert len(children) == CHILDREN, (lines, err)
        call_ids = [c["call_id"] for c in children]
        await ended(browser, [*call_ids, first["call_id"], last["second_call"]])
        await barrier(browser, port)
        assert_child_calls_arrived(browser, call_ids)
        own = browser.stream(first["call_id"], "t")
        assert [b["envelope"]["payload"].get("text") for b in own] == [
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
        (child,) = who(lines, "child", "call_id")
        (parent,) = who(lines, "parent", "flushed")
        await ended(browser, [child["call_id"], parent["second_call"]])
        await barrier(browser, port)
        assert_child_calls_arrived(browser, [child["call_id"]])
        assert parent["child_signal"] == signal.SIGTERM
        assert parent["flushed"] is True
        assert done_text(browser.stream(parent["second_call"], "t")) == "parent second answer"
        assert "SIGTERM; flushing the sender" in err


async def test_a_terminated_pool_ends_at_once_and_every_pane_it_started_ends_once() -> None:
    """The pool's ``with`` block terminates its workers (SIGTERM): they die at once, as
    Python documents (no SIGTERM flush in a multiprocessing child: a worker that flushes
    first can leave the pool hanging), so what a worker had not sent yet is lost. The pool
    never hangs, and each pane that got a block ends exactly once — with its own terminal,
    or the relay's ``aborted`` once the worker's grace is over."""
    conversation = "conv-pool-exit"
    ready = create_app(SECRET, authorize_join=allow_all, worker_grace=1.0)
    started = 0
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        for run in range(RUNS):
            lines, err = await run_worker("pool-exit", port, conversation, run)
            (results,) = [line["results"] for line in lines if "results" in line]
            assert "SIGTERM; flushing" not in err, err
            assert "Traceback" not in err, err
            call_ids = [r["call_id"] for r in results]
            await wait_until(
                lambda call_ids=call_ids: all(
                    terminals(browser.stream(c)) or not browser.stream(c) for c in call_ids
                ),
                15,
            )
            await barrier(browser, port)
            for call_id in call_ids:
                stream = browser.stream(call_id, "t")
                if stream:
                    started += 1
                    assert one_terminal_last(stream)["state"] in ("done", "aborted"), stream
    report(
        "multiprocessing pool terminated after enable() (pool-exit)",
        runs=RUNS,
        calls=RUNS * CHILDREN,
        panes_started=started,
        panes_ended_once=started,
    )


@pytest.mark.parametrize("mode", ["pool-join", "spawn", "forkserver"])
async def test_a_multiprocessing_pool_delivers_every_childs_call(mode: str) -> None:
    """Nobody calls disable() in the pool's children: they flush when they end (their
    finalizers, after close() and join()); spawn and forkserver children enable afresh at
    import."""
    conversation = f"conv-{mode}"
    runs = RUNS if mode.startswith("pool") else 1
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        for run in range(runs):
            lines, err = await run_worker(mode, port, conversation, run)
            (results,) = [line["results"] for line in lines if "results" in line]
            assert all(r["enabled"] for r in results), results
            call_ids = [r["call_id"] for r in sorted(results, key=lambda r: r["index"])]
            await ended(browser, call_ids)
            await barrier(browser, port)
            assert_child_calls_arrived(browser, call_ids)
            assert "Traceback" not in err, err
        terminal_count = len(terminals(browser.blocks))
    assert terminal_count == runs * CHILDREN
    report(
        f"multiprocessing pool after enable() ({mode})",
        runs=runs,
        calls=runs * CHILDREN,
        terminals_expected=runs * CHILDREN,
        terminals_delivered=terminal_count,
    )


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
            await ended(browser, call_ids)
            await barrier(browser, port)
        finally:
            proc.terminate()
            _, err = await asyncio.to_thread(proc.communicate, timeout=60)
        for index, call_id in enumerate(call_ids, start=1):
            stream = browser.stream(call_id, "t")
            assert [b["state"] for b in stream] == ["running", "running", "done"], stream
            assert done_text(stream) == f"answer {index}"
        assert str(proc.pid) not in {answer.split()[1] for answer in answers}
        assert b"Traceback" not in err, err.decode()


def start_gunicorn(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "gunicorn", "--preload", "--workers", "2"]
    command += ["--bind", f"127.0.0.1:{port}", "gunicorn_app:app"]
    return subprocess.Popen(
        command,
        cwd=SUPPORT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as response:
        body: bytes = response.read()
    return body.decode()


_EARLY_SIGTERM = """
import json, os, signal, sys

def sigterm_before_kernel_ext_took_over():
    os.kill(os.getpid(), signal.SIGTERM)  # a pool terminating a worker that is starting

os.register_at_fork(after_in_child=sigterm_before_kernel_ext_took_over)  # runs first

import kernel_ext

kernel_ext.enable(relay_url=sys.argv[1])  # a sync kernel: the SIGTERM flush is installed
pid = os.fork()
if pid == 0:
    os._exit(3)  # the SIGTERM was ignored
_, status = os.waitpid(pid, 0)
print(json.dumps({"killed_by": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}))
kernel_ext.disable()
"""


async def test_a_sigterm_to_a_forked_child_before_its_fork_hook_ran_terminates_it_at_once(
    tmp_path: Path,
) -> None:
    """The parent's SIGTERM handler is the child's until kernel_ext's fork hook runs: a
    SIGTERM in that window (a pool terminating a worker that is still starting) is the
    default action — the child dies of it at once — never a flush of the parent's sender."""
    script = tmp_path / "early_sigterm.py"
    script.write_text(_EARLY_SIGTERM, encoding="utf-8")
    code, out, err = await run_script(script, f"http://127.0.0.1:{free_port()}", timeout=60)
    assert code == 0, err
    assert json.loads(out.splitlines()[-1]) == {"killed_by": signal.SIGTERM}
    assert "SIGTERM; flushing" not in err, err
