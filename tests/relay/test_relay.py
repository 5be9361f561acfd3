"""The /chat relay over real sockets: auth, rooms, validation, order (uvicorn on 127.0.0.1)."""

from __future__ import annotations

from typing import Any

import pytest
import socketio
from support.relay_helpers import (
    C1,
    C2,
    NS,
    Browser,
    barrier,
    block,
    browsers,
    count,
    frame,
    relay_server,
    worker,
)

pytestmark = pytest.mark.network


async def test_two_browsers_in_two_rooms_see_only_their_own_room() -> None:
    async with relay_server() as (port, relay), browsers(port, C1, C2) as (b1, b2):
        async with worker(port) as w:
            ack1 = await w.call(
                "kx_blocks", frame(C1, [block(1), block(2), block(3)]), namespace=NS
            )
            ack2 = await w.call(
                "kx_blocks",
                frame(C2, [block(1, task_id="t2"), block(2, task_id="t2")]),
                namespace=NS,
            )
        assert ack1 == {"ok": True, "accepted": 3, "rejected": 0}
        assert ack2 == {"ok": True, "accepted": 2, "rejected": 0}
        await b1.wait_for(count(3))
        await b2.wait_for(count(2))
        await barrier(b1, port)
        await barrier(b2, port)
        assert b1.blocks == [block(1), block(2), block(3)]
        assert b2.blocks == [block(1, task_id="t2"), block(2, task_id="t2")]
        assert relay.stats()["blocks_emitted"] == 5


async def test_a_browser_cannot_make_the_relay_broadcast() -> None:
    async with relay_server() as (port, relay), browsers(port, C1, C1) as (attacker, victim):
        await attacker.client.emit("tool_event_stream", block(1), namespace=NS)
        nack = await attacker.client.call("kx_blocks", frame(C1, [block(2)]), namespace=NS)
        nack_chat = await attacker.client.call(
            "kx_chat_event", {"room": C1, "event": {"x": 1}}, namespace=NS
        )
        await barrier(attacker, port)
        await barrier(victim, port)
        assert nack == {"ok": False, "error": "forbidden"}
        assert nack_chat == {"ok": False, "error": "forbidden"}
        assert victim.blocks == []
        assert attacker.blocks == []
        assert victim.chat_events == []
        stats = relay.stats()
        assert stats["rejected_unknown_event"] == 1
        assert stats["rejected_not_internal"] == 2
        assert stats.get("blocks_emitted", 0) == 0


async def test_join_goes_through_the_authorization_hook() -> None:
    def only_own(identity: Any, conversation: str) -> bool:
        return conversation != "someone-elses"

    async with relay_server(authorize_join=only_own) as (port, relay):
        b = Browser()
        try:
            await b.connect(port)
            refused = await b.join("someone-elses")
            assert refused == {"ok": False, "error": "forbidden"}
            bad = await b.client.call("join_conversation", {"nope": 1}, namespace=NS)
            assert bad["ok"] is False
            async with worker(port) as w:
                await w.call("kx_blocks", frame("someone-elses", [block(1)]), namespace=NS)
            await barrier(b, port)
            assert b.blocks == []
            assert relay.stats()["join_refused"] == 1
        finally:
            await b.close()


async def test_browser_authentication_hook() -> None:
    async def token_only(auth: Any, environ: Any) -> Any:
        if isinstance(auth, dict) and auth.get("token") == "good":
            return {"user": "alice"}
        return None

    seen: list[Any] = []

    def remember(identity: Any, conversation: str) -> bool:
        seen.append(identity)
        return True

    async with relay_server(authenticate=token_only, authorize_join=remember) as (port, _):
        anonymous = Browser(reconnect=False)
        with pytest.raises(socketio.exceptions.ConnectionError):
            await anonymous.connect(port)
        await anonymous.close()
        alice = Browser()
        try:
            await alice.connect(port, auth={"token": "good"})
            assert await alice.join(C1) == {"ok": True}
        finally:
            await alice.close()
    assert seen == [{"user": "alice"}]


@pytest.mark.parametrize("secret", ["wrong", "", 12345, None])
async def test_wrong_or_missing_internal_secret_is_refused(secret: Any) -> None:
    async with relay_server() as (port, relay):
        with pytest.raises(socketio.exceptions.ConnectionError):
            async with worker(port, secret=secret):
                pass
        assert relay.stats()["rejected_bad_secret"] == 1
        assert relay.stats()["internal"] == 0


