"""Contracts of the private names kernel_ext reads (kernel_ext._shared.compat).

These FAIL, not fall back, on the versions the test environment pins: a release that moves
one of them must be looked at (and pyproject's upper bounds raised) deliberately.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
from typing import Any

import pytest
import socketio
from support.network import RedisServer, need_module
from support.timing import wait_until

from kernel_ext._shared import compat
from kernel_ext.redis.publish_result import PublishResult


def test_sdk_spans_keep_the_fields_the_processor_reads() -> None:
    assert compat.SDK_SPAN_FIELDS is True
    assert compat.ACTIVE["span_fields"] == "private"


def test_a_span_context_is_a_tuple_whose_item_1_is_the_span_id() -> None:
    assert compat.SPAN_CONTEXT_INDEXED is True
    assert compat.ACTIVE["span_context"] == "private"


def test_the_suppression_keys_are_the_ones_opentelemetry_sets_and_reads() -> None:
    import inspect

    from opentelemetry import context
    from opentelemetry.instrumentation import utils

    assert compat.SUPPRESS_KEYS == (
        context._SUPPRESS_INSTRUMENTATION_KEY,
        utils._SUPPRESS_INSTRUMENTATION_KEY_PLAIN,
    )
    assert compat.ACTIVE["suppress_keys"] == "private"
    # is_instrumentation_enabled() reads these two keys and nothing else.
    source = inspect.getsource(utils.is_instrumentation_enabled)
    assert set(re.findall(r"_SUPPRESS_\w+", source)) == {
        "_SUPPRESS_INSTRUMENTATION_KEY",
        "_SUPPRESS_INSTRUMENTATION_KEY_PLAIN",
    }


def test_python_socketio_redis_publish_returns_what_redis_returned() -> None:
    assert compat.publish_result_supported() is True
    assert compat.ACTIVE["redis_publish_result"] == "private"


@pytest.mark.redis
@pytest.mark.network
async def test_the_publish_result_is_the_receiver_count_of_a_real_redis(
    redis_server: RedisServer,
) -> None:
    class Manager(PublishResult, socketio.AsyncRedisManager):  # type: ignore[misc]
        pass

    manager = Manager(redis_server.url, write_only=True)
    await manager.emit("x", {"a": 1}, namespace="/chat", room="r")
    assert manager.last_receivers == 0  # nobody subscribed
    listener = socketio.AsyncRedisManager(redis_server.url)
    listener.set_server(socketio.AsyncServer())
    task = asyncio.get_running_loop().create_task(listener._thread())

    async def received() -> bool:
        await manager.emit("x", {"a": 1}, namespace="/chat", room="r")
        return manager.last_receivers == 1

    try:
        await wait_until(received, 10, "the listener never subscribed", interval=0.02)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
    assert manager.last_receivers == 1


@pytest.mark.redis
@pytest.mark.network
async def test_emit_tags_reach_the_channel_inside_the_emit_message(
    redis_server: RedisServer,
) -> None:
    from redis import asyncio as aioredis

    class Manager(PublishResult, socketio.AsyncRedisManager):  # type: ignore[misc]
        pass

    subscriber = aioredis.Redis.from_url(redis_server.url)
    pubsub = subscriber.pubsub(ignore_subscribe_messages=True)
    manager = Manager(redis_server.url, write_only=True)
    manager.emit_tags = {"kx_worker": "w-1"}
    try:
        await pubsub.subscribe("socketio")
        await manager.emit("x", {"a": 1}, namespace="/chat", room="r")
        message = None

        async def read() -> bool:  # the first reads return the (ignored) subscribe reply
            nonlocal message
            message = await pubsub.get_message(timeout=1)
            return message is not None

        await wait_until(read, 10, "nothing was published")
        published = json.loads(message["data"])
        assert published["method"] == "emit"
        assert published["data"] == [{"a": 1}]
        assert published["kx_worker"] == "w-1"
        assert manager.last_receivers == 1
    finally:
        await pubsub.aclose()
        await subscriber.aclose()
        await manager.redis.aclose()


def test_python_socketio_redis_client_can_be_pipelined() -> None:
    assert compat.publish_pipeline_supported() is True
    assert compat.ACTIVE["redis_publish_pipeline"] == "private"


class _Reporting(PublishResult, socketio.AsyncRedisManager):  # type: ignore[misc]
    """python-socketio's manager with kernel_ext's publish reporting, as the senders use it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, int | None]] = []

    def _published(self, data: object, receivers: int | None) -> None:
        assert isinstance(data, dict)
        self.seen.append((data["data"][0]["n"], receivers))


