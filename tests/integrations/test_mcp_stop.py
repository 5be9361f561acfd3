"""A stopped call stops the MCP tool call it is waiting on (issue 35, point 4): a tool that
calls an MCP tool through :func:`call_mcp_tool` and is stopped by
:func:`kernel_ext.stop_call` abandons the request, the MCP SDK sends
``notifications/cancelled`` for it — recorded by a real MCP server over stdio (a
subprocess) — and the stream's one terminal reads *stopped*."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from support import SUPPORT
from support.network import need_module
from support.timing import wait_until

need_module("mcp", "pip install 'kernel-ext[mcp]'")

from mcp.client.session import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

from kernel_ext import ToolDescription, stop_call  # noqa: E402
from kernel_ext.attribution.tap import Tap  # noqa: E402
from kernel_ext.instrument._call import begin_scope, run_stoppable  # noqa: E402
from kernel_ext.integrations.mcp import call_mcp_tool  # noqa: E402
from kernel_ext.stop import STOPPED_MESSAGE  # noqa: E402
from kernel_ext.stream import StreamHub  # noqa: E402
from kernel_ext.testing import MemoryEmitter  # noqa: E402

pytestmark = pytest.mark.timeout(90)

SERVER = SUPPORT / "mcp_server.py"
CONV = "conv-mcp-stop"


async def test_a_stopped_call_sends_the_mcp_cancellation_and_its_stream_reads_stopped(
    tmp_path: Path,
) -> None:
    record = tmp_path / "cancelled.txt"
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    emitter = MemoryEmitter(hub=hub)
    await emitter.start()
    provider = TracerProvider()
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER), "stdio"])
    try:
        async with stdio_client(params) as streams, ClientSession(*streams) as session:
            await session.initialize()
            active = begin_scope(ToolDescription("crawl_site", CONV), provider, hub)
            assert active is not None
            assert active.call is not None
            call_id = active.call.call_id

            async def body() -> object:
                return await call_mcp_tool(
                    session, "await_cancel", {"record": str(record)}, publish=hub.publish
                )

            task = asyncio.create_task(run_stoppable(active, body))
            await emitter.wait_for(
                lambda records: any(b["callId"] == call_id for _, b in records), timeout=30
            )
            assert stop_call(call_id) == "stopping"
            result = await asyncio.wait_for(task, 30)
            assert isinstance(result, str)
            assert result.startswith("The user stopped this tool call")
            await wait_until(record.exists, 30)  # the server was told, over stdio
            assert record.read_text(encoding="utf-8").startswith("cancelled")
            await emitter.flush(2)
            ends = [b for _, b in emitter.records if b["state"] != "running"]
            assert [(b["callId"], b["envelope"]["payload"]) for b in ends] == [
                (call_id, {"message": STOPPED_MESSAGE, "stopped": True})
            ]
    finally:
        await emitter.stop(timeout=2)
        provider.shutdown()
