"""Shared pieces of the reliability suite (test_reliability_*.py, test_fuzz.py, test_intruders.py).

Scale comes from the environment, so the same tests run small in CI and long in the
``soak`` tox environment (docs/reliability.md):

* ``KERNEL_EXT_RELIABILITY_RUNS`` — repetitions of each fault scenario (CI 3, soak 20);
* ``KERNEL_EXT_SOAK_CALLS`` — tool calls through the whole path (CI 2,000, soak 100,000);
* ``KERNEL_EXT_FLOOD_STREAMS`` / ``KERNEL_EXT_FLOOD_SECONDS`` — concurrent flooded streams
  and how long each is flooded (CI 100 × 1.5 s, soak 1,000 × 3 s);
* ``KERNEL_EXT_FUZZ_EXAMPLES`` — hypothesis examples per fuzz test (CI 100, soak 2,000);
* ``KERNEL_EXT_RELIABILITY_REPORT`` — a file that receives one JSON line of figures per
  scenario (what was tried, how often, what was lost), for docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.sdk.trace import TracerProvider

from kernel_ext.attribution.processor import ToolSpanProcessor
from kernel_ext.attribution.tap import Tap
from kernel_ext.emit import Emitter, LoopbackEmitter
from kernel_ext.instrument import ToolDescription, tool_call_scope
from kernel_ext.stream import StreamHub
from support import SUPPORT
from support.relay_helpers import (
    CALL,
    CONV,
    SECRET,
    Browser,
    RelayProcess,
    emitter_for,
    terminals,
)
from support.timing import CALL_TIMEOUT, wait_until


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


RUNS = env_int("KERNEL_EXT_RELIABILITY_RUNS", 3)
SOAK_CALLS = env_int("KERNEL_EXT_SOAK_CALLS", 2_000)
FLOOD_STREAMS = env_int("KERNEL_EXT_FLOOD_STREAMS", 100)
FLOOD_SECONDS = env_float("KERNEL_EXT_FLOOD_SECONDS", 1.5)
FUZZ_EXAMPLES = env_int("KERNEL_EXT_FUZZ_EXAMPLES", 100)
REPORT = os.environ.get("KERNEL_EXT_RELIABILITY_REPORT")

# The test relay's Engine.IO ping interval and timeout, seconds (python-engineio sends the
# interval in whole seconds): a frozen relay is noticed after about 1.5 s, not 45 s.
SHORT_PINGS = (1, 0.5)
# python-socketio's defaults, for load: a browser client sharing its process with a worker
# that floods must not be dropped for a late pong (it would lose what was queued for it).
DEFAULT_PINGS = (25, 20)
RELAY_SCRIPT = Path(__file__).with_name("reliability_relay.py")


def report(scenario: str, **figures: Any) -> None:
    """Append one JSON line of figures to ``KERNEL_EXT_RELIABILITY_REPORT`` (if set)."""
    if not REPORT:
        return
    line = {"scenario": scenario, "python": sys.version.split()[0], **figures}
    with open(REPORT, "a", encoding="utf-8") as out:
        out.write(json.dumps(line, sort_keys=True) + "\n")


# -- the web process --------------------------------------------------------------------


class TestRelay(RelayProcess):
    """``tests/support/reliability_relay.py`` in a subprocess: the real relay with short pings and
    a ``/stats`` page; its log goes to a file (:meth:`log`). Killed in :meth:`stop`."""

    __test__ = False

    def __init__(
        self,
        port: int | None = None,
        redis_url: str | None = None,
        pings: tuple[float, float] = SHORT_PINGS,
        worker_grace: float | None = None,
    ) -> None:
        super().__init__(port, redis_url)
        self.pings = pings
        self.worker_grace = worker_grace
        handle, self._log_path = tempfile.mkstemp(prefix="kx-relay-", suffix=".log")
        os.close(handle)

    def start(self) -> None:
        env = dict(os.environ, KERNEL_EXT_SECRET=SECRET)
        cmd = [sys.executable, str(RELAY_SCRIPT), "--port", str(self.port)]
        cmd += ["--ping-interval", str(self.pings[0]), "--ping-timeout", str(self.pings[1])]
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        if self.worker_grace is not None:
            cmd += ["--worker-grace", str(self.worker_grace)]
        with open(self._log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )

    def log(self) -> str:
        return Path(self._log_path).read_text(encoding="utf-8", errors="replace")

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT) as client:
            response = await client.get(f"http://127.0.0.1:{self.port}/stats")
            response.raise_for_status()
            result: dict[str, Any] = response.json()
            return result

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(OSError):
            os.unlink(self._log_path)


@contextlib.asynccontextmanager
async def running_relay(
    redis_url: str | None = None,
    pings: tuple[float, float] = SHORT_PINGS,
    worker_grace: float | None = None,
) -> Any:
    relay = TestRelay(redis_url=redis_url, pings=pings, worker_grace=worker_grace)
    relay.start()
    try:
        await relay.wait_ready()
        yield relay
    finally:
        relay.stop()


# -- browsers ---------------------------------------------------------------------------


class WatchedBrowser(Browser):
    """A :class:`relay_helpers.Browser` that also notices its disconnects."""

    def __init__(self, name: str = "browser") -> None:
        super().__init__(name)
        self.disconnects = 0
        self.disconnected = asyncio.Event()
        self.client.on("disconnect", self._on_disconnect, namespace="/chat")

    def _on_disconnect(self, *args: Any) -> None:
        self.disconnects += 1
        self.disconnected.set()

    async def switch(self, room: str) -> None:
        """Leave the conversations joined so far and join ``room`` (a user moving on)."""
        for old in list(self.rooms):
            ack = await self.client.call(
                "leave_conversation",
                {"conversationId": old},
                namespace="/chat",
                timeout=CALL_TIMEOUT,
            )
            assert ack == {"ok": True}, ack
            self.rooms.remove(old)
        assert await self.join(room) == {"ok": True}

    def stream(self, call_id: str, task_id: str | None = None) -> list[dict[str, Any]]:
        return [
            b
            for b in self.blocks
            if b["callId"] == call_id and (task_id is None or b["taskId"] == task_id)
        ]


class Tally(Browser):
    """A browser that keeps counts instead of blocks (long runs stay in bounded memory).

    ``expect(keys)`` opens a batch of streams; each terminal of the batch is checked off
    once; a second terminal of a stream is a ``duplicate``; a terminal of no open batch is
    ``stray``; a running block after its stream's terminal is ``late``. Running blocks
    per stream and their ``ts`` are kept only when ``keep_running`` (flood tests).
    """

    def __init__(self, name: str = "tally", keep_running: bool = False) -> None:
        super().__init__(name)
        self.keep_running = keep_running
        self.running = 0
        self.terminal_count = 0
        self.duplicates = 0
        self.stray = 0
        self.late = 0
        self.open: set[tuple[Any, Any]] = set()
        self.done: set[tuple[Any, Any]] = set()
        self.by_stream: dict[tuple[Any, Any], list[int]] = {}
        self.states: dict[tuple[Any, Any], str] = {}

    def expect(self, keys: Iterator[tuple[Any, Any]] | list[tuple[Any, Any]]) -> None:
        self.open.update(keys)

    def settle(self) -> None:
        """Forget the finished batch (its duplicates would count as ``stray`` from now)."""
        self.done.clear()
        self.states.clear()

    def _on_block(self, block: dict[str, Any]) -> None:
        key = (block["callId"], block["taskId"])
        if block["state"] == "running":
            self.running += 1
            if key in self.done:
                self.late += 1
            if self.keep_running:
                self.by_stream.setdefault(key, []).append(block["ts"])
        else:
            self.terminal_count += 1
            if key in self.open:
                self.open.discard(key)
                self.done.add(key)
                self.states[key] = block["state"]
            elif key in self.done:
                self.duplicates += 1
            else:
                self.stray += 1
        self._changed.set()

    async def wait_batch(self, timeout: float = 30.0) -> None:
        """Wait until every expected terminal arrived."""
        await wait_until(
            lambda: not self.open,
            timeout,
            lambda: f"{self.name}: {len(self.open)} terminals missing",
            wake=self._changed,
        )


@contextlib.asynccontextmanager
async def browser_on(
    port: int, room: str = CONV, name: str = "browser"
) -> AsyncIterator[WatchedBrowser]:
    """A :class:`WatchedBrowser` connected to the relay on ``port`` and joined to ``room``."""
    browser = WatchedBrowser(name)
    try:
        await browser.connect(port)
        assert await browser.join(room) == {"ok": True}
        yield browser
    finally:
        await browser.close()


def one_terminal_last(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """The stream's blocks end with its only terminal; running seqs strictly increase."""
    finals = terminals(blocks)
    assert len(finals) == 1, finals
    assert blocks[-1] is finals[0]
    seqs = [b["envelope"]["seq"] for b in blocks if b["state"] == "running"]
    assert seqs == sorted(set(seqs)), seqs
    return finals[0]


