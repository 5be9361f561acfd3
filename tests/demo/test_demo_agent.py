"""The demo worker's agent, in process, on each kernel (``--kernel``: pydantic-ai,
langgraph): it announces each call before the call's blocks and attributes both, asks the
two colleagues at once, answers each message in its own language and remembers the last 64
conversations.

The agent needs pydantic-ai (Python ≥ 3.11), the langgraph kernel langgraph: those tests
skip without them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.demo_helpers import FIRST_QUESTION
from support.demo_helpers import skip_unless_kernel as _kernel
from support.network import free_port, serve_asgi

from kernel_ext.demo.script import KERNELS, wording


@pytest.mark.network
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kernel", KERNELS)
async def test_the_agent_announces_each_call_before_its_blocks_and_attributes_both(
    kernel: str,
) -> None:
    _kernel(kernel)
    from opentelemetry.sdk.trace import TracerProvider

    from kernel_ext.demo.agent import ConversationAgent
    from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK, demo_peer
    from kernel_ext.demo.script import COLLEAGUES
    from kernel_ext.demo.worker import Colleague, DemoAgent
    from kernel_ext.testing import MemoryEmitter
    from kernel_ext.worker.wiring import adisable, enable

    ports = [free_port() for _ in COLLEAGUES]
    peers = [
        demo_peer(f"http://127.0.0.1:{p}/", name=spec.title, beat=0.02)
        for spec, p in zip(COLLEAGUES, ports, strict=True)
    ]
    colleagues = [
        Colleague(spec.key, spec.title, f"http://127.0.0.1:{p}/", spec.script)
        for spec, p in zip(COLLEAGUES, ports, strict=True)
    ]
    provider = TracerProvider()
    emitter = MemoryEmitter()
    agent: ConversationAgent
    if kernel == "langgraph":
        from kernel_ext.demo.graph_agent import GraphAgent
        from kernel_ext.integrations.langchain import langchain_targets

        wired = enable(emitter=emitter, tracer_provider=provider, targets=langchain_targets())
        agent = GraphAgent(colleagues, hub=wired.hub, timeout=30)
    else:
        wired = enable(emitter=emitter, tracer_provider=provider)
        agent = DemoAgent(colleagues, provider, hub=wired.hub, timeout=30)
    try:
        async with serve_asgi(peers[0].app, ports[0]), serve_asgi(peers[1].app, ports[1]):
            await emitter.start()
            answer = await agent.answer("demo-room", FIRST_QUESTION)
            assert await emitter.flush(5)
    finally:
        await adisable()
        for peer in peers:
            await peer.aclose()
        provider.shutdown()

    assert answer.startswith("两位同事的答复：\n")
    assert f"订单组：{ORDERS_DESK['zh'].answer}" in answer
    assert f"承运商（第三方）：{CARRIER['zh'].answer}" in answer
    order = emitter.order
    assert all(room == "demo-room" for _, room, _ in order)
    tools = [e for kind, _, e in order if kind == "chat_event" and e["eventScene"] == "tool"]
    calling = {e["eventId"]: e for e in tools if e["status"] == "calling"}
    finished = {e["eventId"]: e for e in tools if e["status"] == "finished"}
    assert len(calling) == 2
    assert set(finished) == set(calling)
    by_colleague = {
        e["content"]["toolCall"]["functionCall"]["arguments"]["colleague"]: call_id
        for call_id, e in calling.items()
    }
    assert set(by_colleague) == {"orders", "carrier"}

    def index(predicate: Any) -> int:
        return next(i for i, item in enumerate(order) if predicate(item))

    for call_id in calling:
        blocks = [
            b for kind, _, b in order if kind == "tool_event_stream" and b["callId"] == call_id
        ]
        terminals = [b for b in blocks if b["state"] != "running"]
        assert [b["state"] for b in terminals] == ["done"]
        snapshot_at = index(lambda it, c=call_id: it[2].get("eventId") == c)
        first_block_at = index(lambda it, c=call_id: it[2].get("callId") == c)
        assert snapshot_at < first_block_at
        done_at = index(lambda it, c=call_id: it[2].get("callId") == c and it[2]["state"] == "done")
        returned_at = index(
            lambda it, c=call_id: it[2].get("eventId") == c and it[2]["status"] == "finished"
        )
        assert done_at < returned_at
        assert finished[call_id]["content"]["toolReturn"].endswith(
            terminals[0]["envelope"]["payload"]["text"]
        )
    orders_kinds = {
        b["envelope"]["kind"] for b in emitter.blocks() if b["callId"] == by_colleague["orders"]
    }
    carrier_kinds = {
        b["envelope"]["kind"] for b in emitter.blocks() if b["callId"] == by_colleague["carrier"]
    }
    assert {"thinking", "tool_call", "text"} <= orders_kinds
    assert carrier_kinds == {"text"}
    # The calls ran at the same time: both were under way before either one ended.
    last_start = max(index(lambda it, c=c: it[2].get("eventId") == c) for c in calling)
    first_end = min(
        index(lambda it, c=c: it[2].get("callId") == c and it[2]["state"] == "done")
        for c in calling
    )
    assert last_start < first_end


@pytest.mark.parametrize("kernel", KERNELS)
async def test_each_message_is_answered_in_its_own_language(kernel: str) -> None:
    """Without colleagues every call returns "no such colleague": no network needed."""
    _kernel(kernel)
    from kernel_ext.demo.agent import ConversationAgent
    from kernel_ext.stream import StreamHub

    agent: ConversationAgent
    if kernel == "langgraph":
        from kernel_ext.demo.graph_agent import GraphAgent

        agent = GraphAgent([], hub=StreamHub(), lang="zh")
    else:
        from opentelemetry.sdk.trace import TracerProvider

        from kernel_ext.demo.worker import DemoAgent

        agent = DemoAgent([], TracerProvider(), hub=StreamHub(), lang="zh")

    def expected(lang: str) -> str:
        words = wording(lang)
        return f"{words.answer_one}\n{words.no_such_colleague.format(key=repr('orders'))}"

    assert await agent.answer("demo-0", "hello", "en") == expected("en")
    assert await agent.answer("demo-0", "hello again") == expected("zh")  # the agent's own
    assert await agent.answer("demo-0", "and once more", "en") == expected("en")
    assert await agent.answer("demo-1", "你好", "zh") == expected("zh")
    with pytest.raises(ValueError, match="the demo speaks zh and en"):
        await agent.answer("demo-0", "bonjour", "fr")


@pytest.mark.parametrize("kernel", KERNELS)
async def test_the_agent_remembers_the_last_64_conversations(kernel: str) -> None:
    """Without colleagues every call returns "no such colleague": no network needed."""
    _kernel(kernel)
    from kernel_ext.demo.agent import MAX_CONVERSATIONS, ConversationAgent
    from kernel_ext.stream import StreamHub

    agent: ConversationAgent
    remembered: Any
    if kernel == "langgraph":
        from kernel_ext.demo.graph_agent import GraphAgent

        graph = agent = GraphAgent([], hub=StreamHub(), lang="en")

        def remembered(room: str) -> int:  # the user's messages in the thread's checkpoint
            saved = graph.checkpointer.get_tuple({"configurable": {"thread_id": room}})
            if saved is None:
                return 0
            messages = saved.checkpoint["channel_values"]["messages"]
            return sum(1 for m in messages if m.type == "human")

    else:
        from opentelemetry.sdk.trace import TracerProvider

        from kernel_ext.demo.worker import DemoAgent

        typed = agent = DemoAgent([], TracerProvider(), hub=StreamHub(), lang="en")

        def remembered(room: str) -> int:
            return sum(
                1
                for m in typed._history.get(room, [])
                for p in m.parts
                if p.part_kind == "user-prompt"
            )

    words = wording("en")
    expected = f"{words.answer_one}\n{words.no_such_colleague.format(key=repr('orders'))}"
    assert await agent.answer("demo-0", "hello") == expected
    assert await agent.answer("demo-0", "hello again") == expected
    assert remembered("demo-0") == 2
    for n in range(1, MAX_CONVERSATIONS):
        await agent.answer(f"demo-{n}", "hello")
    assert remembered("demo-0") == 2  # 64 conversations: all kept
    await agent.answer(f"demo-{MAX_CONVERSATIONS}", "hello")
    assert remembered("demo-0") == 0  # the 65th: the least recently answered is forgotten
    assert remembered("demo-1") == 1
    assert remembered(f"demo-{MAX_CONVERSATIONS}") == 1


@pytest.mark.network
@pytest.mark.timeout(90)
@pytest.mark.parametrize("lang", ["zh", "en"])
@pytest.mark.parametrize("kernel", KERNELS)
async def test_a_colleague_stopped_from_its_pane_is_named_and_the_answer_uses_the_other(
    kernel: str, lang: str
) -> None:
    """Issue 35, point 5: the carrier's call is stopped (``kernel_ext.stop_call``, as the
    relay's ``kx_stop`` calls it) while it works; its task ends ``canceled`` at its a2a-sdk
    server, its pane with one stopped ``aborted`` block and its snapshot's ``toolReturn``
    with the stopped result; the orders desk's call goes on to ``done``, and the agent's
    answer quotes the orders desk and says the carrier was stopped."""
    _kernel(kernel)
    from a2a.client import create_client
    from a2a.types import GetTaskRequest, TaskState
    from opentelemetry.sdk.trace import TracerProvider

    from kernel_ext import stop_call
    from kernel_ext.demo.agent import ConversationAgent
    from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK, demo_peer
    from kernel_ext.demo.script import COLLEAGUES
    from kernel_ext.demo.worker import Colleague, DemoAgent
    from kernel_ext.stop import STOPPED_RESULT_LEAD
    from kernel_ext.testing import MemoryEmitter
    from kernel_ext.worker.wiring import adisable, enable

    words = wording(lang)
    ports = {spec.key: free_port() for spec in COLLEAGUES}
    # The carrier takes minutes a step: it is still at work when it is stopped.
    beats = {"orders": 0.02, "carrier": 60.0}
    peers = {
        spec.key: demo_peer(
            f"http://127.0.0.1:{ports[spec.key]}/", name=spec.title, beat=beats[spec.key]
        )
        for spec in COLLEAGUES
    }
    colleagues = [
        Colleague(spec.key, words.title(spec.key), peers[spec.key].url, spec.script)
        for spec in COLLEAGUES
    ]
    provider = TracerProvider()
    emitter = MemoryEmitter()
    agent: ConversationAgent
    if kernel == "langgraph":
        from kernel_ext.demo.graph_agent import GraphAgent
        from kernel_ext.integrations.langchain import langchain_targets

        wired = enable(emitter=emitter, tracer_provider=provider, targets=langchain_targets())
        agent = GraphAgent(colleagues, hub=wired.hub, timeout=60)
    else:
        wired = enable(emitter=emitter, tracer_provider=provider)
        agent = DemoAgent(colleagues, provider, hub=wired.hub, timeout=60)

    def carrier_call() -> str | None:
        for _, event in emitter.chat_events:
            call = event.get("content", {}).get("toolCall")
            if call and call["functionCall"]["arguments"]["colleague"] == "carrier":
                return str(event["eventId"])
        return None

    try:
        async with (
            serve_asgi(peers["orders"].app, ports["orders"]),
            serve_asgi(peers["carrier"].app, ports["carrier"]),
        ):
            await emitter.start()
            answering = asyncio.ensure_future(agent.answer("demo-room", words.questions[0], lang))
            records = await emitter.wait_for(
                lambda records: any(b["callId"] == carrier_call() for _, b in records), 30
            )
            call_id = carrier_call()
            assert call_id is not None
            task_id = next(b["taskId"] for _, b in records if b["callId"] == call_id)
            assert stop_call(call_id) == "stopping"
            answer = await asyncio.wait_for(answering, 60)
            assert await emitter.flush(5)
            client = await create_client(peers["carrier"].url)
            try:
                task = await client.get_task(GetTaskRequest(id=task_id))
            finally:
                await client.close()
    finally:
        await adisable()
        for peer in peers.values():
            await peer.aclose()
        provider.shutdown()

    assert task.status.state == TaskState.TASK_STATE_CANCELED
    carrier_terminals = [b for b in emitter.terminals() if b["callId"] == call_id]
    assert [(b["state"], b["envelope"]["payload"].get("stopped")) for b in carrier_terminals] == [
        ("aborted", True)
    ]
    orders_terminals = [b for b in emitter.terminals() if b["callId"] != call_id]
    assert [b["state"] for b in orders_terminals] == ["done"]
    finished = [
        e
        for _, e in emitter.chat_events
        if e.get("eventId") == call_id and e["status"] == "finished"
    ]
    assert len(finished) == 1
    said_so_far = CARRIER[lang].steps[0].text
    assert finished[0]["content"]["toolReturn"].startswith(STOPPED_RESULT_LEAD)
    assert said_so_far in finished[0]["content"]["toolReturn"]
    assert answer == "\n".join(
        [
            words.answer_one,
            f"{words.title('orders')}{words.colon}{ORDERS_DESK[lang].answer}",
            words.stopped_one.format(title=words.title("carrier")),
        ]
    )


@pytest.mark.parametrize("lang", ["zh", "en"])
def test_the_scripted_answer_leaves_a_stopped_result_out_and_names_its_colleague(
    lang: str,
) -> None:
    from kernel_ext.demo.agent import scripted_answer
    from kernel_ext.stop import stopped_result

    words = wording(lang)
    orders = f"{words.title('orders')}{words.colon}on its way"
    stopped = stopped_result("the carrier had looked it up")
    line = words.stopped_one.format
    # One answered, one stopped: the answer quotes the one and names the other.
    assert scripted_answer(words, [("orders", orders), ("carrier", stopped)]) == "\n".join(
        [words.answer_one, orders, line(title=words.title("carrier"))]
    )
    # Every call stopped: no intro, a line for each, in order.
    assert scripted_answer(words, [("carrier", stopped), ("orders", stopped_result())]) == (
        "\n".join([line(title=words.title("carrier")), line(title=words.title("orders"))])
    )
    # None stopped: as before the stop existed.
    assert scripted_answer(words, [("orders", orders), ("carrier", "x")]) == "\n".join(
        [words.answer_many, orders, "x"]
    )
    # A call whose colleague is unknown is named by what is known of it.
    assert scripted_answer(words, [(None, stopped)]) == line(title="?")
