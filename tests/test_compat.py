"""Contracts of the private names kernel_ext reads (kernel_ext._compat).

These FAIL, not fall back, on the versions the test environment pins: a release that moves
one of them must be looked at (and pyproject's upper bounds raised) deliberately.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re

import pytest
import socketio
from network import RedisServer, need_module
from timing import wait_until

from kernel_ext import _compat


def test_sdk_spans_keep_the_fields_the_processor_reads() -> None:
    assert _compat.SDK_SPAN_FIELDS is True
    assert _compat.ACTIVE["span_fields"] == "private"


def test_a_span_context_is_a_tuple_whose_item_1_is_the_span_id() -> None:
    assert _compat.SPAN_CONTEXT_INDEXED is True
    assert _compat.ACTIVE["span_context"] == "private"


def test_the_suppression_keys_are_the_ones_opentelemetry_sets_and_reads() -> None:
    import inspect

    from opentelemetry import context
    from opentelemetry.instrumentation import utils

    assert _compat.SUPPRESS_KEYS == (
        context._SUPPRESS_INSTRUMENTATION_KEY,
        utils._SUPPRESS_INSTRUMENTATION_KEY_PLAIN,
    )
    assert _compat.ACTIVE["suppress_keys"] == "private"
    # is_instrumentation_enabled() reads these two keys and nothing else.
    source = inspect.getsource(utils.is_instrumentation_enabled)
    assert set(re.findall(r"_SUPPRESS_\w+", source)) == {
        "_SUPPRESS_INSTRUMENTATION_KEY",
        "_SUPPRESS_INSTRUMENTATION_KEY_PLAIN",
    }


def test_python_socketio_redis_publish_returns_what_redis_returned() -> None:
    assert _compat.publish_result_supported() is True
    assert _compat.ACTIVE["redis_publish_result"] == "private"


@pytest.mark.redis
@pytest.mark.network
async def test_the_publish_result_is_the_receiver_count_of_a_real_redis(
    redis_server: RedisServer,
) -> None:
    class Manager(_compat.PublishResult, socketio.AsyncRedisManager):  # type: ignore[misc]
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

    class Manager(_compat.PublishResult, socketio.AsyncRedisManager):  # type: ignore[misc]
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