# -- the worker -------------------------------------------------------------------------


class Worker:
    """The worker side of the whole path, as a kernel would run it: an SDK tracer provider
    whose :class:`ToolSpanProcessor` feeds a :class:`Tap` and a :class:`StreamHub`, tool
    calls attributed by :func:`tool_call_scope`, and one sender (a :class:`LoopbackEmitter`
    to ``port`` unless ``emitter`` builds another)."""

    def __init__(
        self,
        port: int | None = None,
        *,
        emitter: Callable[[StreamHub], Emitter] | None = None,
        max_running_per_second: float | None = 10.0,
        hub_options: dict[str, Any] | None = None,
        **emitter_options: Any,
    ) -> None:
        self.tap = Tap()
        self.hub = StreamHub(
            tap=self.tap, max_running_per_second=max_running_per_second, **(hub_options or {})
        )
        self.provider = TracerProvider()
        self.processor = ToolSpanProcessor(tap=self.tap, sink=self.hub)
        self.provider.add_span_processor(self.processor)
        if emitter is not None:
            self.emitter = emitter(self.hub)
        else:
            assert port is not None
            self.emitter = emitter_for(port, self.hub, **emitter_options)

    def call(self, conversation: str, tool_name: str = "ask_colleague") -> Any:
        """``with worker.call(conv) as call:`` — one attributed tool call (its span)."""
        return tool_call_scope(
            ToolDescription(tool_name, conversation), tracer_provider=self.provider, sink=self.hub
        )

    async def __aenter__(self) -> Worker:
        await self.emitter.start()
        await wait_until(lambda: self.emitter.healthy, timeout=20)
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.emitter.stop(timeout=10)
        finally:
            self.provider.shutdown()

    @property
    def loopback(self) -> LoopbackEmitter:
        assert isinstance(self.emitter, LoopbackEmitter)
        return self.emitter

    def sizes(self) -> dict[str, int]:
        """What the worker side holds: live calls, open streams, call counters, queued
        blocks, terminals awaiting an acknowledgement."""
        stats = self.hub.stats()
        return {
            "tap": len(self.tap),
            "streams": stats.streams,
            "calls": stats.calls,
            "queue": stats.queue,
            "pending_terminals": self.emitter._pending(),
        }

    def losses(self) -> dict[str, int]:
        """Blocks the worker dropped, by reason (only the reasons that happened)."""
        counts = self.hub.stats().counts
        return {k: v for k, v in counts.items() if k not in ("admitted", "delivered") and v}