async def test_invalid_and_oversized_blocks_are_dropped_and_counted() -> None:
    bad_call_id = block(2, call_id="NOT-HEX")
    huge = block(3, text="x" * 5000)
    async with relay_server(max_block_bytes=4096) as (port, relay), browsers(port, C1) as (b,):
        async with worker(port) as w:
            ack = await w.call(
                "kx_blocks",
                frame(C1, [block(1), bad_call_id, huge, "junk", block(4)]),
                namespace=NS,
            )
            bad_frame = await w.call("kx_blocks", {"room": C1, "blocks": []}, namespace=NS)
            too_many = await w.call("kx_blocks", frame(C1, [block(9)] * 1001), namespace=NS)
        assert ack == {
            "ok": True,
            "accepted": 2,
            "rejected": 3,
            "refused": [
                {"index": 1, "reason": "invalid"},
                {"index": 2, "reason": "too_large"},
                {"index": 3, "reason": "invalid"},
            ],
            "maxBlockBytes": 4096,
        }
        assert bad_frame["ok"] is False
        assert too_many["ok"] is False
        await barrier(b, port)
        assert b.blocks == [block(1), block(4)]
        stats = relay.stats()
        assert stats["rejected_invalid"] == 2
        assert stats["rejected_too_large"] == 1
        assert stats["rejected_bad_frame"] == 1
        assert stats["rejected_frame_too_large"] == 1


async def test_order_is_kept_from_worker_to_browser_without_waiting_for_acks() -> None:
    async with relay_server() as (port, _), browsers(port, C1) as (b,):
        expected: list[dict[str, Any]] = []
        async with worker(port) as w:
            seq = 0
            for i in range(150):
                blocks = []
                for _ in range(1 + i % 5):
                    seq += 1
                    blocks.append(block(seq))
                expected.extend(blocks)
                await w.emit("kx_blocks", frame(C1, blocks), namespace=NS)  # no ack awaited
            await w.call("kx_blocks", frame(C1, []), namespace=NS)
        await b.wait_for(count(len(expected)))
        assert [x["envelope"]["seq"] for x in b.blocks] == list(range(1, seq + 1))


@pytest.mark.redis
async def test_order_is_kept_when_emits_wait_on_redis(redis_server: Any) -> None:
    # With a pub/sub manager each emit awaits a publish: a frame its own handler is emitting
    # is still running when the next frames arrive, which queue behind it (and a chat event
    # among them keeps its place).
    async with (
        relay_server(redis_url=redis_server.url) as (port, relay),
        browsers(port, C1) as (b,),
    ):
        expected: list[dict[str, Any]] = []
        async with worker(port) as w:
            seq = 0
            for i in range(120):
                blocks = []
                for _ in range(1 + i % 4):
                    seq += 1
                    blocks.append(block(seq))
                expected.extend(blocks)
                await w.emit("kx_blocks", frame(C1, blocks), namespace=NS)
                if i == 60:
                    event = {"room": C1, "event": {"eventId": "e-mid"}}
                    await w.emit("kx_chat_event", event, namespace=NS)
            assert await w.call("kx_blocks", frame(C1, []), namespace=NS) == {
                "ok": True,
                "accepted": 0,
                "rejected": 0,
            }
        await b.wait_for(count(len(expected)))
        assert [x["envelope"]["seq"] for x in b.blocks] == list(range(1, seq + 1))
        assert b.chat_events == [{"eventId": "e-mid"}]
        position = b.order.index("chat_event")
        before = b.order[:position].count("tool_event_stream")
        assert before == sum(1 + i % 4 for i in range(61))
        assert relay.stats()["blocks_emitted"] == seq


async def test_chat_event_is_relayed_in_order_with_the_blocks() -> None:
    async with relay_server() as (port, _), browsers(port, C1) as (b,):
        async with worker(port) as w:
            await w.emit("kx_chat_event", {"room": C1, "event": {"eventId": "e1"}}, namespace=NS)
            await w.call("kx_blocks", frame(C1, [block(1)]), namespace=NS)
        await b.wait_for(count(1))
        assert b.chat_events == [{"eventId": "e1"}]
        assert b.order == ["chat_event", "tool_event_stream"]


async def test_a_re_sent_terminal_is_acknowledged_but_emitted_once() -> None:
    final = block(5, state="done", text="the answer")
    async with relay_server() as (port, relay), browsers(port, C1) as (b,):
        async with worker(port) as w:
            first = await w.call("kx_blocks", frame(C1, [final]), namespace=NS)
            again = await w.call("kx_blocks", frame(C1, [final]), namespace=NS)
        assert first == again == {"ok": True, "accepted": 1, "rejected": 0}
        await barrier(b, port)
        assert b.blocks == [final]
        assert relay.stats()["duplicate_terminal"] == 1


