"""The worker's end of the way back (issue 35, loopback path): the loopback sender answers
the relay's ``kx_stop`` ``{v: 1, callId}`` with ``{answer}``, stopping the running call.

A plain python-socketio server on 127.0.0.1 stands in for the relay (so that malformed
requests the relay never sends can be tried) — it accepts the sender's connection and emits
``kx_stop`` to the sender's sid with a callback, as the relay does
(tests/relay/test_stop_relay.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from support.network import serve_asgi
from support.relay_helpers import emitter_for
from support.timing import wait_until

from kernel_ext import ToolDescription, current_tool_call
from kernel_ext.attribution.tap import Tap
from kernel_ext.instrument._call import begin_scope, run_stoppable
from kernel_ext.protocol import KX_STOP, NAMESPACE
from kernel_ext.stream import StreamHub

pytestmark = pytest.mark.network


@asynccontextmanager
async def stand_in_relay() -> AsyncIterator[tuple[Any, list[str], int]]:
    """A python-socketio server standing in for the relay: accepts every connection on
    ``/chat`` and records the sids; yields the server, the sids and its port."""
    import socketio

    sio = socketio.AsyncServer(async_mode="asgi")
    sids: list[str] = []

    async def connect(sid: str, environ: Any, auth: Any = None) -> bool:
        sids.append(sid)
        return True

    sio.on("connect", connect, namespace=NAMESPACE)
    async with serve_asgi(socketio.ASGIApp(sio)) as port:
        yield sio, sids, port


async def test_kx_stop_stops_the_running_call_and_the_ack_says_so() -> None:
    provider = TracerProvider()
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    live = asyncio.Event()
    seen: list[bool] = []

    async def tool() -> str:
        live.set()
        try:
            await asyncio.Event().wait()
        finally:
            call = current_tool_call()
            seen.append(call is not None and call.stop_requested)
        return "never"

    async with stand_in_relay() as (sio, sids, port):
        emitter = emitter_for(port, hub, ack_timeout=30.0)
        async with emitter:
            await wait_until(lambda: bool(sids) and emitter.healthy)
            active = begin_scope(ToolDescription("slow", "conv-kx-stop"), provider, hub)
            assert active is not None
            assert active.call is not None
            call_id = active.call.call_id
            task = asyncio.create_task(run_stoppable(active, tool))
            await asyncio.wait_for(live.wait(), 10)

            async def ask(data: Any) -> Any:
                return await sio.call(KX_STOP, data, to=sids[-1], namespace=NAMESPACE, timeout=5)

            assert await ask({"v": 1, "callId": call_id}) == {"answer": "stopping"}
            result = await asyncio.wait_for(task, 10)
            assert result.startswith("The user stopped this tool call")
            assert seen == [True]
            assert await ask({"v": 1, "callId": call_id}) == {"answer": "already_ended"}
            assert await ask({"v": 1, "callId": "00000000000000c3"}) == {"answer": "unknown"}
            for bad in [None, "x", [], {"callId": call_id}, {"v": 2, "callId": call_id}]:
                assert await ask(bad) == {"answer": "refused"}, bad
            assert await ask({"v": 1, "callId": 7}) == {"answer": "refused"}
    provider.shutdown()
