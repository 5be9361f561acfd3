"""A real MCP server (the SDK's MCPServer) for tests/integrations/test_mcp.py, in-process
or as a subprocess.

``python tests/support/mcp_server.py stdio`` serves it over stdio;
``python tests/support/mcp_server.py http PORT`` over streamable HTTP on 127.0.0.1:PORT
(path ``/mcp``). Its tools:

* ``crawl(pages)``: one progress report per page (``total`` = pages, a message), then
  ``"crawled N pages"``;
* ``flood(count, per_second)``: ``count`` progress reports at about ``per_second``, no
  total and no message, then ``"flooded N reports"``;
* ``broken()``: raises inside the tool → a result with ``isError``;
* ``refuse()``: raises ``MCPError`` → a JSON-RPC error response (a protocol error);
* ``hang()``: one progress report, then never answers;
* ``pid()``: one progress report carrying the server's process id as its message, then
  never answers (the test kills the process mid-call);
* ``unpaired()``: one progress report whose message holds a lone surrogate, then a result
  that holds one (only an in-memory transport carries them: JSON text cannot).
* ``await_cancel(record)``: one progress report, then waits; when the client's
  ``notifications/cancelled`` for the request arrives, writes ``cancelled: <reason>`` to the
  file ``record`` (the server's own record that it was told) and ends.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError

server = MCPServer("kernel-ext-test")


@server.tool()
async def crawl(pages: int, ctx: Context) -> str:
    for page in range(1, pages + 1):
        await ctx.report_progress(page, pages, f"page {page} of {pages}")
    return f"crawled {pages} pages"


@server.tool()
async def flood(count: int, per_second: float, ctx: Context) -> str:
    start = anyio.current_time()
    for sent in range(1, count + 1):
        await ctx.report_progress(sent)
        lag = start + sent / per_second - anyio.current_time()
        if lag > 0:
            await anyio.sleep(lag)
    return f"flooded {count} reports"


@server.tool()
async def broken(ctx: Context) -> str:
    raise ValueError("the crawler's disk is full")


@server.tool()
async def refuse(ctx: Context) -> str:
    raise MCPError(-32602, "unknown site: example.invalid")


@server.tool()
async def hang(ctx: Context) -> str:
    await ctx.report_progress(1, None, "started; never finishes")
    await anyio.sleep_forever()
    return "unreachable"


@server.tool()
async def pid(ctx: Context) -> str:
    await ctx.report_progress(1, None, str(os.getpid()))
    await anyio.sleep_forever()
    return "unreachable"


@server.tool()
async def unpaired(ctx: Context) -> str:
    await ctx.report_progress(1, 2, "before \ud800 after")
    return "x\udc00"


@server.tool()
async def await_cancel(record: str, ctx: Context) -> str:
    # The server's dispatcher applies notifications/cancelled by interrupting this handler;
    # the notification itself is observed by the middleware below, which writes the record.
    await ctx.report_progress(1, None, "started; waits to be cancelled")
    await anyio.sleep_forever()
    return "unreachable"


_records: dict[object, str] = {}


async def _observe_cancels(ctx: Any, call_next: Any) -> Any:
    """Server middleware: remember where each ``await_cancel`` request records, and write
    ``cancelled: <reason>`` there when the client's ``notifications/cancelled`` for it
    arrives."""
    params = ctx.params if isinstance(ctx.params, dict) else {}
    if ctx.method == "tools/call" and params.get("name") == "await_cancel":
        record = (params.get("arguments") or {}).get("record")
        if isinstance(record, str):
            _records[ctx.request_id] = record
    elif ctx.method == "notifications/cancelled":
        record = _records.pop(params.get("requestId"), None)
        if record is not None:
            await anyio.Path(record).write_text(
                f"cancelled: {params.get('reason')}", encoding="utf-8"
            )
    return await call_next(ctx)


server._lowlevel_server.middleware.append(_observe_cancels)


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
