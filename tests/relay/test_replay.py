"""The relay's memory for catch-up (kernel_ext.relay.replay), on a fake clock: what it holds,
what gives way at each bound (exactly at it and one byte past it), when streams are
released, and how a join's cursors are read."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from support.relay_helpers import block as relay_block
from support.timing import FakeClock

from kernel_ext.errors import ConfigError
from kernel_ext.protocol import block_size
from kernel_ext.relay.replay import MAX_SEQ, ReplayMemory, read_cursors

ROOM, OTHER = "conv-1", "conv-2"
CALL = "00f067aa0ba902b7"
BLOCK_BOUND = 1024


def block(
    seq: int, *, state: str = "running", task: str = "t", call: str | None = CALL, pad: int = 0
) -> dict[str, Any]:
    """``support.relay_helpers``' block, with a text of fixed width (plus ``pad`` characters)."""
    return relay_block(
        seq, state=state, call_id=call, task_id=task, text=f"block {seq:04d}" + "x" * pad
    )


SIZE = block_size(block(1))  # every block(seq) below 10,000 of task "t" has this size
TASK_SIZE = block_size(block(1, task="old"))  # and of a task with a 3-letter name this one


def memory(**bounds: Any) -> tuple[ReplayMemory, Counter[str], FakeClock]:
    counts: Counter[str] = Counter()
    clock = FakeClock()
    bounds.setdefault("max_block_bytes", SIZE)  # the blocks here: a stream holds 2 at least
    bounds.setdefault("stream_bytes", 100 * SIZE)
    bounds.setdefault("conversation_bytes", 400 * SIZE)
    bounds.setdefault("total_bytes", 1600 * SIZE)

    def count(name: str, n: int) -> None:
        counts[name] += n

    return ReplayMemory(count=count, clock=clock, **bounds), counts, clock


def seqs(blocks: list[Any]) -> list[int]:
    return [b["envelope"]["seq"] for b in blocks]


def test_a_stream_is_caught_up_in_seq_order_with_its_terminal_last() -> None:
    replay, _, _ = memory()
    for seq in (1, 3, 2, 4):  # a peer's seqs may arrive out of order
        replay.add(ROOM, block(seq))
    replay.add(ROOM, block(3))  # a repeated seq is sent once
    replay.add(ROOM, block(5, state="done"))
    blocks, cursors, missing = replay.catch_up(ROOM, {})
    assert seqs(blocks) == [1, 2, 3, 4, 5]
    assert blocks[-1]["state"] == "done"
    assert cursors == {(CALL, "t"): (5, True)}
    assert missing == {}


def test_streams_come_in_the_order_they_started_and_only_of_their_room() -> None:
    replay, _, _ = memory()
    replay.add(ROOM, block(1, task="a"))
    replay.add(OTHER, block(1, task="x"))
    replay.add(ROOM, block(1, task="b"))
    replay.add(ROOM, block(2, task="a"))
    blocks, _, _ = replay.catch_up(ROOM, {})
    assert [(b["taskId"], b["envelope"]["seq"]) for b in blocks] == [("a", 1), ("a", 2), ("b", 1)]
    assert replay.catch_up("conv-none", {})[0] == []


def test_a_cursor_leaves_out_what_the_browser_holds() -> None:
    replay, _, _ = memory()
    for seq in range(1, 7):
        replay.add(ROOM, block(seq))
    replay.add(ROOM, block(7, state="done"))
    assert seqs(replay.catch_up(ROOM, {(CALL, "t"): (4, False)})[0]) == [5, 6, 7]
    assert replay.catch_up(ROOM, {(CALL, "t"): (7, True)})[0] == []  # it has the terminal
    assert seqs(replay.catch_up(ROOM, {(CALL, "other"): (9, True)})[0]) == list(range(1, 8))


def test_a_terminal_below_the_highest_seq_is_sent_unless_the_browser_holds_it() -> None:
    """A colleague's blocks carry its own seqs, the caller's terminal the caller's: the
    terminal of such a stream may have a lower seq than the blocks before it. What tells
    the relay that the browser holds it is ``ended``, not its seq."""
    replay, _, _ = memory()
    for seq in range(1, 9):
        replay.add(ROOM, block(seq))
    replay.add(ROOM, block(1, state="done"))
    blocks, cursors, _ = replay.catch_up(ROOM, {(CALL, "t"): (8, False)})
    assert [(b["state"], b["envelope"]["seq"]) for b in blocks] == [("done", 1)]
    assert cursors == {(CALL, "t"): (8, True)}
    assert replay.catch_up(ROOM, cursors)[0] == []