async def _read_all(pubsub: object, n: int) -> list[dict[str, object]]:
    got: list[dict[str, object]] = []

    async def read() -> bool:
        message = await pubsub.get_message(timeout=1)  # type: ignore[attr-defined]
        if message is not None:
            got.append(json.loads(message["data"]))
        return len(got) >= n

    await wait_until(read, 10, f"{len(got)} of {n} messages arrived")
    return got


@pytest.mark.redis
@pytest.mark.network
async def test_pipelined_publishes_leave_together_in_order_at_the_blocks_end(
    redis_server: RedisServer,
) -> None:
    """What a task emits inside ``pipelined()`` is held until the block ends (a marker
    published meanwhile on another connection arrives first), then published in order with
    each message's receiver count; another task's emits are not held."""
    from redis import asyncio as aioredis

    subscriber = aioredis.Redis.from_url(redis_server.url)
    pubsub = subscriber.pubsub(ignore_subscribe_messages=True)
    manager = _Reporting(redis_server.url, write_only=True)
    other = aioredis.Redis.from_url(redis_server.url)
    try:
        await pubsub.subscribe("socketio")
        async with manager.pipelined() as receivers:
            for n in range(300):
                await manager.emit("x", {"n": n}, namespace="/chat", room="r")

            async def elsewhere() -> None:  # another task: published at once
                await manager.emit("x", {"n": "other task"}, namespace="/chat", room="r")

            await asyncio.get_running_loop().create_task(elsewhere())
            await other.publish("socketio", json.dumps({"data": [{"n": "marker"}]}))
            assert receivers == []
        assert receivers == [1] * 300
        got = [m["data"][0]["n"] for m in await _read_all(pubsub, 302)]  # type: ignore[index]
        assert got == ["other task", "marker", *range(300)]
        assert manager.seen == [("other task", 1), *((n, 1) for n in range(300))]
        assert manager.last_receivers == 1
    finally:
        await pubsub.aclose()
        await subscriber.aclose()
        await other.aclose()
        if manager.redis is not None:
            await manager.redis.aclose()


@pytest.mark.redis
@pytest.mark.network
async def test_a_pipelined_block_that_raises_still_publishes_what_it_emitted(
    redis_server: RedisServer,
) -> None:
    from redis import asyncio as aioredis

    subscriber = aioredis.Redis.from_url(redis_server.url)
    pubsub = subscriber.pubsub(ignore_subscribe_messages=True)
    manager = _Reporting(redis_server.url, write_only=True)
    try:
        await pubsub.subscribe("socketio")

        async def emit_two_then_raise() -> None:
            async with manager.pipelined():
                await manager.emit("x", {"n": 0}, namespace="/chat", room="r")
                await manager.emit("x", {"n": 1}, namespace="/chat", room="r")
                raise RuntimeError("half way")

        with pytest.raises(RuntimeError, match="half way"):
            await emit_two_then_raise()
        got = [m["data"][0]["n"] for m in await _read_all(pubsub, 2)]  # type: ignore[index]
        assert got == [0, 1]
    finally:
        await pubsub.aclose()
        await subscriber.aclose()
        if manager.redis is not None:
            await manager.redis.aclose()