EMPTY = {"tap": 0, "streams": 0, "calls": 0, "queue": 0, "pending_terminals": 0}


async def settled(worker: Worker, timeout: float = 20.0) -> None:
    """Wait until the worker holds nothing (every call ended, every terminal acknowledged)."""
    try:
        await wait_until(lambda: worker.sizes() == EMPTY, timeout=timeout)
    except TimeoutError:
        raise AssertionError(f"worker state left over: {worker.sizes()}") from None


class Clock:
    """Elapsed seconds on the worker's monotonic clock."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# -- a worker process ---------------------------------------------------------------------

WORKER_SCRIPT = SUPPORT / "stream_worker.py"


class WorkerProcess:
    """``tests/support/stream_worker.py`` in a subprocess: one command per line on its standard
    input, one answer per line on its standard output. Killed in :meth:`close`."""

    def __init__(
        self,
        worker_id: str,
        *,
        relay_port: int | None = None,
        redis_url: str | None = None,
        call_id: str = CALL,
    ) -> None:
        self.args = ["--worker-id", worker_id, "--room", CONV, "--call", call_id]
        if relay_port is not None:
            self.args += ["--relay-url", f"http://127.0.0.1:{relay_port}"]
        else:
            assert redis_url is not None
            self.args += ["--redis-url", redis_url]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER_SCRIPT),
            *self.args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=dict(os.environ, KERNEL_EXT_SECRET=SECRET),
        )
        assert await self.answer() == "ready"

    def send(self, *commands: str) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write("".join(f"{command}\n" for command in commands).encode())

    async def answer(self, timeout: float = 40.0) -> str:
        assert self.proc is not None
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        assert line, f"the worker exited ({self.proc.returncode})"
        return line.decode().rstrip("\n")

    async def do(self, *commands: str) -> None:
        """Run ``commands`` one by one; each must be flushed (terminals: acknowledged)."""
        for command in commands:
            self.send(command)
            assert await self.answer() == "ok True", command

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        await asyncio.wait_for(self.proc.wait(), 10)

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            await self.kill()


@contextlib.asynccontextmanager
async def worker_process(worker_id: str, **where: Any) -> AsyncIterator[WorkerProcess]:
    """A started :class:`WorkerProcess` (``where``: ``relay_port=`` or ``redis_url=``)."""
    worker = WorkerProcess(worker_id, **where)
    try:
        await worker.start()
        yield worker
    finally:
        await worker.close()