def test_nothing_after_a_terminal_is_held() -> None:
    replay, _, _ = memory()
    replay.add(ROOM, block(1))
    replay.add(ROOM, block(2, state="aborted"))
    replay.add(ROOM, block(3))
    replay.add(ROOM, block(4, state="done"))
    assert seqs(replay.catch_up(ROOM, {})[0]) == [1, 2]


def test_exactly_at_the_stream_bound_nothing_gives_way_one_byte_past_the_oldest_running_does() -> (
    None
):
    replay, counts, _ = memory(stream_bytes=5 * SIZE)
    for seq in range(1, 6):
        replay.add(ROOM, block(seq))
    assert replay.sizes()["replay_bytes"] == 5 * SIZE
    assert counts["replay_gave_way"] == 0
    replay.add(ROOM, block(6))
    assert counts["replay_gave_way"] == 1
    blocks, _, missing = replay.catch_up(ROOM, {})
    assert seqs(blocks) == [1, 3, 4, 5, 6]  # the first block stays; block 2 gave way
    assert missing == {(CALL, "t"): 1}
    # A browser that holds block 2 already misses nothing.
    assert replay.catch_up(ROOM, {(CALL, "t"): (2, False)})[2] == {}


def test_the_first_block_and_the_terminal_never_give_way_to_running_blocks() -> None:
    replay, counts, _ = memory(stream_bytes=3 * SIZE)
    for seq in range(1, 40):
        replay.add(ROOM, block(seq))
    replay.add(ROOM, block(40, state="done"))
    blocks, _, missing = replay.catch_up(ROOM, {})
    assert seqs(blocks) == [1, 39, 40]
    assert missing == {(CALL, "t"): 37}
    assert counts["replay_gave_way"] == 37
    held = block_size(block(1)) + block_size(block(39)) + block_size(block(40, state="done"))
    assert replay.sizes()["replay_bytes"] == held


def test_at_the_conversation_bound_the_stream_holding_running_blocks_longest_gives_way() -> None:
    replay, counts, _ = memory(stream_bytes=10 * TASK_SIZE, conversation_bytes=10 * TASK_SIZE)
    for seq in range(1, 6):
        replay.add(ROOM, block(seq, task="old"))
    for seq in range(1, 6):
        replay.add(ROOM, block(seq, task="new"))
    assert counts["replay_gave_way"] == 0  # exactly at the bound
    replay.add(ROOM, block(6, task="new"))
    blocks, _, missing = replay.catch_up(ROOM, {})
    assert [(b["taskId"], b["envelope"]["seq"]) for b in blocks][:5] == [
        ("old", 1),
        ("old", 3),
        ("old", 4),
        ("old", 5),
        ("new", 1),
    ]
    assert missing == {(CALL, "old"): 1}
    # Another conversation is not touched by this one's bound.
    replay.add(OTHER, block(1, task="x"))
    assert seqs(replay.catch_up(OTHER, {})[0]) == [1]


def test_at_the_total_bound_the_oldest_running_blocks_of_any_conversation_give_way() -> None:
    replay, counts, _ = memory(
        stream_bytes=10 * SIZE, conversation_bytes=10 * SIZE, total_bytes=10 * SIZE
    )
    for seq in range(1, 6):
        replay.add(ROOM, block(seq))
    for seq in range(1, 6):
        replay.add(OTHER, block(seq))
    assert counts["replay_gave_way"] == 0
    replay.add(OTHER, block(6))
    assert seqs(replay.catch_up(ROOM, {})[0]) == [1, 3, 4, 5]
    assert seqs(replay.catch_up(OTHER, {})[0]) == [1, 2, 3, 4, 5, 6]
    assert replay.sizes()["replay_bytes"] == 10 * SIZE


def test_when_only_first_blocks_and_terminals_are_left_the_oldest_ended_stream_goes_whole() -> None:
    replay, counts, _ = memory(
        max_block_bytes=BLOCK_BOUND,
        stream_bytes=2 * BLOCK_BOUND,
        conversation_bytes=2 * BLOCK_BOUND,
        total_bytes=10**6,
    )
    big = (BLOCK_BOUND - SIZE) // 2
    replay.add(ROOM, block(1, task="a", pad=big))
    replay.add(ROOM, block(2, task="a", state="done", pad=big))
    replay.add(ROOM, block(1, task="b", pad=big))
    replay.add(ROOM, block(1, task="c", pad=big))  # over: "a" (ended) goes, not "b" or "c"
    assert counts["replay_dropped_streams"] == 1
    blocks, _, _ = replay.catch_up(ROOM, {})
    assert [b["taskId"] for b in blocks] == ["b", "c"]


