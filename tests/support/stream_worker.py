"""A worker process for the gone-worker tests (run as a script, never imported by tests).

The worker side of the path in a process of its own, so a test can SIGKILL or SIGSTOP it:
a :class:`~kernel_ext.stream.StreamHub` and one sender — a
:class:`~kernel_ext.emit.LoopbackEmitter` to ``--relay-url`` or a
:class:`~kernel_ext.emit.RedisEmitter` to ``--redis-url`` — presenting ``--worker-id``.
Every block is published inside the tool call ``--call`` of conversation ``--room``
(:func:`kernel_ext.use_tool_call`), as ``ask_colleague`` would.

It prints ``ready`` once the sender is connected, then executes one command per line of
standard input and answers each with one line:

* ``run <task> <text>`` — a running block of stream (call, task); answers ``ok <flushed>``;
* ``done <task> <text>`` — that stream's ``done`` terminal; answers ``ok <flushed>``
  (``True`` once the relay acknowledged it, for the loopback sender);

then waits for the next. End of input: the sender is stopped and the process exits.

Usage: ``KERNEL_EXT_SECRET=… python tests/support/stream_worker.py --relay-url URL --worker-id W``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from kernel_ext.attribution.tap import Tap
from kernel_ext.context import ToolCall, use_tool_call
from kernel_ext.emit import Emitter, LoopbackEmitter, RedisEmitter
from kernel_ext.stream import StreamHub


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--relay-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--room", required=True)
    parser.add_argument("--call", required=True)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    args = parser.parse_args()
    hub = StreamHub(max_running_per_second=None, tap=Tap())
    connected = asyncio.Event()
    emitter: Emitter
    if args.relay_url:
        emitter = LoopbackEmitter(
            args.relay_url,
            os.environ["KERNEL_EXT_SECRET"],
            hub=hub,
            worker_id=args.worker_id,
            ack_timeout=1.0,
            reconnect_delay=0.05,
            reconnect_delay_max=0.3,
            on_health=lambda healthy: connected.set() if healthy else None,
        )
    else:
        emitter = RedisEmitter(
            args.redis_url,
            hub=hub,
            worker_id=args.worker_id,
            heartbeat_interval=args.heartbeat,
            retry_interval=0.1,
        )
        connected.set()  # nothing to connect: blocks wait in the hub for the first ping
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await emitter.start()
    await connected.wait()  # the test waits for "ready" with a deadline
    print("ready", flush=True)
    with use_tool_call(ToolCall(args.call, "ask_colleague", args.room)):
        while line := (await reader.readline()).decode():
            command, task, text = line.rstrip("\n").split(" ", 2)
            state = {"run": "running", "done": "done"}[command]
            hub.publish(text, task_id=task, state=state)
            flushed = await emitter.flush(30.0)
            print(f"ok {flushed}", flush=True)
    await emitter.stop()


if __name__ == "__main__":
    asyncio.run(main())
