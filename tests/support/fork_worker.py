"""A worker that forks after ``kernel_ext.enable()``, for tests/emit/test_fork.py (run as a
script, never imported by tests).

The parent enables kernel_ext against a relay, as an application imported before its
processes are forked (gunicorn ``--preload``, Celery prefork) does, then starts children the
way ``MODE`` says; each child runs one tool call (two running blocks and a ``done``
terminal) in the conversation ``CONV``. Every process prints one JSON line per event on
stdout (``{"who": ..., ...}``); the test reads them and checks the browser.

Usage:
``KERNEL_EXT_SECRET=s python tests/support/fork_worker.py MODE RELAY_URL CONV [CHILDREN [RUN]]``
(``RUN`` goes into every call id, so that repeated runs against one relay never reuse one).

Modes:

* ``fork`` — :func:`os.fork` from the main thread while the parent's sender is held up, so
  that the parent's own call is still queued in its hub at the fork; each child checks its
  hub starts empty, runs its call and ``disable()``\\ s, then ``os._exit``\\ s; the parent
  runs a second call after the children and ``disable()``\\ s.
* ``fork-thread`` — the same, the forks made from a thread other than the main one.
* ``fork-in-call`` — the children are forked inside the parent's running tool call: what a
  child publishes for that call (it inherited the contextvar) is the parent's, not sent.
* ``pool-join`` / ``pool-exit`` — a ``multiprocessing`` pool with the fork start method runs
  the children's calls and nobody calls ``disable()`` in them: ``close()`` + ``join()``
  (the children end through their finalizers), or the pool's context manager (its
  ``terminate()``: ``SIGTERM``).
* ``async-fork-sigterm`` — ``enable()`` on a running event loop (an async kernel), a child
  forked from a coroutine runs its call and ends itself with ``SIGTERM``; the parent goes on.
* ``spawn`` / ``forkserver`` — a pool whose children import this module afresh: the
  module-level ``enable()`` below runs in each of them, as an application's would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import kernel_ext
from kernel_ext import ToolCall, use_tool_call

logging.basicConfig(
    level=int(os.environ.get("FORK_LOG", logging.WARNING)),
    format="fork-worker %(process)d %(threadName)s %(levelname)s %(name)s %(message)s",
)

MODE, URL, CONV = sys.argv[1:4] if len(sys.argv) >= 4 else ("", "", "")
CHILDREN = int(sys.argv[4]) if len(sys.argv) > 4 else 3
RUN = int(sys.argv[5]) if len(sys.argv) > 5 else 0
FRESH_IMPORT = ("spawn", "forkserver")


def say(who: str, **what: Any) -> None:
    """One JSON line, in one write: processes sharing stdout never interleave."""
    line = json.dumps({"who": who, "pid": os.getpid(), **what}) + "\n"
    os.write(sys.stdout.fileno(), line.encode())


def call_id_of(index: int) -> str:
    return f"c{RUN:03x}{index:012x}"


def parent_call_id(which: int) -> str:
    return f"9a{RUN:03x}{which:011x}"


def run_call(index: int) -> str:
    """One tool call of a child: two running blocks, one ``done`` terminal."""
    call_id = call_id_of(index)
    with use_tool_call(ToolCall(call_id, "ask_colleague", CONV)):
        kernel_ext.publish("step one", task_id="t")
        kernel_ext.publish(
            {
                "v": 1,
                "kind": "text",
                "streamKey": "t",
                "seq": 2,
                "status": "running",
                "payload": {"text": "step two"},
            },
            task_id="t",
        )
        kernel_ext.publish(f"answer {index}", task_id="t", state="done")
    return call_id


def enable() -> kernel_ext.worker.wiring.Enabled:
    """The loopback sender to ``RELAY_URL``, or with ``KERNEL_EXT_TEST_REDIS`` set the
    Redis sender to that URL."""
    redis_url = os.environ.get("KERNEL_EXT_TEST_REDIS")
    if redis_url:
        return kernel_ext.enable(redis_url=redis_url, emitter_options={"retry_interval": 0.05})
    return kernel_ext.enable(
        relay_url=URL,
        secret=os.environ["KERNEL_EXT_SECRET"],
        emitter_options={"reconnect_delay": 0.05, "reconnect_delay_max": 0.5},
    )


if MODE in FRESH_IMPORT and __name__ != "__main__":
    enable()  # the application's import-time enable(), run afresh in each child


def child_main(index: int) -> None:
    """A child forked with os.fork: its hub starts empty, its call arrives, disable()
    returns promptly with everything flushed."""
    state = kernel_ext.enabled()
    assert state is not None
    stats = state.hub.stats()
    say("child", index=index, queue_at_start=stats.queue, streams_at_start=stats.streams)
    call_id = run_call(index)
    sender = state.emitter
    started = time.monotonic()
    kernel_ext.disable(timeout=20)
    say(
        "child",
        index=index,
        call_id=call_id,
        disable_seconds=round(time.monotonic() - started, 3),
        flushed=sender.last_stop_flushed if sender is not None else None,
        counts=state.hub.stats().counts,
    )


def fork_children(indexes: list[int], first: Callable[[], None] = lambda: None) -> list[int]:
    """Fork a child per index; each runs ``first()`` then :func:`child_main` and exits."""
    pids = []
    for index in indexes:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                first()
                child_main(index)
            except BaseException as exc:
                say("child", index=index, error=repr(exc))
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    return pids


def forking_main() -> None:
    state = enable()
    assert state.loop is not None
    # Hold the parent's sender up (its loop blocked) so that the parent's call is surely
    # still queued in its hub when the children are forked.
    hold, held = threading.Event(), threading.Event()
    state.loop.call_soon_threadsafe(lambda: (held.set(), hold.wait(30)))
    assert held.wait(10)
    parent_call = parent_call_id(1)
    with use_tool_call(ToolCall(parent_call, "ask_colleague", CONV)):
        kernel_ext.publish("parent working", task_id="t")
        kernel_ext.publish("parent answer", task_id="t", state="done")
        say("parent", queued_at_fork=state.hub.stats().queue, call_id=parent_call)
        indexes = list(range(1, CHILDREN + 1))
        if MODE == "fork-in-call":
            pids = fork_children(indexes, publish_for_the_parents_call)
        elif MODE == "fork-thread":
            result: list[list[int]] = []
            thread = threading.Thread(target=lambda: result.append(fork_children(indexes)))
            thread.start()
            thread.join(30)
            pids = result[0]
        else:
            pids = fork_children(indexes)
    hold.set()
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    # The parent's sender keeps working after its children came and went.
    second = parent_call_id(2)
    with use_tool_call(ToolCall(second, "ask_colleague", CONV)):
        kernel_ext.publish("parent again", task_id="t")
        kernel_ext.publish("parent second answer", task_id="t", state="done")
    sender = state.emitter
    kernel_ext.disable(timeout=20)
    say(
        "parent",
        statuses=statuses,
        second_call=second,
        flushed=sender.last_stop_flushed if sender is not None else None,
        counts=state.hub.stats().counts,
    )


def publish_for_the_parents_call() -> None:
    """What a child forked inside the parent's call publishes for that call (the contextvar
    came along): the parent's, not the child's."""
    kernel_ext.publish("child publishes for the parent's call", task_id="t")
    kernel_ext.publish("child ends the parent's call", task_id="t", state="done")


def child_ends_itself_with_sigterm() -> None:
    try:
        run_call(1)
        say("child", index=1, call_id=call_id_of(1))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the child's SIGTERM flush ends the process before this returns
        say("child", index=1, error="alive 30 s after SIGTERM")
    finally:
        os._exit(1)


async def async_forking_main() -> None:
    """An async kernel: enable() on the running loop (its SIGTERM flush is a handler of that
    loop), a child forked from a coroutine ends itself with SIGTERM; the parent goes on."""
    state = enable()
    pid = os.fork()
    if pid == 0:
        child_ends_itself_with_sigterm()
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    second = parent_call_id(2)
    with use_tool_call(ToolCall(second, "ask_colleague", CONV)):
        kernel_ext.publish("parent again", task_id="t")
        kernel_ext.publish("parent second answer", task_id="t", state="done")
    flushed = await kernel_ext.adisable(timeout=20)
    say(
        "parent",
        child_signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        second_call=second,
        flushed=flushed,
        counts=state.hub.stats().counts,
    )


def pool_task(index: int) -> dict[str, Any]:
    state = kernel_ext.enabled()
    call_id = run_call(index)
    if os.environ.get("FORK_DEBUG"):
        assert state is not None
        say(
            "task",
            index=index,
            stats=repr(state.hub.stats()),
            sender=repr(state.emitter),
            consumer=repr(state.hub._port),
            loop=repr(state.loop),
            sigterm=repr(__import__("signal").getsignal(15)),
        )
    return {"index": index, "call_id": call_id, "pid": os.getpid(), "enabled": state is not None}


def pool_main() -> None:
    method = "fork" if MODE.startswith("pool") else MODE
    if method == "fork":
        enable()
    else:
        enable()  # the parent's own, as in any process that imported the application
    context = multiprocessing.get_context(method)
    indexes = list(range(1, CHILDREN + 1))
    if MODE == "pool-exit":
        with context.Pool(CHILDREN) as pool:  # __exit__ terminates the workers (SIGTERM)
            results = pool.map(pool_task, indexes, chunksize=1)
            say("parent", results=results)
    else:
        pool = context.Pool(CHILDREN)
        results = pool.map(pool_task, indexes, chunksize=1)
        say("parent", results=results)
        pool.close()
        pool.join()
    kernel_ext.disable(timeout=20)
    say("parent", done=True)


if __name__ == "__main__":
    if MODE == "async-fork-sigterm":
        asyncio.run(async_forking_main())
    elif MODE.startswith("fork") and MODE != "forkserver":
        forking_main()
    else:
        pool_main()