def test_an_ended_stream_is_released_after_the_hold_a_silent_one_after_the_idle_time() -> None:
    replay, counts, clock = memory(hold=30, idle=900)
    replay.add(ROOM, block(1, task="ended"))
    replay.add(ROOM, block(2, task="ended", state="done"))
    replay.add(ROOM, block(1, task="silent"))
    clock.advance(29.9)
    assert replay.sizes()["replay_streams"] == 2
    clock.advance(0.1)
    assert replay.sizes()["replay_streams"] == 1
    clock.advance(869)
    replay.add(ROOM, block(2, task="silent"))  # a block restarts its idle time
    clock.advance(899.9)
    assert replay.sizes()["replay_streams"] == 1
    clock.advance(0.1)
    assert replay.sizes() == {"replay_rooms": 0, "replay_streams": 0, "replay_bytes": 0}
    assert counts["replay_idle_released"] == 1


def test_the_stream_count_bound_releases_the_oldest_stream() -> None:
    replay, counts, _ = memory(max_streams=3)
    for task in "abcd":
        replay.add(ROOM, block(1, task=task))
    assert [b["taskId"] for b in replay.catch_up(ROOM, {})[0]] == ["b", "c", "d"]
    assert counts["replay_dropped_streams"] == 1


@pytest.mark.parametrize(
    ("bounds", "field"),
    [
        ({"stream_bytes": 2 * BLOCK_BOUND - 1}, "stream_bytes"),
        (
            {"stream_bytes": 4 * BLOCK_BOUND, "conversation_bytes": 4 * BLOCK_BOUND - 1},
            "conversation_bytes",
        ),
        (
            {
                "stream_bytes": 4 * BLOCK_BOUND,
                "conversation_bytes": 8 * BLOCK_BOUND,
                "total_bytes": 8 * BLOCK_BOUND - 1,
            },
            "total_bytes",
        ),
        ({"hold": 0}, "hold"),
        ({"max_streams": 0}, "max_streams"),
    ],
)
def test_bounds_that_cannot_hold_what_they_must_are_refused(
    bounds: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        memory(max_block_bytes=BLOCK_BOUND, **bounds)


def test_the_smallest_bounds_allowed_are_accepted() -> None:
    memory(
        max_block_bytes=BLOCK_BOUND,
        stream_bytes=2 * BLOCK_BOUND,
        conversation_bytes=2 * BLOCK_BOUND,
        total_bytes=2 * BLOCK_BOUND,
    )


@pytest.mark.parametrize(
    ("have", "cursors", "ignored"),
    [
        (None, {}, 0),
        ([], {}, 0),
        ({"callId": CALL}, {}, 1),
        ("nonsense", {}, 1),
        ([{"callId": CALL, "taskId": "t", "seq": 3}], {(CALL, "t"): (3, False)}, 0),
        ([{"callId": None, "taskId": "t", "seq": 0}], {(None, "t"): (0, False)}, 0),
        ([{"callId": CALL, "taskId": "t", "seq": MAX_SEQ}], {(CALL, "t"): (MAX_SEQ, False)}, 0),
        ([{"callId": CALL, "taskId": "t", "seq": 2, "ended": True}], {(CALL, "t"): (2, True)}, 0),
        ([{"callId": CALL, "taskId": "t", "seq": 2, "ended": False}], {(CALL, "t"): (2, False)}, 0),
        ([{"callId": CALL, "taskId": "t", "seq": 2, "ended": 1}], {}, 1),
        ([{"callId": CALL, "taskId": "t", "seq": 2, "ended": "yes"}], {}, 1),
        ([{"callId": CALL, "taskId": "t", "seq": MAX_SEQ + 1}], {}, 1),
        ([{"callId": CALL, "taskId": "t", "seq": -1}], {}, 1),
        ([{"callId": CALL, "taskId": "t", "seq": 2.0}], {}, 1),
        ([{"callId": CALL, "taskId": "t", "seq": True}], {}, 1),
        ([{"callId": CALL, "taskId": "t", "seq": "3"}], {}, 1),
        ([{"callId": 5, "taskId": "t", "seq": 3}], {}, 1),
        ([{"callId": CALL, "taskId": "", "seq": 3}], {}, 1),
        ([{"callId": CALL, "seq": 3}], {}, 1),
        ([7, None, [1]], {}, 3),
        (
            [
                {"callId": CALL, "taskId": "t", "seq": 3, "ended": True},
                {"callId": CALL, "taskId": "t", "seq": 9},
            ],
            {(CALL, "t"): (9, True)},
            0,
        ),
    ],
)
def test_a_joins_cursors_are_read_and_bad_entries_ignored(
    have: object, cursors: dict[Any, int], ignored: int
) -> None:
    assert read_cursors(have, 1_000) == (cursors, ignored)


def test_cursors_past_the_bound_are_ignored_and_counted() -> None:
    have = [{"callId": CALL, "taskId": f"t{i}", "seq": i} for i in range(10_000)]
    cursors, ignored = read_cursors(have, 1_000)
    assert len(cursors) == 1_000
    assert ignored == 9_000
    # exactly at the bound: every entry read
    assert read_cursors(have[:1_000], 1_000) == (cursors, 0)


def test_a_silent_stream_is_released_idle_seconds_after_its_last_block_up_to_a_sixteenth_less() -> (
    None
):
    replay, counts, clock = memory(idle=160)  # its idle time starts again at most every 10 s
    replay.add(ROOM, block(1))  # the idle time starts
    clock.advance(9.9)
    replay.add(ROOM, block(2))  # too soon to start it again
    clock.advance(160 - 9.9 - 0.1)  # 159.9 s after the first block, 150 s after the last
    assert replay.sizes()["replay_streams"] == 1
    clock.advance(0.1)  # idle after the first block: 150.1 s after the last, over 160 - 10
    assert replay.sizes()["replay_streams"] == 0
    assert counts["replay_idle_released"] == 1


def test_a_stream_that_keeps_publishing_is_never_idle() -> None:
    replay, _, clock = memory(idle=160)
    for seq in range(1, 200):
        replay.add(ROOM, block(seq))
        clock.advance(5)  # 995 s in all, a block every 5 s
    assert replay.sizes()["replay_streams"] == 1


def test_a_catch_up_returns_the_blocks_as_they_were_emitted() -> None:
    replay, _, _ = memory()
    sent = [block(1, pad=3), block(2), block(3, state="done")]
    sent[1]["envelope"]["payload"]["text"] = "é 中文 😀 \ud800"  # a lone surrogate too
    for b in sent:
        replay.add(ROOM, b)
    assert replay.catch_up(ROOM, {})[0] == sent


def test_streams_are_released_whatever_the_clock_reads_at_their_first_block() -> None:
    """A monotonic clock may read near 0 (a machine booted a moment ago): a stream's first
    block still starts its idle time."""
    counts: Counter[str] = Counter()
    clock = FakeClock(start=0.0)
    replay = ReplayMemory(idle=160, clock=clock, count=lambda name, n: counts.update({name: n}))
    replay.add(ROOM, block(1))
    clock.advance(160)
    assert replay.sizes()["replay_streams"] == 0
    assert counts["replay_idle_released"] == 1


def test_merging_a_rooms_log_holds_what_is_not_held_yet_each_once_in_seq_order() -> None:
    """A web process that subscribed to a room while its blocks flowed holds a few live
    blocks before it reads the room's log: the older ones become the stream's first, the
    ones it holds are skipped, and so is every block of a stream whose terminal it holds."""
    replay, _, _ = memory()
    for seq in (7, 8):  # heard live after subscribing
        replay.add(ROOM, block(seq))
    replay.add(ROOM, block(3, task="ended"))
    replay.add(ROOM, block(4, task="ended", state="done"))
    log = [block(s) for s in range(1, 9)] + [block(s, task="ended") for s in (1, 2, 3)]
    taken = replay.merge(ROOM, [*log, block(4, task="ended", state="done"), {"bad": 1}])
    assert seqs(taken) == [1, 2, 3, 4, 5, 6]
    blocks, _, missing = replay.catch_up(ROOM, {(CALL, "t"): (-1, False)})
    assert [(b["taskId"], b["envelope"]["seq"]) for b in blocks] == [
        *(("t", s) for s in range(1, 9)),
        ("ended", 3),
        ("ended", 4),
    ]
    assert missing == {}
    assert replay.merge(ROOM, log) == []  # merged again: nothing new
    held = [block(s) for s in range(1, 9)]
    held += [block(3, task="ended"), block(4, task="ended", state="done")]
    assert replay.sizes()["replay_bytes"] == sum(block_size(b) for b in held)


def test_merging_skips_the_running_blocks_that_gave_way() -> None:
    replay, counts, _ = memory(stream_bytes=3 * SIZE)
    for seq in range(1, 6):
        replay.add(ROOM, block(seq))
    assert counts["replay_gave_way"] == 2  # 2 and 3 gave way: 1 (first), 4, 5 held
    assert replay.merge(ROOM, [block(s) for s in range(1, 7)]) == [block(6)]
