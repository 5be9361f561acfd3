"""Shutdown flushes (issue: terminal edges, item 2): a worker process that publishes a tool
call's terminal and then stops — its script ends, it gets SIGTERM, it calls ``disable()`` or
``await adisable()`` — still delivers that terminal to the browser, exactly once, within the
shutdown timeout. A sync ``disable()`` on the sender's own loop warns; a loop that ends under
the sender counts and logs what it lost.

Real processes over 127.0.0.1: the worker is ``tests/support/shutdown_worker.py`` in a subprocess
(``kernel_ext.enable(relay_url=…)``, the loopback emitter), the relay is uvicorn in this
process, the browser a real python-socketio client.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from support import SUPPORT
from support.network import serve_asgi
from support.relay_helpers import SECRET, barrier, run_script, terminals
from support.reliability_helpers import RUNS, browser_on, report

from kernel_ext.relay import allow_all, create_app

pytestmark = [pytest.mark.network, pytest.mark.timeout(60 + 30 * RUNS)]

WORKER = SUPPORT / "shutdown_worker.py"
CALL = "5b8aa5a2d2c872e8"


async def run_worker(
    mode: str, port: int, conversation: str, call_id: str = CALL
) -> tuple[int, str, str]:
    return await run_script(WORKER, mode, f"http://127.0.0.1:{port}", conversation, call_id)


def last_json(out: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out
    result: dict[str, Any] = json.loads(lines[-1])
    return result


@pytest.mark.parametrize(
    ("mode", "status"),
    [
        ("sync-exit", 0),
        ("sync-disable", 0),
        ("sync-sigterm", -signal.SIGTERM),
        ("async-adisable", 0),
        ("async-sigterm", -signal.SIGTERM),
        ("async-disable-awaited", 0),
    ],
)
async def test_the_terminal_queued_at_shutdown_reaches_the_browser_once(
    mode: str, status: int
) -> None:
    conversation = f"conv-{mode}"
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, conversation) as browser:
        for run in range(RUNS):
            call_id = f"{run + 1:016x}"
            code, out, err = await run_worker(mode, port, conversation, call_id)
            assert code == status, err
            await browser.wait_for(
                lambda _, call_id=call_id: bool(terminals(browser.stream(call_id))), timeout=20
            )
            await barrier(browser, port)
            stream = browser.stream(call_id, "t")
            assert [b["state"] for b in stream] == ["running", "done"], err
            assert stream[-1]["envelope"]["payload"] == {"text": "the final answer"}
            if mode.endswith("sigterm"):
                assert "SIGTERM; flushing the sender" in err
            if mode in ("sync-disable", "async-adisable", "async-disable-awaited"):
                counts = last_json(out)["counts"]
                assert counts.get("unflushed", 0) == 0
                assert counts["delivered"] == 2
            if mode in ("async-adisable", "async-disable-awaited"):
                assert last_json(out)["flushed"] is True
            if mode == "async-disable-awaited":
                (warning,) = last_json(out)["warned"]
                assert "adisable" in warning
        delivered = len(terminals(browser.blocks))
    assert delivered == RUNS
    report(
        f"worker stops right after queueing a terminal ({mode})",
        runs=RUNS,
        terminals_expected=RUNS,
        terminals_delivered=delivered,
        exit_status=status,
    )


async def test_a_loop_that_ends_under_the_sender_counts_and_logs_what_it_lost() -> None:
    """No adisable() before asyncio.run() ends: the sender cannot flush any more (the loop
    and its connections are being torn down); the loss is not silent."""
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port, browser_on(port, "conv-lost") as browser:
        code, out, err = await run_worker("async-loop-ends", port, "conv-lost")
        assert code == 0, err
        await barrier(browser, port)
        delivered = len(terminals(browser.stream(CALL)))
    counts = last_json(out)["counts"]
    # Whatever did not reach the relay is counted; the terminal is either delivered or
    # counted lost, never both and never neither.
    assert counts.get("unflushed", 0) + delivered >= 1
    if not delivered:
        assert counts["unflushed"] == 2
        assert "1 queued terminal(s) lost (unflushed)" in err
