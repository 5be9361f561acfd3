"""MCP tool calls stream into the pane (kernel_ext.integrations.mcp), against real MCP servers.

The server is the SDK's own ``MCPServer`` (tests/support/mcp_server.py), reached three ways: the
SDK's in-memory client/server pair (``mcp.shared.memory``), a subprocess over stdio, and a
subprocess over streamable HTTP on 127.0.0.1. Blocks go through the real ``StreamHub`` (real
clock: the T4 throttle as it runs) to a ``MemoryEmitter``, and, at the end, through the real
relay to a python-socketio client joined to the room, reduced by ``kernel_ext.viewing.view``.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
from support import SUPPORT
from support.network import free_port, need_module, started, wait_listening
from support.timing import wait_until

need_module("mcp", "pip install 'kernel-ext[mcp]'")

import anyio  # noqa: E402 - after the check above
from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402
from mcp.shared.memory import create_client_server_memory_streams  # noqa: E402
from mcp_types import (  # noqa: E402
    CONNECTION_CLOSED,
    REQUEST_TIMEOUT,
    CallToolResult,
    ImageContent,
    TextContent,
)
from support import mcp_server  # noqa: E402
from support.relay_helpers import Browser, RelayProcess, barrier, emitter_for  # noqa: E402

from kernel_ext.attribution.tap import Tap  # noqa: E402
from kernel_ext.context import ToolCall, use_tool_call  # noqa: E402
from kernel_ext.integrations.mcp import (  # noqa: E402
    DEFAULT_ERROR_TEXT,
    McpToolStream,
    call_mcp_tool,
    result_text,
)
from kernel_ext.protocol import decode  # noqa: E402
from kernel_ext.stream import Progress, StreamHub  # noqa: E402
from kernel_ext.testing import MemoryEmitter  # noqa: E402
from kernel_ext.viewing.view import PaneStore  # noqa: E402

pytestmark = pytest.mark.timeout(90)

SERVER = SUPPORT / "mcp_server.py"
CALL = "00f067aa0ba902b7"
CALL_B = "5b8aa5a2d2c872e8"
CONV = "conv-mcp"
LONE = "before \ud800 after"
TRANSPORTS = [
    "memory",
    "stdio",
    pytest.param("http", marks=pytest.mark.network),
]


def in_call(call_id: str = CALL) -> Any:
    return use_tool_call(ToolCall(call_id, "crawl_site", CONV))


# -- the servers ---------------------------------------------------------------------------


@dataclass
class Served:
    """A connected ``ClientSession`` and how to kill its server mid-call (given the process
    id the ``pid`` tool reported)."""

    session: ClientSession
    kill: Callable[[str], Awaitable[None]]


async def _kill_process(reported: str) -> None:
    os.kill(int(reported), signal.SIGKILL)


def _start_http_server(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(SERVER), "http", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@asynccontextmanager
async def served(transport: str) -> AsyncIterator[Served]:
    if transport == "memory":
        async with create_client_server_memory_streams() as (client, server_side):
            read, write = server_side
            # The SDK's own InMemoryTransport runs MCPServer's low-level server the same way.
            lowlevel = mcp_server.server._lowlevel_server
            options = lowlevel.create_initialization_options()
            async with anyio.create_task_group() as group:
                group.start_soon(partial(lowlevel.run, read, write, options))

                async def close_server_side(_: str) -> None:
                    await write.aclose()  # the server's end of the transport goes away

                async with ClientSession(*client) as session:
                    await session.initialize()
                    yield Served(session, close_server_side)
                group.cancel_scope.cancel()
    elif transport == "stdio":
        params = StdioServerParameters(command=sys.executable, args=[str(SERVER), "stdio"])
        async with stdio_client(params) as streams, ClientSession(*streams) as session:
            await session.initialize()
            yield Served(session, _kill_process)
    else:
        port = free_port()
        process = _start_http_server(port)
        try:
            wait_listening(port, process=process, what="the MCP server")
            url = f"http://127.0.0.1:{port}/mcp"
            async with streamable_http_client(url) as streams, ClientSession(*streams) as session:
                await session.initialize()
                yield Served(session, _kill_process)
        finally:
            process.kill()
            process.wait(timeout=10)


# -- the pane: the real hub and a recording sender -------------------------------------------


@dataclass
class Pane:
    hub: StreamHub
    emitter: MemoryEmitter

    def blocks(self, call_id: str = CALL) -> list[dict[str, Any]]:
        return [b for b in self.emitter.blocks(CONV) if b["callId"] == call_id]

    async def wait_terminals(self, n: int = 1) -> None:
        await self.emitter.wait_for(
            lambda records: sum(b["state"] != "running" for _, b in records) >= n, timeout=10
        )


@pytest.fixture
async def pane() -> AsyncIterator[Pane]:
    hub = StreamHub(tap=Tap())  # the real clock: T4 as it runs
    emitter = MemoryEmitter(hub=hub)
    await emitter.start()
    try:
        yield Pane(hub, emitter)
    finally:
        await emitter.stop(timeout=2)


def one_stream(blocks: list[dict[str, Any]], call_id: str = CALL) -> dict[str, Any]:
    """Every block valid on the wire, on one stream of the call that is not the call's own
    local stream, seqs strictly increasing (the terminal's too), exactly one terminal, last.
    Returns the terminal."""
    assert blocks, "no blocks"
    for block in blocks:
        decode(block)
    assert {(b["callId"], b["taskId"]) for b in blocks} == {(call_id, blocks[0]["taskId"])}
    assert blocks[0]["taskId"] != call_id
    seqs = [b["envelope"]["seq"] for b in blocks]
    assert seqs == sorted(set(seqs)), seqs
    ends = [b for b in blocks if b["state"] != "running"]
    assert len(ends) == 1
    assert blocks[-1] is ends[0]
    return ends[0]


def running(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for b in blocks if b["state"] == "running"]


# -- each case over each transport -----------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_progress_reports_are_progress_blocks_then_one_done_with_the_result(
    transport: str, pane: Pane
) -> None:
    async with served(transport) as server:
        with in_call():
            result = await call_mcp_tool(
                server.session, "crawl", {"pages": 4}, publish=pane.hub.publish
            )
    assert result_text(result) == "crawled 4 pages"
    await pane.wait_terminals()
    blocks = pane.blocks()
    terminal = one_stream(blocks)
    assert blocks[0]["taskId"].startswith("mcp-crawl-")
    envelopes = [b["envelope"] for b in running(blocks)]
    assert [e["kind"] for e in envelopes] == ["progress"] * 4
    assert [e["seq"] for e in envelopes] == [1, 2, 3, 4]
    assert [e["payload"] for e in envelopes] == [
        {"progress": page, "total": 4, "message": f"page {page} of 4"} for page in range(1, 5)
    ]
    assert all(type(e["payload"]["progress"]) is int for e in envelopes)  # 1.0 → 1
    assert (terminal["state"], terminal["envelope"]["payload"]) == (
        "done",
        {"text": "crawled 4 pages"},
    )
    assert terminal["envelope"]["seq"] == 5


async def test_lone_surrogates_from_the_server_are_carried_into_the_blocks(pane: Pane) -> None:
    # Only the in-memory transport carries a lone surrogate: over stdio or HTTP the server's
    # JSON cannot encode one. A block may hold one in its payload (docs/protocol.md).
    async with served("memory") as server:
        with in_call():
            result = await call_mcp_tool(server.session, "unpaired", {}, publish=pane.hub.publish)
    await pane.wait_terminals()
    terminal = one_stream(pane.blocks())
    [progress] = running(pane.blocks())
    assert progress["envelope"]["payload"] == {"progress": 1, "total": 2, "message": LONE}
    assert terminal["envelope"]["payload"] == {"text": result_text(result)} == {"text": "x\udc00"}


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_thousand_reports_per_second_are_throttled_to_ten_a_second_one_terminal(
    transport: str, pane: Pane
) -> None:
    count = 1000
    async with served(transport) as server:
        with in_call():
            stream = McpToolStream("flood", publish=pane.hub.publish)
            began = time.monotonic()
            result = await server.session.call_tool(
                "flood", {"count": count, "per_second": 1000}, progress_callback=stream.on_progress
            )
            stream.finish(result)
            elapsed = time.monotonic() - began
    # Every report reached the callback (some may run after the result: counted late).
    await wait_until(lambda: stream.stats.reports == count, 10, lambda: f"{stream.stats}")
    await pane.wait_terminals()
    blocks = pane.blocks()
    terminal = one_stream(blocks)
    assert terminal["envelope"]["payload"] == {"text": f"flooded {count} reports"}
    shown = running(blocks)
    # T4, the hub's throttle: at most 10 running blocks in any one second of the stream...
    assert 10 <= len(shown) <= 10 * (math.ceil(elapsed) + 1)
    stamps = [b["ts"] for b in shown]
    assert all(later - first >= 900 for first, later in zip(stamps, stamps[10:], strict=False))
    # ...and every other report handed to the hub was dropped and counted.
    assert stream.stats.published + stream.stats.late == count
    assert pane.hub.stats()["throttled"] == stream.stats.published - len(shown)
    assert [b["envelope"]["payload"]["progress"] for b in shown] == sorted(
        {b["envelope"]["payload"]["progress"] for b in shown}
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_error_result_ends_the_stream_aborted_and_is_returned(
    transport: str, pane: Pane
) -> None:
    async with served(transport) as server:
        with in_call():
            result = await call_mcp_tool(server.session, "broken", publish=pane.hub.publish)
    assert result.is_error
    await pane.wait_terminals()
    terminal = one_stream(pane.blocks())
    assert terminal["state"] == "aborted"
    assert terminal["envelope"]["payload"] == {"message": result_text(result)}
    assert "broken" in result_text(result)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_protocol_error_ends_the_stream_aborted_and_is_raised(
    transport: str, pane: Pane
) -> None:
    async with served(transport) as server:
        with in_call(), pytest.raises(MCPError) as raised:
            await call_mcp_tool(server.session, "refuse", publish=pane.hub.publish)
    assert raised.value.code == -32602
    await pane.wait_terminals()
    terminal = one_stream(pane.blocks())
    assert terminal["state"] == "aborted"
    assert terminal["envelope"]["payload"]["message"] == (
        "the MCP server answered with an error (-32602): unknown site: example.invalid"
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_hanging_tool_times_out_and_ends_the_stream_aborted(
    transport: str, pane: Pane
) -> None:
    async with served(transport) as server:
        with in_call(), pytest.raises(MCPError) as raised:
            await call_mcp_tool(
                server.session, "hang", read_timeout_seconds=0.5, publish=pane.hub.publish
            )
    assert raised.value.code == REQUEST_TIMEOUT
    await pane.wait_terminals()
    blocks = pane.blocks()
    terminal = one_stream(blocks)
    assert [b["envelope"]["payload"] for b in running(blocks)] == [
        {"progress": 1, "message": "started; never finishes"}
    ]
    assert terminal["state"] == "aborted"
    assert terminal["envelope"]["payload"]["message"].startswith("the MCP tool call timed out")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_server_gone_mid_call_ends_the_stream_aborted(transport: str, pane: Pane) -> None:
    async with served(transport) as server:

        async def kill_on_first_report(
            progress: float, total: float | None, pid: str | None
        ) -> None:
            assert pid is not None
            await server.kill(pid)

        with in_call(), pytest.raises(MCPError) as raised:
            await call_mcp_tool(
                server.session,
                "pid",
                progress_callback=kill_on_first_report,
                read_timeout_seconds=30,
                publish=pane.hub.publish,
            )
    assert raised.value.code == CONNECTION_CLOSED
    await pane.wait_terminals()
    blocks = pane.blocks()
    terminal = one_stream(blocks)
    assert len(running(blocks)) == 1
    assert terminal["state"] == "aborted"
    assert terminal["envelope"]["payload"]["message"].startswith(
        "the MCP server's connection closed"
    )


# -- attribution and the edges of the helper (in memory) -------------------------------------


async def test_two_concurrent_calls_on_one_session_stream_each_under_its_own_call(
    pane: Pane,
) -> None:
    async def tool(call_id: str, pages: int) -> CallToolResult:
        with in_call(call_id):
            return await call_mcp_tool(
                server.session, "crawl", {"pages": pages}, publish=pane.hub.publish
            )

    async with served("memory") as server:
        first, second = await asyncio.gather(tool(CALL, 3), tool(CALL_B, 5))
    assert (result_text(first), result_text(second)) == ("crawled 3 pages", "crawled 5 pages")
    await pane.wait_terminals(2)
    for call_id, pages in ((CALL, 3), (CALL_B, 5)):
        blocks = pane.blocks(call_id)
        terminal = one_stream(blocks, call_id)
        assert [b["envelope"]["payload"]["total"] for b in running(blocks)] == [pages] * pages
        assert terminal["envelope"]["payload"]["text"] == f"crawled {pages} pages"


async def test_cancelling_the_tool_ends_the_stream_aborted_and_reraises(pane: Pane) -> None:
    reported = asyncio.Event()

    async def on_report(progress: float, total: float | None, message: str | None) -> None:
        reported.set()

    async with served("memory") as server:
        with in_call():
            task = asyncio.ensure_future(
                call_mcp_tool(
                    server.session, "hang", progress_callback=on_report, publish=pane.hub.publish
                )
            )
        await asyncio.wait_for(reported.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await pane.wait_terminals()
    terminal = one_stream(pane.blocks())
    assert terminal["envelope"]["payload"] == {"message": "the MCP tool call was cancelled"}


async def test_outside_any_call_the_terminal_is_an_orphan_and_progress_is_not_sent(
    pane: Pane,
) -> None:
    async with served("memory") as server:
        await call_mcp_tool(
            server.session,
            "crawl",
            {"pages": 2},
            conversation_id=CONV,
            task_id="mcp-crawl-unattributed",
            publish=pane.hub.publish,
        )
    await pane.wait_terminals()
    (block,) = pane.emitter.blocks(CONV)  # the terminal alone
    assert (block["callId"], block["taskId"], block["state"]) == (
        None,
        "mcp-crawl-unattributed",
        "done",
    )
    assert pane.hub.stats()["unattributed"] == 2


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.fail = fail

    def __call__(self, item: Any, **kwargs: Any) -> None:
        self.calls.append((item, kwargs))
        if self.fail:
            raise RuntimeError("publisher down")


async def test_reports_after_the_terminal_are_counted_late_and_not_published() -> None:
    publish = Recorder()
    stream = McpToolStream("crawl", task_id="t-1", publish=publish)
    await stream.on_progress(1.0, 2.0, "half")
    stream.finish(CallToolResult(content=[TextContent(type="text", text="ok")]))
    await stream.on_progress(2.0, 2.0, "late")
    stream.fail(RuntimeError("after the end"))
    assert [(kw["state"], kw["task_id"]) for _, kw in publish.calls] == [
        ("running", "t-1"),
        ("done", "t-1"),
    ]
    assert (stream.stats.reports, stream.stats.published, stream.stats.late) == (2, 1, 1)
    assert stream.stats.terminals == 1


async def test_a_raising_publisher_never_reaches_the_tool() -> None:
    stream = McpToolStream("crawl", publish=Recorder(fail=True))
    await stream.on_progress(1.0, None, None)
    stream.finish(CallToolResult(content=[], is_error=True))
    assert stream.ended


def test_an_error_result_without_text_gets_the_default_message() -> None:
    publish = Recorder()
    McpToolStream("crawl", publish=publish).finish(CallToolResult(content=[], is_error=True))
    assert publish.calls[0][0] == DEFAULT_ERROR_TEXT
    assert publish.calls[0][1]["state"] == "aborted"


def test_a_result_of_another_shape_ends_the_stream_done_without_text() -> None:
    publish = Recorder()
    McpToolStream("crawl", publish=publish).finish(object())  # type: ignore[arg-type]
    assert [(item, kw["state"]) for item, kw in publish.calls] == [("", "done")]


def test_result_text_joins_texts_else_structured_content_else_nothing() -> None:
    image = ImageContent(type="image", data="aGk=", mime_type="image/png")
    two = [TextContent(type="text", text="a"), image, TextContent(type="text", text="b")]
    assert result_text(CallToolResult(content=two)) == "a\nb"
    structured = CallToolResult(content=[image], structured_content={"pages": 4, "ok": "是"})
    assert result_text(structured) == '{"pages":4,"ok":"是"}'
    assert result_text(CallToolResult(content=[image])) == ""


# -- all the way to a browser-side client through the real relay -----------------------------


@pytest.fixture(scope="module")
def relay() -> Iterator[RelayProcess]:
    process = RelayProcess()
    process.start()
    try:
        wait_listening(process.port, process=process.proc, what="relay")
        yield process
    finally:
        process.stop()


CASES = {
    "done": ("crawl", {"pages": 3}, "done", "crawled 3 pages"),
    "is-error": ("broken", {}, "aborted", "Error executing tool broken"),
    "protocol-error": ("refuse", {}, "aborted", "the MCP server answered with an error"),
    "timeout": ("hang", {}, "aborted", "the MCP tool call timed out"),
    "server-killed": ("pid", {}, "aborted", "the MCP server's connection closed"),
    "flood": ("flood", {"count": 1000, "per_second": 1000}, "done", "flooded 1000 reports"),
}


@pytest.mark.network
@pytest.mark.parametrize("case", list(CASES))
async def test_mcp_progress_reaches_a_browser_through_the_relay_with_one_terminal(
    relay: RelayProcess, case: str
) -> None:
    name, arguments, state, text = CASES[case]
    # Each case in a conversation of its own: the relay is shared, and a browser that joins
    # a conversation is caught up with its streams the relay still holds.
    conversation = f"{CONV}-{case}"
    started("network")
    hub = StreamHub(tap=Tap())
    emitter = emitter_for(relay.port, hub)
    browser = Browser()
    await emitter.start()
    try:
        await browser.connect(relay.port)
        assert await browser.join(conversation) == {"ok": True}
        async with served("stdio") as server:

            async def kill_on_report(progress: float, total: float | None, pid: str | None) -> None:
                if name == "pid" and pid is not None:
                    await server.kill(pid)

            outcome: CallToolResult | MCPError
            try:
                with use_tool_call(ToolCall(CALL, "crawl_site", conversation)):
                    outcome = await call_mcp_tool(
                        server.session,
                        name,
                        arguments,
                        read_timeout_seconds=1.0 if name == "hang" else 30.0,
                        progress_callback=kill_on_report,
                        publish=hub.publish,
                    )
            except MCPError as error:
                outcome = error
        ok = isinstance(outcome, CallToolResult) and not outcome.is_error
        assert ok == (state == "done")
        assert isinstance(outcome, MCPError) == (case not in ("done", "is-error", "flood"))
        await browser.wait_for(lambda got: any(b["state"] != "running" for b in got))
        await emitter.stop(timeout=5)  # whatever was still queued is sent now
        await barrier(browser, relay.port)  # ...and has reached the browser
        blocks = browser.blocks
        terminal = one_stream(blocks)
        key = "text" if state == "done" else "message"
        assert terminal["state"] == state
        assert terminal["envelope"]["payload"][key].startswith(text)
        store = PaneStore()
        for block in blocks:
            store.apply_block(block)
        (pane_state,) = store.state()["panes"]
        assert pane_state["status"] == "ended"
        assert pane_state["final"]["text"] == terminal["envelope"]["payload"][key]
        items = pane_state["tasks"][0]["items"]
        assert all(item["kind"] == "progress" for item in items)
        if name == "flood":
            assert 10 <= len(items) < 1000  # throttled on the way
            assert hub.stats()["throttled"] > 0
        elif name == "crawl":
            assert [(i["progress"], i["total"]) for i in items] == [(1, 3), (2, 3), (3, 3)]
        else:
            assert len(items) == (1 if name in ("hang", "pid") else 0)
    finally:
        await browser.close()
        await emitter.stop(timeout=5)


async def test_a_published_progress_takes_the_streams_seq_and_a_bad_number_is_dropped(
    pane: Pane,
) -> None:
    with in_call():
        pane.hub.publish("a text block", task_id="t-1")
        pane.hub.publish(Progress(2.0, 4.0, "half"), task_id="t-1")
        pane.hub.publish(Progress(float("nan")), task_id="t-1")
        pane.hub.publish(Progress(3, float("inf")), task_id="t-1")
        pane.hub.publish("done", task_id="t-1", state="done")
    await pane.wait_terminals()
    blocks = pane.blocks()
    assert [(b["envelope"]["kind"], b["envelope"]["seq"]) for b in blocks] == [
        ("text", 1),
        ("progress", 2),
        ("text", 5),
    ]
    assert blocks[1]["envelope"]["payload"] == {"progress": 2, "total": 4, "message": "half"}
    assert pane.hub.stats()["invalid"] == 2
