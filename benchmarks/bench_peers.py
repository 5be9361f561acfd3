"""Per-event cost from tool code to the sender, end to end: kernel_ext vs. its peers.

Run: ``python benchmarks/run.py --only peers`` (or this file directly). :func:`run` returns
the figures as a list of dicts for the runner (``benchmarks/run.py``).

Each contender runs one tool call that emits a burst of ``EVENTS`` events, each carrying the
same 64-character string, and a consumer drains every event into a no-op counting sink:

* **kernel_ext**: the tool runs on the event loop inside a real ``execute_tool`` span
  (:func:`kernel_ext.instrument.tool_call_scope`, with
  :class:`~kernel_ext.attribution.processor.ToolSpanProcessor` feeding a tap and the hub), calls
  :func:`kernel_ext.stream.publish` for each event and then publishes the terminal; a sender
  (an :class:`~kernel_ext.emit.Emitter` whose ``_send`` only counts the built wire blocks,
  i.e. the point where a real emitter would hand them to Socket.IO) drains the hub on the
  same loop. The T4 throttle is switched off (``max_running_per_second=None``) and the queue
  bound is above the burst, so nothing is dropped; the run checks that every block arrived.
* **LangGraph, tools mode**: a one-node graph (``ToolNode``) whose tool calls
  ``ToolRuntime.emit_output_delta`` per event (the method exists in the installed
  langgraph), consumed with ``stream_mode="tools"``.
* **LangGraph, custom mode**: the same graph, the tool writes through
  ``get_stream_writer()``, consumed with ``stream_mode="custom"``.
  Each LangGraph mode runs twice: an ``async def`` tool under ``graph.astream`` (the tool on
  the event loop, as kernel_ext's here), and a plain ``def`` tool under the synchronous
  ``graph.stream``; the better of the two is LangGraph's best case, and both are held
  against the target.
* **OpenAI Agents SDK** (``benchmarks/peer_openai_agents.py``): the SDK gives a function tool
  no way to stream progress (``Runner.run_streamed`` carries the model's stream and items the
  runner makes, ``tool_output`` once the tool has returned; ``ToolContext`` has no emit), so
  there is no like-for-like path and no ratio. Reported as information instead, both in the
  real ``Runner.run`` on a no-network ``Model``: kernel_ext's per-event cost from an async
  function tool attributed with ``attributed_tools`` (a contender in the rounds below, same
  sender), and the SDK's own cost per function tool call (rounds of their own: a turn of
  ``1 + CALLS`` no-op calls minus a turn of one, divided by ``CALLS``).
* **pydantic-ai** (``benchmarks/peer_pydantic_ai.py``): an ``Agent`` on ``TestModel`` whose
  async tool awaits ``ctx.emit(<CustomEvent subclass>)`` per event (``RunContext.emit`` exists
  under that name in pydantic-ai-slim 2.68; it must be awaited, so sync tools cannot emit),
  consumed by an ``event_stream_handler`` that iterates the events.

A round times every contender once with the burst and once with zero events (in rotating
order, so drift hits all alike); the per-event cost of a round is
``(t(burst) - t(0 events)) / EVENTS``, which removes each framework's fixed per-run cost
(graph or agent setup, span, terminal). Two clocks: wall time (``perf_counter``) and the
process's CPU time (``process_time``, all threads), the latter less disturbed by other work
on a shared machine; each is held against the target. Figures are medians over the rounds
after a warm-up. Before the rounds the heap is frozen (``gc.freeze()``: the imported
modules of all contenders share it, and a full collection scanning it would otherwise land on
whichever contender triggers it, 15 µs per event in that round); each trial starts after a
``gc.collect()``, and the garbage a contender makes during its trial is collected and
counted as usual. The time spent inside the tool's emit loop, per event, is reported too
(information: the caller-side part of the end-to-end cost). Target: kernel_ext at most 0.8×
every peer that has a streaming path (:data:`TARGET`), the fastest of them included.

What reaches the sink differs, and the figures include it: kernel_ext's sender gets a
finished block (callId resolved from the contextvar, taskId, per-stream seq, ts, the
pseudo-envelope, decided after the T4 rules and the size bound) whose wire form — dict or
JSON text — is made when the sender reads it, as python-socketio encodes an emitted dict
when it sends it; an information row times kernel_ext with the sender reading every
block's JSON text, as the loopback sender does, which no peer's figure includes;
LangGraph's consumer gets a ``(namespace, mode,
payload)`` chunk; pydantic-ai's handler gets the event object, stamped with the tool call id.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import gc
import importlib.metadata
import itertools
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import peer_openai_agents as agents_sdk
import peer_pydantic_ai
from figures import print_figures
from opentelemetry.sdk.trace import TracerProvider

from kernel_ext import ToolDescription
from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import Emitter
from kernel_ext.instrument import tool_call_scope
from kernel_ext.stream import Outgoing, OutgoingBlock, StreamHub, publish, set_default_hub

EVENTS = 5_000
REPEATS = 11
QUICK_REPEATS = 3
PAYLOAD = "x" * 64
WITH_TEXT = "kernel_ext publish(), the sender reading each block's JSON text"
TARGET = 0.8  # kernel_ext's per-event cost over each peer's (issue 25: ahead of the fastest)
TARGET_TEXT = f"≤ {TARGET:g}×"

# One timed run: (wall seconds for the whole call, seconds inside the emit loop, events seen).
Trial = Callable[[int], Awaitable[tuple[float, float, int]]]


class CountingEmitter(Emitter):
    """A sender that counts the blocks it is handed (the no-op sink of the benchmarks) and
    wakes waiters when a terminal arrives."""

    def __init__(self, *, hub: StreamHub) -> None:
        super().__init__(hub=hub)
        self.blocks = 0
        self.terminals = 0
        self.terminal_seen = asyncio.Event()
        self.encode = False  # read each block's wire text, as the loopback sender does
        self.encoded = 0

    async def _send(self, items: list[Outgoing]) -> None:
        n = 0
        if self.encode:
            self.encoded += len(",".join([i.text for i in items if isinstance(i, OutgoingBlock)]))
        for item in items:
            if isinstance(item, OutgoingBlock):
                n += 1
                if item.terminal:
                    self.terminals += 1
                    self.terminal_seen.set()
        self.blocks += n
        if n:
            self.port.delivered(n)


# -- kernel_ext ---------------------------------------------------------------------------


class KernelExtContender:
    """One hub + counting sender + tracer provider with the real span processor."""

    def __init__(self) -> None:
        self.tap = Tap()
        self.hub = StreamHub(max_running_per_second=None, max_queue=4 * EVENTS + 16, tap=self.tap)
        self.provider = TracerProvider()
        self.provider.add_span_processor(ToolSpanProcessor(tap=self.tap, sink=self.hub))
        self.sender = CountingEmitter(hub=self.hub)
        self._previous: StreamHub | None = None
        self._ids = itertools.count()

    async def __aenter__(self) -> KernelExtContender:
        self._previous = set_default_hub(self.hub)
        await self.sender.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.stop(timeout=5.0)
        set_default_hub(self._previous)
        self.provider.shutdown()

    def _tool(self, n: int) -> float:
        description = ToolDescription("ask_colleague", f"conv-{next(self._ids)}")
        with tool_call_scope(description, tracer_provider=self.provider, sink=self.hub):
            start = time.perf_counter()
            for _ in range(n):
                publish(PAYLOAD)
            in_tool = time.perf_counter() - start
            publish("final answer", state="done")
        return in_tool

    async def trial_with_text(self, n: int) -> tuple[float, float, int]:
        """:meth:`trial`, the sender reading each block's wire text (JSON, as the loopback
        sender puts it in its frames)."""
        self.sender.encode = True
        try:
            return await self.trial(n)
        finally:
            self.sender.encode = False

    async def trial(self, n: int) -> tuple[float, float, int]:
        sender = self.sender
        sender.terminal_seen.clear()
        before = sender.blocks
        start = time.perf_counter()
        in_tool = self._tool(n)
        await asyncio.wait_for(sender.terminal_seen.wait(), 10.0)
        total = time.perf_counter() - start
        return total, in_tool, sender.blocks - before - 1


# -- LangGraph ----------------------------------------------------------------------------


LANGGRAPH = (
    "LangGraph tools, async (emit_output_delta)",
    "LangGraph tools, sync (emit_output_delta)",
    "LangGraph custom, async (get_stream_writer)",
    "LangGraph custom, sync (get_stream_writer)",
)


def _langgraph_trials() -> dict[str, Trial] | str:
    """The LangGraph contenders (names in :data:`LANGGRAPH`), or why they cannot run."""
    try:
        from langchain_core.messages import AIMessage
        from langchain_core.tools import tool
        from langgraph.config import get_stream_writer
        from langgraph.graph import END, START, MessagesState, StateGraph
        from langgraph.prebuilt import ToolNode, ToolRuntime
    except ImportError as exc:
        return f"LangGraph not installed ({exc.name}); install the `bench` extra"
    if not hasattr(ToolRuntime, "emit_output_delta"):
        return "the installed LangGraph has no ToolRuntime.emit_output_delta"
    box: dict[str, float] = {}

    def deltas(n: int, runtime: ToolRuntime) -> str:
        """Emit n output deltas."""
        emit = runtime.emit_output_delta
        start = time.perf_counter()
        for _ in range(n):
            emit(PAYLOAD)
        box["in_tool"] = time.perf_counter() - start
        return "final answer"

    async def deltas_async(n: int, runtime: ToolRuntime) -> str:
        """Emit n output deltas."""
        return deltas(n, runtime)

    def custom(n: int) -> str:
        """Write n custom stream items."""
        write = get_stream_writer()
        start = time.perf_counter()
        for _ in range(n):
            write(PAYLOAD)
        box["in_tool"] = time.perf_counter() - start
        return "final answer"

    async def custom_async(n: int) -> str:
        """Write n custom stream items."""
        return custom(n)

    # LangChain reads the hints at decoration time from this module's globals, where the
    # lazily imported names are missing (postponed annotations): hand it the real objects.
    hints: list[tuple[Callable[..., Any], dict[str, Any]]] = [
        (deltas, {"n": int, "runtime": ToolRuntime, "return": str}),
        (deltas_async, {"n": int, "runtime": ToolRuntime, "return": str}),
        (custom, {"n": int, "return": str}),
        (custom_async, {"n": int, "return": str}),
    ]
    for fn, real_hints in hints:
        fn.__annotations__ = real_hints

    def trial_for(fn: Callable[..., Any], mode: str, sync: bool) -> Trial:
        tool_obj: Any = tool(fn)
        graph: Any = StateGraph(MessagesState)
        graph.add_node("tools", ToolNode([tool_obj]))
        graph.add_edge(START, "tools")
        graph.add_edge("tools", END)
        graph = graph.compile()
        ids = itertools.count()

        def counted(chunk: Any) -> int:
            if mode == "custom":
                return 1
            return int(isinstance(chunk, dict) and chunk.get("event") == "tool-output-delta")

        async def trial(n: int) -> tuple[float, float, int]:
            call = {"name": tool_obj.name, "args": {"n": n}, "id": f"call_{next(ids)}"}
            state = {"messages": [AIMessage(content="", tool_calls=[call])]}
            seen = 0
            start = time.perf_counter()
            if sync:
                for chunk in graph.stream(state, stream_mode=mode):
                    seen += counted(chunk)
            else:
                async for chunk in graph.astream(state, stream_mode=mode):
                    seen += counted(chunk)
            total = time.perf_counter() - start
            return total, box.pop("in_tool", 0.0), seen

        return trial

    return dict(
        zip(
            LANGGRAPH,
            (
                trial_for(deltas_async, "tools", sync=False),
                trial_for(deltas, "tools", sync=True),
                trial_for(custom_async, "custom", sync=False),
                trial_for(custom, "custom", sync=True),
            ),
            strict=True,
        )
    )


# -- measuring ----------------------------------------------------------------------------


@dataclasses.dataclass
class Measured:
    per_event_us: float
    cpu_us: float
    in_tool_us: float
    spread_us: tuple[float, float]


async def _timed(trial: Trial, n: int) -> tuple[float, float, float, int]:
    """One trial: wall seconds, process CPU seconds (all threads), in-tool seconds, events."""
    gc.collect()  # every trial starts from the same heap state, outside the timed region
    cpu = time.process_time()
    wall, in_tool, seen = await trial(n)
    return wall, time.process_time() - cpu, in_tool, seen


async def _measure(trials: dict[str, Trial], events: int, repeats: int) -> dict[str, Measured]:
    names = list(trials)
    for name in names:  # warm-up: imports, caches, lazily built graphs
        for n in (0, events, 0, events):
            _, _, seen = await trials[name](n)
            if seen != n:
                raise RuntimeError(f"{name}: {seen} of {n} events arrived")
    # The contenders share one heap, most of it imported modules: a full collection that
    # scans it would land on whichever contender happens to trigger it. Freeze what exists
    # now; the garbage each contender makes is still collected, and counted, as usual.
    gc.collect()
    gc.freeze()
    try:
        return await _rounds(trials, names, events, repeats)
    finally:
        gc.unfreeze()


async def _rounds(
    trials: dict[str, Trial], names: list[str], events: int, repeats: int
) -> dict[str, Measured]:
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    in_tool: dict[str, list[float]] = {name: [] for name in names}
    for round_no in range(repeats):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            full, full_cpu, tool_time, seen = await _timed(trials[name], events)
            empty, empty_cpu, _, _ = await _timed(trials[name], 0)
            if seen != events:
                raise RuntimeError(f"{name}: {seen} of {events} events arrived")
            wall[name].append((full - empty) / events * 1e6)
            cpu[name].append((full_cpu - empty_cpu) / events * 1e6)
            in_tool[name].append(tool_time / events * 1e6)
    return {
        name: Measured(
            statistics.median(wall[name]),
            statistics.median(cpu[name]),
            statistics.median(in_tool[name]),
            (min(wall[name]), max(wall[name])),
        )
        for name in names
    }


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


async def _run_async(events: int, n_calls: int, repeats: int) -> list[dict[str, Any]]:
    async with KernelExtContender() as ours:
        trials: dict[str, Trial] = {
            "kernel_ext publish()": ours.trial,
            WITH_TEXT: ours.trial_with_text,
        }
        missing: dict[str, str] = {}
        langgraph = _langgraph_trials()
        if isinstance(langgraph, str):
            missing.update(dict.fromkeys(LANGGRAPH, langgraph))
        else:
            trials.update(langgraph)
        pydantic_ai = peer_pydantic_ai.pydantic_ai_trial(PAYLOAD)
        if isinstance(pydantic_ai, str):
            missing["pydantic-ai ctx.emit + event_stream_handler"] = pydantic_ai
        else:
            trials["pydantic-ai ctx.emit + event_stream_handler"] = pydantic_ai
        agents = agents_sdk.agents_trials(ours, PAYLOAD)
        calls: dict[str, Measured] = {}
        if not isinstance(agents, str):  # no like-for-like peer path: info only
            trials[agents_sdk.PER_EVENT] = agents.per_event
            calls = await _measure({agents_sdk.PER_CALL: agents.per_call}, n_calls, repeats)
        measured = await _measure(trials, events, repeats)
        dropped = ours.hub.stats()
    if dropped["throttled"] or dropped["queue_full"]:
        raise RuntimeError(f"kernel_ext dropped blocks during the benchmark: {dropped.counts}")
    mine = measured.pop("kernel_ext publish()")
    with_text = measured.pop(WITH_TEXT)
    in_agents = measured.pop(agents_sdk.PER_EVENT, None)
    figures: list[dict[str, Any]] = []
    for name, theirs in measured.items():
        for clock, ours_us, theirs_us in (
            ("wall", mine.per_event_us, theirs.per_event_us),
            ("CPU", mine.cpu_us, theirs.cpu_us),
        ):
            ratio = ours_us / theirs_us
            figures.append(
                {
                    "name": f"per event tool → sender ({clock}): kernel_ext vs {name}",
                    "value": round(ratio, 2),
                    "unit": "x",
                    "target": TARGET,
                    "target_text": TARGET_TEXT,
                    "ok": ratio <= TARGET,
                    "detail": (
                        f"{ours_us:.2f} µs vs {theirs_us:.2f} µs per event ({events} events "
                        f"× {len(PAYLOAD)} chars, median of {repeats} rounds)"
                    ),
                    "profile": "kernel_ext",
                }
            )
    for name, reason in missing.items():
        figures.append(
            {
                "name": f"per event tool → sender: kernel_ext vs {name}",
                "value": None,
                "unit": "x",
                "target": TARGET,
                "target_text": TARGET_TEXT,
                "ok": None,
                "detail": f"not measured: {reason}",
            }
        )
    everyone = {"kernel_ext publish()": mine, WITH_TEXT: with_text, **measured}
    if in_agents is not None:
        everyone[agents_sdk.PER_EVENT] = in_agents
    for name, m in everyone.items():
        figures.append(
            {
                "name": f"{name}: wall per event, end to end (info)",
                "value": round(m.per_event_us, 2),
                "unit": "µs",
                "target": None,
                "ok": None,
                "detail": (
                    f"CPU {m.cpu_us:.2f} µs/event (process, all threads); in the tool "
                    f"{m.in_tool_us:.2f} µs/event; rounds ranged "
                    f"{m.spread_us[0]:.2f}–{m.spread_us[1]:.2f} µs"
                ),
            }
        )
    figures.append(agents_sdk.agents_figure(agents, calls, in_agents, n_calls, repeats))
    figures.append(
        {
            "name": "peer versions (info)",
            "value": None,
            "unit": "",
            "target": None,
            "ok": None,
            "detail": ", ".join(
                f"{dist} {_version(dist)}"
                for dist in ("langgraph", "langchain-core", "pydantic-ai-slim", "openai-agents")
            ),
        }
    )
    return figures


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Measure every contender side by side; each dict has name, value, unit, target, ok,
    detail (and ``target_text``/``profile`` where they apply)."""
    repeats = QUICK_REPEATS if quick else REPEATS
    events = EVENTS // 2 if quick else EVENTS
    n_calls = agents_sdk.QUICK_CALLS if quick else agents_sdk.CALLS
    return asyncio.run(_run_async(events, n_calls, repeats))


def profile_target(name: str) -> Callable[[], object] | None:
    """The path behind a figure, for the runner's profiler: kernel_ext bursts (publish → hub
    → sender), a few seconds' worth."""
    if "kernel_ext" not in name:
        return None

    async def bursts() -> None:
        async with KernelExtContender() as ours:
            for _ in range(60):
                await ours.trial(EVENTS)

    def go() -> None:
        contextvars.Context().run(asyncio.run, bursts())

    return go


def main() -> int:
    quick = "--quick" in sys.argv
    print_figures("vs peers, per event tool → sender", run(quick=quick))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
