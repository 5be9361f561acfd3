"""A worker process for tests/emit/test_shutdown.py (run as a script, never imported by tests).

It enables kernel_ext against a relay, publishes one tool call's running block and terminal
at once (while the sender is still connecting, so they are surely queued), then leaves the
way ``MODE`` says. On its way out (where it still can) it prints one JSON line with the
hub's counts.

Usage: ``KERNEL_EXT_SECRET=… python tests/support/shutdown_worker.py MODE RELAY_URL CONV CALL_ID``

Modes: ``sync-exit`` (the script just ends), ``sync-sigterm``, ``sync-disable``,
``async-adisable``, ``async-sigterm``, ``async-disable-awaited`` (the sync ``disable()`` on
the loop, its task awaited), ``async-loop-ends`` (the loop ends with the plugin enabled).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import signal
import sys
import time
import warnings

import kernel_ext
from kernel_ext import ToolCall, use_tool_call

logging.basicConfig(level=logging.WARNING, format="worker %(levelname)s %(name)s %(message)s")


def publish_call(conversation: str, call_id: str) -> None:
    with use_tool_call(ToolCall(call_id, "ask_colleague", conversation)):
        kernel_ext.publish("working on it", task_id="t")
        kernel_ext.publish("the final answer", task_id="t", state="done")


def sync_main(mode: str, url: str, conversation: str, call_id: str) -> None:
    state = kernel_ext.enable(relay_url=url, secret=os.environ["KERNEL_EXT_SECRET"])
    publish_call(conversation, call_id)
    hub = state.hub
    if mode == "sync-sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # the handler flushes and ends the process before this returns
        raise SystemExit("still alive a minute after SIGTERM")
    if mode == "sync-disable":
        kernel_ext.disable(timeout=10)
        print(json.dumps({"counts": hub.stats().counts}), flush=True)
    # sync-exit: nothing; the atexit hook flushes


async def async_main(mode: str, url: str, conversation: str, call_id: str) -> None:
    state = kernel_ext.enable(relay_url=url, secret=os.environ["KERNEL_EXT_SECRET"])
    hub = state.hub
    publish_call(conversation, call_id)
    if mode == "async-adisable":
        flushed = await kernel_ext.adisable(timeout=10)
        print(json.dumps({"counts": hub.stats().counts, "flushed": flushed}), flush=True)
    elif mode == "async-sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(60)
        raise SystemExit("still alive a minute after SIGTERM")
    elif mode == "async-disable-awaited":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            closing = kernel_ext.disable(timeout=10)
        assert closing is not None
        flushed = await closing
        warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        print(
            json.dumps({"counts": hub.stats().counts, "flushed": flushed, "warned": warned}),
            flush=True,
        )
    # async-loop-ends: the loop ends with the sender still running; the loss is counted
    # and logged (reported by the atexit hook main() registered before enable()).
    if mode == "async-loop-ends":
        HUBS.append(hub)


HUBS: list[kernel_ext.stream.StreamHub] = []


def report_at_exit() -> None:
    # Registered before enable(): atexit runs hooks last-in first-out, so this runs after
    # kernel_ext's own hook.
    if HUBS:
        print(json.dumps({"counts": HUBS[0].stats().counts}), flush=True)


def main() -> None:
    mode, url, conversation, call_id = sys.argv[1:5]
    atexit.register(report_at_exit)
    if mode.startswith("sync-"):
        sync_main(mode, url, conversation, call_id)
    else:
        asyncio.run(async_main(mode, url, conversation, call_id))


if __name__ == "__main__":
    main()