async def test_a_cancelled_pipelined_block_publishes_nothing() -> None:
    manager = _Reporting("redis://127.0.0.1:1/0", write_only=True)
    entered = asyncio.Event()

    async def body() -> None:
        async with manager.pipelined():
            await manager.emit("x", {"n": 0}, namespace="/chat", room="r")
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.get_running_loop().create_task(body())
    await asyncio.wait_for(entered.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert manager.seen == []
    assert manager.redis is None  # never connected: nothing was sent


@pytest.mark.network
async def test_a_pipeline_to_an_unreachable_redis_reports_every_message_failed() -> None:
    from support.network import free_port

    manager = _Reporting(
        f"redis://127.0.0.1:{free_port()}/0",
        write_only=True,
        redis_options={"socket_connect_timeout": 1},
    )
    async with manager.pipelined() as receivers:
        for n in range(3):
            await manager.emit("x", {"n": n}, namespace="/chat", room="r")
    assert receivers == [None, None, None]
    assert manager.seen == [(0, None), (1, None), (2, None)]
    assert manager.last_receivers is None
    assert manager.connected is False  # the next publish connects anew


@pytest.mark.redis
@pytest.mark.network
async def test_without_the_pipeline_the_messages_go_one_by_one_with_the_same_results(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "publish_pipeline_supported", lambda: False)
    manager = _Reporting(redis_server.url, write_only=True)
    try:
        async with manager.pipelined() as receivers:
            for n in range(3):
                await manager.emit("x", {"n": n}, namespace="/chat", room="r")
        assert receivers == [0, 0, 0]  # nobody subscribed
        assert manager.seen == [(0, 0), (1, 0), (2, 0)]
    finally:
        if manager.redis is not None:
            await manager.redis.aclose()


def test_openai_agents_copies_a_function_tool_through_its_invokers_bind_hook() -> None:
    # kernel_ext.integrations.openai_agents answers this hook so that a copy of an
    # attributed tool (copy.copy, tool_namespace()) stays attributed.
    agents = need_module("agents", "pip install openai-agents")
    bound: list[object] = []

    class Invoker:
        async def __call__(self, context: object, arguments: str) -> str:
            return arguments

        def __agents_bind_function_tool__(self, tool: object) -> Invoker:
            bound.append(tool)
            return Invoker()

    tool = agents.FunctionTool(
        name="probe",
        description="probe",
        params_json_schema={"type": "object", "properties": {}, "additionalProperties": False},
        on_invoke_tool=Invoker(),
    )
    assert bound == [tool]  # on construction
    invoker = tool.on_invoke_tool
    copied = copy.copy(tool)
    assert bound == [tool, copied]
    assert isinstance(copied.on_invoke_tool, Invoker)
    assert copied.on_invoke_tool is not invoker


async def test_openai_agents_invoker_runs_its_implementation_inside_its_error_handling() -> None:
    # kernel_ext.integrations.openai_agents puts a watch around the SDK invoker's
    # implementation (its private _invoke_tool_impl) to learn that a tool raised when the
    # invoker turns the exception into the tool's result text; a copy keeps the watch.
    agents = need_module("agents", "pip install openai-agents")
    from agents.tool_context import ToolContext

    @agents.function_tool
    async def explode() -> str:
        """Fail."""
        raise RuntimeError("boom")

    invoker = explode.on_invoke_tool
    implementation = invoker._invoke_tool_impl
    raised: list[BaseException] = []

    async def watched(*args: object) -> object:
        try:
            return await implementation(*args)
        except BaseException as error:
            raised.append(error)
            raise

    invoker._invoke_tool_impl = watched
    context = ToolContext(None, tool_name="explode", tool_call_id="c-1", tool_arguments="{}")
    result = await invoker(context, "{}")
    assert isinstance(result, str)  # the SDK's error text: the exception did not propagate
    assert [str(error) for error in raised] == ["boom"]
    assert copy.copy(explode).on_invoke_tool._invoke_tool_impl is watched


# -- catch-up: what the relay relies on of python-socketio's managers ---------------------
# ChatRelay holds a block for catch-up in the same step as the emit that picks the room's
# browsers, and enters a joining browser into the room in the same step as its last look at
# what it holds (kernel_ext.relay.namespace, ChatRelay._catch_up): that is exact only while
# python-socketio's manager picks an emit's recipients, and enters a room, before it first
# suspends. A release that changes this must fail here.


def _recording(manager: Any) -> list[str]:
    """Give ``manager`` a real python-socketio server whose sends are recorded, not made."""
    server = socketio.AsyncServer(client_manager=manager, async_mode="asgi")
    sent: list[str] = []

    async def record(eio_sid: str, eio_pkt: object) -> None:
        sent.append(eio_sid)

    server._send_eio_packet = record  # type: ignore[method-assign]
    return sent


def _first_step(coroutine: Any) -> bool:
    """Run a coroutine's first step; whether it finished there (no suspension)."""
    try:
        coroutine.send(None)
    except StopIteration:
        return True
    coroutine.close()
    return False


@pytest.mark.parametrize("kind", ["AsyncManager", "AsyncRedisManager"])
async def test_entering_a_room_takes_no_suspension(kind: str) -> None:
    manager = (
        socketio.AsyncManager()
        if kind == "AsyncManager"
        else socketio.AsyncRedisManager("redis://127.0.0.1:1", write_only=True)
    )
    _recording(manager)
    sid = await manager.connect("eio-1", "/chat")
    assert _first_step(manager.enter_room(sid, "/chat", "conv-1"))
    assert "conv-1" in manager.get_rooms(sid, "/chat")


async def test_an_emit_picks_its_recipients_before_it_first_suspends() -> None:
    manager = socketio.AsyncManager()
    sent = _recording(manager)
    first = await manager.connect("eio-1", "/chat")
    await manager.enter_room(first, "/chat", "conv-1")
    emitting = asyncio.ensure_future(
        manager.emit("tool_event_stream", {"v": 1}, "/chat", room="conv-1")
    )
    await asyncio.sleep(0)  # the emit's first step, up to its first suspension
    late = await manager.connect("eio-2", "/chat")
    await manager.enter_room(late, "/chat", "conv-1")  # joins after that step
    await emitting
    assert sent == ["eio-1"]


async def test_a_redis_managers_local_emit_holds_then_picks_in_one_step() -> None:
    """RelayRedisManager holds in ``_handle_emit`` before python-socketio's own
    ``_handle_emit`` reaches the local emit: nothing of python-socketio's may suspend
    before the recipients are picked there either."""
    manager = socketio.AsyncRedisManager("redis://127.0.0.1:1", write_only=True)
    sent = _recording(manager)
    first = await manager.connect("eio-1", "/chat")
    await manager.enter_room(first, "/chat", "conv-1")
    message = {
        "method": "emit",
        "event": "tool_event_stream",
        "data": [{"v": 1}],
        "namespace": "/chat",
        "room": "conv-1",
        "skip_sid": None,
        "callback": None,
    }
    handling = asyncio.ensure_future(manager._handle_emit(message))
    await asyncio.sleep(0)  # its first step, up to its first suspension
    late = await manager.connect("eio-2", "/chat")
    await manager.enter_room(late, "/chat", "conv-1")
    await handling
    assert sent == ["eio-1"]


@pytest.mark.network
async def test_python_engineio_queues_through_create_queue_and_writes_in_batches() -> None:
    """A real server and client: each connection's queue is the one ``create_queue`` made
    (metered), python-engineio's writer takes from it and comes back once it wrote what it
    took (all counted written, catch-up bytes reported both ways), ``send_packet`` queues a
    pre-encoded packet, and closing from the server's side lets the queue go."""
    from support.network import serve_asgi

    deltas: list[int] = []
    sio = socketio.AsyncServer(async_mode="asgi")
    assert compat.meter_queues(sio.eio, deltas.append) is True
    assert compat.ACTIVE["engineio_queue"] == "private"
    got: list[int] = []
    client = socketio.AsyncClient(reconnection=False)
    client.on("n", got.append)
    async with serve_asgi(socketio.ASGIApp(sio)) as port:
        await client.connect(f"http://127.0.0.1:{port}", transports=["websocket"], wait_timeout=5)
        try:
            (eio_sid,) = list(sio.eio.sockets)
            queue = compat.connection_queue(sio.eio, eio_sid)
            assert isinstance(queue, compat.MeteredQueue)
            for n in range(200):
                packet = compat.catch_up_packet(f'2["n",{n}]')
                await compat.send_packet(sio.eio, eio_sid, packet)
            assert queue.peak_packets >= 1
            await wait_until(lambda: len(got) == 200, 10)
            assert got == list(range(200))
            await wait_until(lambda: queue.packets == 0, 10)
            assert (queue.bytes, queue.catch_up_bytes) == (0, 0)
            assert sum(d for d in deltas if d > 0) == sum(len(f'2["n",{n}]') for n in range(200))
            assert sum(deltas) == 0
            assert compat.queued(sio.eio, eio_sid) == (0, 0)
            assert compat.release_closed(sio.eio, eio_sid) is False  # open: left alone
            await compat.close_connection(sio.eio, eio_sid)
            assert compat.connection_queue(sio.eio, eio_sid) is None  # closing
            assert sio.eio.sockets[eio_sid].closed
            assert compat.release_closed(sio.eio, eio_sid) is True
        finally:
            await client.disconnect()


def test_the_metered_queue_counts_what_its_writer_holds_until_it_comes_back() -> None:
    """:class:`MeteredQueue` alone: packets count from ``put`` until the writer's next
    ``get`` (python-engineio's writer takes a batch and writes it before it comes back);
    ``clear`` lets everything go and wakes the waiters."""

    async def run() -> None:
        deltas: list[int] = []
        queue = compat.MeteredQueue(on_catch_up=deltas.append)
        from engineio.packet import MESSAGE, Packet

        queue.put_nowait(Packet(MESSAGE, "abc"))
        queue.put_nowait(compat.catch_up_packet("defgh"))
        queue.put_nowait(None)  # the writer's end: not a packet
        assert (queue.packets, queue.bytes, queue.catch_up_bytes) == (2, 8, 5)
        await queue.get()
        queue.get_nowait()  # the batch: still held until the writer comes back
        assert (queue.packets, queue.bytes) == (2, 8)
        waiting = asyncio.ensure_future(queue.below(1, 1))
        await asyncio.sleep(0)
        assert not waiting.done()
        assert await queue.get() is None  # it came back: written
        assert (queue.packets, queue.bytes, queue.catch_up_bytes) == (0, 0, 0)
        await asyncio.wait_for(waiting, 5)
        assert deltas == [5, -5]
        queue.put_nowait(compat.catch_up_packet("xy"))
        stuck = asyncio.ensure_future(queue.below(1, 1))
        await asyncio.sleep(0)
        queue.clear()
        await asyncio.wait_for(stuck, 5)
        assert (queue.packets, queue.bytes, queue.catch_up_bytes, queue.qsize()) == (0, 0, 0, 0)
        assert deltas == [5, -5, 2, -2]
        assert (queue.peak_packets, queue.peak_bytes) == (2, 8)

    asyncio.run(run())


def test_python_socketio_packets_encode_with_their_class_json_module() -> None:
    """python-socketio's ``Packet`` writes its data with the ``json`` module its class holds
    (the hook :func:`compat.spliced_packet_class` replaces): a marker's text is spliced in as
    it is, anything else is written exactly as python-socketio writes it."""

    class Marker:
        def __init__(self, text: str) -> None:
            self.text = text

    spliced = compat.spliced_packet_class(Marker, json.dumps)
    assert issubclass(spliced, socketio.packet.Packet)
    assert hasattr(socketio.packet.Packet, "json")
    text = '{"v":1,"room":"c-1","blocks":[]}'
    ours = spliced(socketio.packet.EVENT, data=["ev", Marker(text)], namespace="/chat", id=7)
    theirs = socketio.packet.Packet(
        socketio.packet.EVENT, data=["ev", json.loads(text)], namespace="/chat", id=7
    )
    assert ours.encode() == theirs.encode() == '2/chat,7["ev",{"v":1,"room":"c-1","blocks":[]}]'
    other = ["ev", {"a": "中"}]
    assert spliced(socketio.packet.EVENT, data=other).encode() == (
        socketio.packet.Packet(socketio.packet.EVENT, data=other).encode()
    )
    # the spliced text is written as given: the class's json module, not a re-encoding
    odd = spliced(socketio.packet.EVENT, data=["ev", Marker('{"b":1, "a":2}')])
    assert odd.encode() == '2["ev",{"b":1, "a":2}]'


def test_an_emit_is_an_engineio_message_of_the_servers_encoded_event_packet() -> None:
    """What ``AsyncManager.emit`` queues to each connection, made as the relay's own sends
    make it (:func:`compat.packet_makers`): the server's packet class encodes the event,
    python-engineio wraps it as a ``MESSAGE`` (``4``)."""
    message_packet, encode_event = compat.packet_makers()
    server = socketio.AsyncServer(async_mode="asgi")
    encoded = encode_event(server, "/chat", ["tool_event_stream", {"a": "中"}])
    assert (
        encoded
        == server.packet_class(
            socketio.packet.EVENT, namespace="/chat", data=["tool_event_stream", {"a": "中"}]
        ).encode()
    )
    assert isinstance(encoded, str)
    assert encoded.startswith('2/chat,["tool_event_stream",')
    packet = message_packet(encoded)
    assert packet.encode() == "4" + encoded
    assert message_packet(b"\x00\x01").encode() == b"\x00\x01"
    # binary attachments: a list, the text first
    parts = encode_event(server, "/chat", ["ev", b"\x00"])
    assert isinstance(parts, list)
    assert parts[0].startswith("51-/chat,")
    assert parts[1] == b"\x00"


def test_a_failing_socket_found_in_a_traceback_is_closed_and_forgotten() -> None:
    """:func:`compat.close_failing_socket` finds python-engineio's ``AsyncSocket`` as
    ``self`` of a frame, closes it and drops it from its server's ``sockets``; frames
    without one change nothing."""
    import engineio
    from engineio.async_socket import AsyncSocket

    async def run() -> None:
        eio = engineio.AsyncServer(async_mode="asgi")
        socket = AsyncSocket(eio, "sid-1")
        eio.sockets["sid-1"] = socket

        class Frame:
            def __init__(self, owner: Any) -> None:
                self.f_locals = {"self": owner}

        await compat.close_failing_socket([Frame(object())])  # type: ignore[list-item]
        assert eio.sockets == {"sid-1": socket}
        assert not socket.closed
        await compat.close_failing_socket([Frame(object()), Frame(socket)])  # type: ignore[list-item]
        assert eio.sockets == {}
        assert socket.closed

    asyncio.run(run())
