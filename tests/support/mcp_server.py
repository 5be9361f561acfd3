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
"""

from __future__ import annotations

import os
import sys

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


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
