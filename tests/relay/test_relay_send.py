"""The relay's own emit to one room's browsers (``kernel_ext.relay._send.send_local``) is
python-socketio's ``emit`` without a task per browser: the rule is python-socketio's, the
copy is ours. Driven side by side with generated data (non-ASCII, lone surrogates, binary
attachments, nesting), rooms (a room, a sid, every connection) and skip lists, on a real
server with real clients over 127.0.0.1: every browser receives the same thing from both,
in the same order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import socketio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from socketio.async_pubsub_manager import AsyncPubSubManager
from support.network import serve_asgi
from support.timing import wait_until

from kernel_ext.relay._send import local_sends, send_local

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]

NS = "/chat"
ROOMS = ("room-a", "room-b")
# Three browsers: two in room-a (one of them also in room-b), one in room-b.
MEMBERSHIP = (("room-a",), ("room-a", "room-b"), ("room-b",))

json_leaf = st.one_of(
    st.none(),  # at the top: an emit with no argument
    st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),  # any code point, a lone surrogate included
    st.binary(max_size=16),  # an attachment: a binary packet
)
payloads = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
targets = st.one_of(st.sampled_from(ROOMS), st.none(), st.integers(0, 2))  # int: that sid
skips = st.lists(st.integers(0, 2), max_size=3, unique=True)


class _Browser:
    def __init__(self) -> None:
        self.client = socketio.AsyncClient(reconnection=False)
        self.got: list[tuple[str, Any]] = []
        self.changed = asyncio.Event()
        for event in ("by_emit", "by_send", "barrier"):
            self.client.on(event, self._recorder(event), namespace=NS)

    def _recorder(self, event: str) -> Any:
        def record(*args: Any) -> None:
            self.got.append((event, args))
            self.changed.set()

        return record


@asynccontextmanager
async def _server() -> AsyncIterator[tuple[socketio.AsyncServer, list[_Browser], list[str]]]:
    sio = socketio.AsyncServer(async_mode="asgi")
    sids: list[str] = []

    @sio.on("connect", namespace=NS)  # type: ignore[misc]
    async def connect(sid: str, environ: Any, auth: Any) -> None:
        for room in MEMBERSHIP[auth["index"]]:
            await sio.enter_room(sid, room, namespace=NS)
        sids.append(sid)

    async with AsyncExitStack() as stack:
        port = await stack.enter_async_context(serve_asgi(socketio.ASGIApp(sio)))
        browsers = []
        for index in range(len(MEMBERSHIP)):
            browser = _Browser()
            await browser.client.connect(
                f"http://127.0.0.1:{port}",
                namespaces=[NS],
                transports=["websocket"],
                auth={"index": index},
                wait_timeout=10,
            )
            stack.push_async_callback(browser.client.disconnect)
            browsers.append(browser)
        by_index = [browser.client.get_sid(NS) for browser in browsers]
        await wait_until(lambda: len(sids) == len(MEMBERSHIP), 10, "browsers did not connect")
        yield sio, browsers, by_index


async def _barrier(sio: socketio.AsyncServer, browsers: list[_Browser], mark: int) -> None:
    await sio.emit("barrier", mark, namespace=NS)
    for browser in browsers:
        await wait_until(
            lambda b=browser: ("barrier", (mark,)) in b.got, 10, "barrier", wake=browser.changed
        )


def test_only_the_in_process_manager_sends_locally() -> None:
    assert local_sends(socketio.AsyncManager())
    pubsub = AsyncPubSubManager(channel="kx-test", write_only=True)
    assert not local_sends(pubsub)

    class Custom(socketio.AsyncManager):  # type: ignore[misc]
        pass

    assert not local_sends(Custom())  # a manager of its own keeps its own emit


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.tuples(payloads, targets, skips), min_size=1, max_size=12))
def test_every_browser_receives_from_send_local_what_it_receives_from_emit(
    cases: list[tuple[Any, Any, list[int]]],
) -> None:
    async def run() -> None:
        async with _server() as (sio, browsers, sids):
            for mark, (data, target, skip_at) in enumerate(cases):
                room = sids[target] if isinstance(target, int) else target
                skip = [sids[i] for i in skip_at] or None
                await sio.emit("by_emit", data, room=room, skip_sid=skip, namespace=NS)
                await _barrier(sio, browsers, 2 * mark)
                sent = await send_local(sio, NS, "by_send", data, room, skip)
                await _barrier(sio, browsers, 2 * mark + 1)
                reached = 0
                for browser in browsers:
                    between = [got for got in browser.got if got[0] != "barrier"]
                    browser.got.clear()
                    by_emit = [d for event, d in between if event == "by_emit"]
                    by_send = [d for event, d in between if event == "by_send"]
                    assert by_send == by_emit, (data, room, skip)
                    reached += bool(by_send)
                assert sent == reached

    asyncio.run(asyncio.wait_for(run(), 100))
