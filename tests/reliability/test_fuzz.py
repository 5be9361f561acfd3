"""Bad input, fuzzed with hypothesis (``KERNEL_EXT_FUZZ_EXAMPLES`` examples per test).

Structure-aware: the inputs are valid blocks, envelopes, frames and A2A events with fields
replaced, removed or added, and JSON-ish structures of every shape. For each one:

* decoding (blocks, envelopes) gives a block or :class:`~kernel_ext.errors.DecodeError`,
  nothing else; what decodes encodes back within the size bound;
* ``StreamHub.publish`` never raises, every call is counted (queued or dropped with a
  reason), everything the sender gets is a valid block, a stream never gets two
  terminals, and no ``error`` (an unexpected exception) is ever counted;
* ``A2AStreamAdapter.feed`` translates every event without its catch-all firing (each bad
  part gets its defined outcome: envelope, degraded to text, dropped as invalid, or
  ignored after the terminal, each counted), and each task gets exactly one terminal;
* the relay (real python-socketio server on 127.0.0.1, real clients) answers every frame
  an internal sender or a browser sends with its defined acknowledgement, counts it, and
  still serves a good browser afterwards.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
import socketio
from a2a.types import (
    Artifact,
    Message,
    Part,
    Role,
    StreamResponse,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf import json_format, struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.network import serve_asgi
from support.relay_helpers import NS, SECRET, Browser, barrier
from support.reliability_helpers import FUZZ_EXAMPLES, report
from support.timing import CALL_TIMEOUT

from kernel_ext.a2a import A2AStreamAdapter
from kernel_ext.attribution.tap import LiveCall, Tap
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.errors import BlockTooLargeError, DecodeError
from kernel_ext.protocol import DEFAULT_MAX_BLOCK_BYTES, Envelope, decode, decode_envelope, encode
from kernel_ext.relay import ChatRelay, allow_all, create_app
from kernel_ext.stream import OutgoingBlock, StreamHub

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CALL_ID = "00f067aa0ba902b7"

# -- JSON-ish values --------------------------------------------------------------------

leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for i in range(depth):
        value = [value] if i % 2 else {"d": value}
    return value


# Values that sit on the rules' edges: integral and fractional floats, negatives, huge
# strings (over the size bound), nesting just over the depth bound, non-finite floats.
edges = st.sampled_from(
    [
        1.0,
        1.5,
        -1,
        0,
        2**63,
        True,
        "1",
        "",
        "x" * 70_000,
        "字" * 30_000,
        nested(33),
        nested(200),
        float("nan"),
        float("inf"),
        [],
        {},
        "<script>alert(1)</script>",
    ]
)
# Values a field could plausibly hold (so that mutated inputs are often still valid).
plausible = (
    st.integers(min_value=-3, max_value=2**64)
    | st.from_regex(r"[0-9a-f]{16}", fullmatch=True)
    | st.sampled_from(["running", "done", "aborted", "text", "thinking", "tool_call", 1, None])
    | st.dictionaries(st.sampled_from(["text", "message", "name"]), st.text(max_size=20))
)
values = json_values | edges | plausible


def valid_block(state: str = "running", kind: str = "text", seq: int = 1) -> dict[str, Any]:
    key = "message" if state == "aborted" else "text"
    return {
        "v": 1,
        "callId": CALL_ID,
        "taskId": "task-1",
        "state": state,
        "ts": 1789123456789,
        "envelope": {
            "v": 1,
            "kind": kind,
            "streamKey": "task-1",
            "seq": seq,
            "status": state,
            "payload": {key: "hello"},
        },
    }


VALID_BLOCKS = [
    valid_block(),
    valid_block("done"),
    valid_block("aborted"),
    valid_block(kind="thinking"),
    valid_block(kind="a-future-kind"),
]
BLOCK_PATHS = [
    ("v",),
    ("callId",),
    ("taskId",),
    ("state",),
    ("ts",),
    ("envelope",),
    ("unknown",),
    ("envelope", "v"),
    ("envelope", "kind"),
    ("envelope", "streamKey"),
    ("envelope", "seq"),
    ("envelope", "status"),
    ("envelope", "payload"),
    ("envelope", "unknown"),
    ("envelope", "payload", "text"),
    ("envelope", "payload", "message"),
    ("envelope", "payload", "deep"),
]


@st.composite
def mutated(draw: st.DrawFn, base: list[dict[str, Any]], paths: list[tuple[str, ...]]) -> Any:
    """A valid structure with up to three fields replaced, removed or added."""
    item = copy.deepcopy(draw(st.sampled_from(base)))
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        path = draw(st.sampled_from(paths))
        container: Any = item
        for key in path[:-1]:
            container = container.get(key) if isinstance(container, dict) else None
        if not isinstance(container, dict):
            continue
        if draw(st.booleans()):
            container[path[-1]] = draw(values)
        else:
            container.pop(path[-1], None)
    return item


blocks_in = mutated(VALID_BLOCKS, BLOCK_PATHS)
envelopes_in = mutated(
    [b["envelope"] for b in VALID_BLOCKS],
    [p[1:] for p in BLOCK_PATHS if p[0] == "envelope" and len(p) > 1],
)


def as_wire(value: Any) -> str | None:
    try:
        return json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return None


# -- decoding -----------------------------------------------------------------------------

outcomes: Counter[str] = Counter()


@FUZZ
@given(blocks_in | json_values)
def test_block_decoding_gives_a_block_or_a_decode_error(data: Any) -> None:
    for form in (data, as_wire(data)):
        if form is None:
            continue
        try:
            block = decode(form)
        except DecodeError:
            outcomes["block rejected"] += 1
            continue
        outcomes["block decoded"] += 1
        try:
            encoded = encode(block)
        except BlockTooLargeError:  # its bulk is outside the payload strings: refused
            outcomes["block too large to encode"] += 1
            continue
        assert len(encoded.encode()) <= DEFAULT_MAX_BLOCK_BYTES
        again = decode(encoded)
        assert (again.call_id, again.task_id, again.state) == (
            block.call_id,
            block.task_id,
            block.state,
        )


@FUZZ
@given(envelopes_in | json_values)
def test_envelope_decoding_gives_an_envelope_or_a_decode_error(data: Any) -> None:
    for form in (data, as_wire(data)):
        if form is None:
            continue
        try:
            envelope = decode_envelope(form)
        except DecodeError:
            outcomes["envelope rejected"] += 1
            continue
        outcomes["envelope decoded"] += 1
        assert isinstance(envelope, Envelope)
        assert envelope.seq >= 0


@pytest.mark.parametrize("depth", [40, 1_000, 100_000])
def test_deeply_nested_input_is_a_decode_error_not_a_crash(depth: int) -> None:
    wire = '{"v":1,"kind":"text","streamKey":"t","seq":1,"status":"running","payload":'
    wire += '{"a":' + "[" * depth + "]" * depth + "}}"
    with pytest.raises(DecodeError):
        decode_envelope(wire)
    block = valid_block()
    block["envelope"]["payload"] = {"a": nested(min(depth, 5_000))}
    with pytest.raises(DecodeError):
        decode(block)


# -- publishing ---------------------------------------------------------------------------

STATES = ["running", "done", "aborted", "runnin", "", None, 1]
TASK_IDS = [None, "task-1", "task-2", "", "t" * 600, 7]
items = (
    envelopes_in
    | json_values
    | st.text(max_size=100)
    | edges
    | st.builds(object)
    | st.just(Envelope(kind="text", stream_key="task-1", seq=3, status="running"))
)
publishes = st.lists(
    st.tuples(
        items,
        st.sampled_from(TASK_IDS),
        st.sampled_from(STATES),
        st.booleans(),  # inside the tool call (contextvar) or not
        st.sampled_from([None, "conv-1", ""]),
    ),
    min_size=1,
    max_size=12,
)
SENDER_LOOP = asyncio.new_event_loop()  # never run: the hub only needs to know it


@FUZZ
@given(publishes)
def test_publish_never_raises_counts_every_call_and_emits_only_valid_blocks(
    calls: list[tuple[Any, Any, Any, bool, Any]],
) -> None:
    hub = StreamHub(tap=Tap(), max_running_per_second=None)
    consumer = hub.attach_sender(SENDER_LOOP)
    for item, task_id, state, inside, conversation in calls:
        if inside:
            with use_tool_call(ToolCall(CALL_ID, "ask_colleague", "conv-1")):
                hub.publish(item, task_id=task_id, state=state, conversation_id=conversation)
        else:
            hub.publish(item, task_id=task_id, state=state, conversation_id=conversation)
    out = consumer.take_nowait(10_000)
    terminals: Counter[tuple[Any, Any]] = Counter()
    for sent in out:
        assert isinstance(sent, OutgoingBlock)
        block = decode(sent.block)  # every block the sender gets is valid on the wire
        if block.is_terminal:
            terminals[(block.call_id, block.task_id)] += 1
    assert all(n == 1 for n in terminals.values()), terminals
    counts = hub.stats().counts
    assert counts.get("error", 0) == 0, counts
    publish_outcomes = sum(
        v for k, v in counts.items() if k not in ("delivered", "degraded", "invalid")
    )
    assert publish_outcomes + counts.get("invalid", 0) >= len(calls)  # every call counted
    for reason, n in counts.items():
        outcomes[f"publish: {reason}"] += n


# -- A2A events ---------------------------------------------------------------------------

A2A_TASKS = ["t1", "t2", ""]
A2A_STATES = [
    TaskState.TASK_STATE_SUBMITTED,
    TaskState.TASK_STATE_WORKING,
    TaskState.TASK_STATE_WORKING,
    TaskState.TASK_STATE_WORKING,
    TaskState.TASK_STATE_COMPLETED,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_CANCELED,
    TaskState.TASK_STATE_REJECTED,
    TaskState.TASK_STATE_INPUT_REQUIRED,
    TaskState.TASK_STATE_AUTH_REQUIRED,
    TaskState.TASK_STATE_UNSPECIFIED,
]


def data_part(value: Any) -> Part | None:
    """A data part holding ``value`` as A2A carries it (numbers become doubles)."""
    if as_wire(value) is None:
        return None
    proto = struct_pb2.Value()
    try:
        json_format.ParseDict(value, proto)
    except (json_format.ParseError, ValueError, TypeError, OverflowError):
        return None
    return Part(data=proto)


@st.composite
def parts(draw: st.DrawFn) -> list[Part]:
    made = []
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        kind = draw(st.sampled_from(["envelope", "data", "text", "raw", "url"]))
        if kind == "envelope":
            part = data_part(draw(envelopes_in))
        elif kind == "data":
            part = data_part(draw(json_values))
        elif kind == "text":
            part = Part(text=draw(st.text(max_size=40)))
        elif kind == "raw":
            part = Part(raw=draw(st.binary(max_size=20)))
        else:
            part = Part(url=draw(st.text(max_size=20)))
        if part is not None:
            made.append(part)
    return made


@st.composite
def a2a_events(draw: st.DrawFn) -> StreamResponse:
    task_id = draw(st.sampled_from(A2A_TASKS))
    kind = draw(st.sampled_from(["status", "status", "status", "task", "artifact", "message"]))
    message = Message(
        role=Role.ROLE_AGENT, message_id="m", task_id=task_id, context_id="c", parts=draw(parts())
    )
    if kind == "status":
        status = TaskStatus(state=draw(st.sampled_from(A2A_STATES)))
        if draw(st.booleans()) or status.state == TaskState.TASK_STATE_WORKING:
            status.message.CopyFrom(message)
        update = TaskStatusUpdateEvent(task_id=task_id, context_id="c", status=status)
        return StreamResponse(status_update=update)
    if kind == "task":
        task = Task(
            id=task_id, context_id="c", status=TaskStatus(state=draw(st.sampled_from(A2A_STATES)))
        )
        return StreamResponse(task=task)
    if kind == "artifact":
        artifact = Artifact(artifact_id=draw(st.sampled_from(["a", "b"])), parts=draw(parts()))
        update = TaskArtifactUpdateEvent(
            task_id=task_id, context_id="c", artifact=artifact, append=draw(st.booleans())
        )
        return StreamResponse(artifact_update=update)
    if not draw(st.booleans()):
        message.task_id = ""
    return StreamResponse(message=message)


# Status updates whose message is shown (its data parts each get an outcome): working, and
# the interrupted states (the colleague's question).
SHOWN_STATES = (
    TaskState.TASK_STATE_WORKING,
    TaskState.TASK_STATE_INPUT_REQUIRED,
    TaskState.TASK_STATE_AUTH_REQUIRED,
)


class Recorder:
    def __init__(self, hub: StreamHub) -> None:
        self.hub = hub
        self.terminals: Counter[Any] = Counter()
        self.provisional: Counter[Any] = Counter()

    def __call__(
        self,
        item: Any,
        *,
        task_id: Any = None,
        state: str = "running",
        provisional: bool = False,
        **kw: Any,
    ) -> None:
        assert isinstance(item, (Envelope, str)), type(item)
        if state != "running":
            (self.provisional if provisional else self.terminals)[task_id] += 1
        self.hub.publish(item, task_id=task_id, state=state, provisional=provisional, **kw)  # type: ignore[arg-type]


class Catch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@FUZZ
@given(st.lists(a2a_events(), min_size=1, max_size=10))
def test_a2a_adapter_gives_each_bad_part_its_outcome_and_each_task_one_terminal(
    events: list[StreamResponse],
) -> None:
    hub = StreamHub(tap=Tap(), max_running_per_second=None)
    consumer = hub.attach_sender(SENDER_LOOP)
    record = Recorder(hub)
    adapter = A2AStreamAdapter(record)
    catch = Catch()
    a2a_logger = logging.getLogger("kernel_ext.a2a")
    a2a_logger.addHandler(catch)
    expected_parts = 0  # data parts of shown updates for open tasks
    expected_ignored = 0
    try:
        with use_tool_call(ToolCall(CALL_ID, "ask_colleague", "conv-1")):
            for event in events:
                kind = event.WhichOneof("payload")
                task_id = {
                    "status_update": event.status_update.task_id,
                    "task": event.task.id,
                    "artifact_update": event.artifact_update.task_id,
                    "message": event.message.task_id,
                }[kind]
                known = adapter._tasks.get(task_id)
                closed = known is not None and known.terminal
                if kind == "status_update":
                    status = event.status_update.status
                    if closed:
                        expected_ignored += 1
                    elif status.state in SHOWN_STATES and status.HasField("message"):
                        expected_parts += sum(p.HasField("data") for p in status.message.parts)
                adapter.feed(event)
            reply = adapter.close("the stream ended")
    finally:
        a2a_logger.removeHandler(catch)
    assert catch.records == [], [r.getMessage() for r in catch.records]  # no catch-all fired
    stats = adapter.stats
    # Every data part of an open task's working update got exactly one outcome, counted.
    assert stats.envelopes + stats.degraded + stats.invalid == expected_parts
    assert stats.ignored >= expected_ignored
    # Exactly one terminal per task seen (or one local one) — or, for a task waiting for
    # input, provisional ones and no terminal — and the reply says how it ended.
    assert all(n == 1 for n in record.terminals.values()), record.terminals
    waiting = {tid for tid, task in adapter._tasks.items() if task.interrupted}
    assert set(adapter._tasks) - waiting <= set(record.terminals)
    assert waiting <= set(record.provisional)
    assert not waiting & set(record.terminals)
    assert reply is not None
    hub.tool_call_ended(LiveCall(CALL_ID, "ask_colleague", "conv-1"), None)  # the call ends
    # Through the hub: valid blocks only, one terminal per stream, no unexpected error.
    per_stream: Counter[tuple[Any, Any]] = Counter()
    for sent in consumer.take_nowait(10_000):
        assert isinstance(sent, OutgoingBlock)
        block = decode(sent.block)
        if block.is_terminal:
            per_stream[(block.call_id, block.task_id)] += 1
    assert all(n == 1 for n in per_stream.values()), per_stream
    assert hub.stats().counts.get("error", 0) == 0
    outcomes["a2a envelopes"] += stats.envelopes
    outcomes["a2a degraded"] += stats.degraded
    outcomes["a2a invalid"] += stats.invalid
    outcomes["a2a ignored"] += stats.ignored
    outcomes["a2a terminals"] += stats.terminals


# -- the relay ----------------------------------------------------------------------------


# What ChatRelay.stats() reports as current sizes, not as counts that only grow.
RELAY_SIZES = frozenset(
    {
        "internal",
        "browsers",
        "workers_tracked",
        "workers_in_grace",
        "worker_streams",
        "redis_workers_tracked",
        "redis_worker_streams",
    }
)


class RelayBench:
    """A relay (uvicorn, 127.0.0.1) with an internal sender, a fuzzing browser and a good
    browser, all on an event loop in a thread, driven synchronously from the tests."""

    GOOD_ROOM = "good-room"

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = AsyncExitStack()
        self.relay: ChatRelay
        self.port = 0

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self) -> None:
        ready = create_app(SECRET, authorize_join=allow_all)
        self.relay = ready.relay
        self.port = await self.stack.enter_async_context(serve_asgi(ready.app))
        self.internal = socketio.AsyncClient(reconnection=False)
        await self.internal.connect(
            f"http://127.0.0.1:{self.port}",
            namespaces=[NS],
            auth={"internal": SECRET},
            transports=["websocket"],
            wait_timeout=CALL_TIMEOUT,
        )
        self.stack.push_async_callback(self.internal.disconnect)
        self.fuzzer = Browser("fuzzer")
        await self.fuzzer.connect(self.port)
        self.stack.push_async_callback(self.fuzzer.close)
        self.good = Browser("good")
        await self.good.connect(self.port)
        self.stack.push_async_callback(self.good.close)
        assert await self.good.join(self.GOOD_ROOM) == {"ok": True}

    async def stats(self) -> dict[str, int]:
        return self.relay.stats()

    def total(self) -> int:
        counts = self.run(self.stats())
        return sum(v for k, v in counts.items() if k not in RELAY_SIZES)

    async def call(self, client: socketio.AsyncClient, event: str, data: Any) -> Any:
        return await client.call(event, data, namespace=NS, timeout=10)

    async def still_serves(self) -> None:
        """The good browser receives a marker sent now, and nothing before it."""
        marker = valid_block("running", seq=99)
        marker["taskId"] = "marker"
        await self.call(
            self.internal, "kx_blocks", {"v": 1, "room": self.GOOD_ROOM, "blocks": [marker]}
        )
        await self.good.wait_for(lambda blocks: len(blocks) >= 1)
        await barrier(self.good, self.port)
        assert self.good.blocks == [marker]

    async def stop(self) -> None:
        await self.stack.aclose()
        # The server's own tasks (pings, its service task) end with the loop.
        current = asyncio.current_task()
        rest = [task for task in asyncio.all_tasks() if task is not current]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)


@pytest.fixture(scope="module")
def bench() -> Iterator[RelayBench]:
    bench = RelayBench()
    try:
        bench.run(bench.start())
        yield bench
        bench.run(bench.still_serves())
    finally:
        bench.run(bench.stop())
        bench.loop.call_soon_threadsafe(bench.loop.stop)
        bench.thread.join(timeout=10)
        bench.loop.close()


rooms = st.sampled_from(["conv-1", "conv-2", "", "r" * 600]) | st.text(max_size=8)
well_formed_frames = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "room": st.sampled_from(["conv-1", "conv-2"]),
        "blocks": st.lists(blocks_in | st.sampled_from(VALID_BLOCKS), min_size=1, max_size=6),
    }
)
frames = st.one_of(
    well_formed_frames,
    well_formed_frames,
    st.fixed_dictionaries(
        {
            "v": st.just(1) | values,
            "room": rooms,
            "blocks": st.lists(blocks_in | values, max_size=6),
        }
    ),
    mutated(
        [{"v": 1, "room": "conv-1", "blocks": [valid_block()]}],
        [("v",), ("room",), ("blocks",), ("x",)],
    ),
    values,
)
chat_frames = st.fixed_dictionaries({"room": rooms, "event": values}) | values


@pytest.mark.network
@pytest.mark.timeout(300)
@FUZZ
@given(well_formed_frames)
def test_relay_validates_every_block_of_an_internal_frame(bench: RelayBench, frame: Any) -> None:
    _internal_frame(bench, "kx_blocks", frame)


@pytest.mark.network
@pytest.mark.timeout(300)
@FUZZ
@given(
    st.one_of(
        st.tuples(st.just("kx_blocks"), frames),
        st.tuples(st.just("kx_chat_event"), chat_frames),
    )
)
def test_relay_answers_and_counts_every_internal_frame(
    bench: RelayBench, sent: tuple[str, Any]
) -> None:
    event, data = sent
    _internal_frame(bench, event, data)


def _internal_frame(bench: RelayBench, event: str, data: Any) -> None:
    if as_wire(data) is None:
        return  # not sendable over Socket.IO's JSON
    before = bench.total()
    ack = bench.run(bench.call(bench.internal, event, data))
    assert isinstance(ack, dict), ack
    assert isinstance(ack.get("ok"), bool), ack
    if ack["ok"] and event == "kx_blocks":
        assert ack["accepted"] + ack["rejected"] == len(data["blocks"])
        outcomes["relay frame accepted"] += 1
        outcomes["relay blocks rejected"] += ack["rejected"]
    elif ack["ok"]:
        assert ack == {"ok": True}
        outcomes["relay chat_event relayed"] += 1
    else:
        assert isinstance(ack.get("error"), str)
        outcomes["relay frame refused"] += 1
    assert bench.total() > before  # counted


BROWSER_EVENTS = [
    "tool_event_stream",
    "kx_blocks",
    "kx_chat_event",
    "join_conversation",
    "leave_conversation",
    "chat_event",
    "user_message",
    "message",
]


@pytest.mark.network
@pytest.mark.timeout(300)
@FUZZ
@given(st.sampled_from(BROWSER_EVENTS) | st.text(min_size=1, max_size=12), frames | values)
def test_relay_drops_and_counts_whatever_a_browser_sends(
    bench: RelayBench, event: str, data: Any
) -> None:
    if as_wire(data) is None or event in ("connect", "disconnect"):
        return  # reserved names: tests/reliability/test_intruders.py
    before = bench.total()
    ack = bench.run(bench.call(bench.fuzzer.client, event, data))
    if event in ("join_conversation", "leave_conversation"):
        assert isinstance(ack, dict), ack
        assert isinstance(ack.get("ok"), bool), ack
        if ack["ok"] and event == "leave_conversation":
            return  # a good leave is not bad input
    elif event in ("kx_blocks", "kx_chat_event"):
        assert ack == {"ok": False, "error": "forbidden"}
    else:
        assert ack is None  # dropped
    outcomes[f"browser {event if event in BROWSER_EVENTS else 'other event'}"] += 1
    assert bench.total() > before  # counted


def test_zz_fuzz_outcomes_are_reported() -> None:
    """Not a check: writes what the fuzzers above produced to the reliability report."""
    report("fuzz: outcomes by kind", examples_per_test=FUZZ_EXAMPLES, outcomes=dict(outcomes))


def test_a_terminal_with_a_task_id_of_the_wrong_type_still_goes_out_once() -> None:
    """Regression (found by the publish fuzzer): a terminal whose task id was not a string
    could not be rebuilt and was lost, counted as an internal ``error``."""
    hub = StreamHub(tap=Tap())
    consumer = hub.attach_sender(SENDER_LOOP)
    with use_tool_call(ToolCall(CALL_ID, "ask_colleague", "conv-1")):
        hub.publish("the answer", task_id=7, state="done")  # type: ignore[arg-type]
    [sent] = consumer.take_nowait()
    assert isinstance(sent, OutgoingBlock)
    block = decode(sent.block)
    assert (block.task_id, block.state) == ("7", "done")
    assert hub.stats()["degraded"] == 1
    assert hub.stats()["error"] == 0