async def test_without_catch_up_a_terminal_sent_to_an_empty_room_reaches_a_late_joiner() -> None:
    """catch_up=False: only the terminal is held for late joiners (tests/relay/test_catch_up.py
    has what catch-up keeps)."""
    final = block(5, state="aborted", text="peer failed")
    async with relay_server(catch_up=False) as (port, relay):
        async with worker(port) as w:
            await w.call("kx_blocks", frame(C1, [block(4), final]), namespace=NS)
        async with browsers(port, C1, C1) as (late, other):
            await late.wait_for(count(1))
            await other.wait_for(count(1))
            assert await late.join(C1) == {"ok": True}  # a second join sends nothing again
            await barrier(late, port)
            assert late.blocks == [final]  # the running block is not kept
            assert other.blocks == [final]
        assert relay.stats()["late_terminals"] == 2


async def test_a_frame_of_several_rooms_goes_to_each_room_in_order() -> None:
    bad = dict(block(2), callId="NOT-HEX")
    rooms_frame = {
        "v": 1,
        "rooms": [
            {"room": C1, "blocks": [block(1), bad]},
            {"room": C2, "blocks": [block(1, task_id="task-2"), block(2, task_id="task-2")]},
            {"room": C1, "blocks": [block(3)]},
        ],
    }
    async with (
        relay_server(max_block_bytes=4096) as (port, relay),
        browsers(port, C1, C2) as (b1, b2),
    ):
        async with worker(port) as w:
            hello = await w.call("kx_hello", {"v": 1}, namespace=NS)
            ack = await w.call("kx_blocks", rooms_frame, namespace=NS)
        await barrier(b1, port)
        await barrier(b2, port)
    assert hello == {
        "ok": True,
        "v": 1,
        "frames": ["rooms"],
        "maxFrameBlocks": 1000,
        "maxBlockBytes": 4096,
        "acks": "paced",
    }
    # the refused block's index counts the blocks of the whole frame, in order
    assert ack == {
        "ok": True,
        "accepted": 4,
        "rejected": 1,
        "refused": [{"index": 1, "reason": "invalid"}],
        "maxBlockBytes": 4096,
    }
    assert b1.blocks == [block(1), block(3)]
    assert b2.blocks == [block(1, task_id="task-2"), block(2, task_id="task-2")]
    assert relay.stats()["frames"] == 1


@pytest.mark.parametrize(
    "rooms",
    [
        [],
        "conv-1",
        [["conv-1", []]],
        [{"room": "", "blocks": []}],
        [{"room": "x" * 513, "blocks": []}],
        [{"room": 5, "blocks": []}],
        [{"room": "conv-1", "blocks": "junk"}],
        [{"room": "conv-1"}],
        [{"room": "conv-1", "blocks": []}] * 1001,
    ],
    ids=[
        "empty",
        "not-a-list",
        "entry-not-a-map",
        "empty-room",
        "long-room",
        "room-not-a-string",
        "blocks-not-a-list",
        "no-blocks",
        "too-many-rooms",
    ],
)
async def test_a_bad_frame_of_several_rooms_is_refused_whole(rooms: Any) -> None:
    async with relay_server() as (port, relay), browsers(port, C1) as (b,):
        async with worker(port) as w:
            mixed = {"v": 1, "rooms": [{"room": C1, "blocks": [block(1)]}, *rooms]}
            answer = await w.call("kx_blocks", {"v": 1, "rooms": rooms}, namespace=NS)
            answer_mixed = await w.call("kx_blocks", mixed, namespace=NS)
        await barrier(b, port)
    assert answer["ok"] is False
    if rooms:  # a good entry before a bad one goes nowhere either
        assert answer_mixed["ok"] is False
        assert b.blocks == []
    else:  # only the good entry: a valid frame
        assert answer_mixed["ok"] is True
        assert b.blocks == [block(1)]
    assert relay.stats()["rejected_bad_frame"] == (2 if rooms else 1)


async def test_too_many_blocks_over_the_rooms_of_a_frame_are_refused() -> None:
    half = [block(i + 1) for i in range(501)]
    frame_ = {"v": 1, "rooms": [{"room": C1, "blocks": half}, {"room": C2, "blocks": half}]}
    async with relay_server() as (port, relay), browsers(port, C1) as (b,):
        async with worker(port) as w:
            answer = await w.call("kx_blocks", frame_, namespace=NS)
        await barrier(b, port)
    assert answer == {"ok": False, "error": "more than 1000 blocks in a frame"}
    assert b.blocks == []
    assert relay.stats()["rejected_frame_too_large"] == 1


async def test_only_internal_senders_are_told_the_relay_s_frames() -> None:
    async with relay_server() as (port, relay), browsers(port, C1) as (b,):
        answer = await b.client.call("kx_hello", {"v": 1}, namespace=NS)
    assert answer == {"ok": False, "error": "forbidden"}
    assert relay.stats()["rejected_not_internal"] == 1
