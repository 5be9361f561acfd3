"""What the benchmarks' workers send: a block as the plain contender emits it
(:func:`block`), and a paced schedule of sends (:func:`paced`); the relays' internal
secret (:data:`SECRET`), the namespace and the event they use.

Not a ``bench_*`` module: ``benchmarks/run.py`` does not run it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kernel_ext.protocol import NAMESPACE as NS
from kernel_ext.protocol import TOOL_EVENT_STREAM as EVENT

__all__ = ["EVENT", "NS", "SECRET", "block", "paced"]

SECRET = "bench-internal-secret"
"""The internal senders' secret of every benchmark relay (bench_stream's and the scale
curves')."""


def block(seq: int, text: str, task: str, call_id: str, state: str = "running") -> dict[str, Any]:
    """A text block on the wire: stream ``task`` of call ``call_id``, number ``seq``."""
    return {
        "v": 1,
        "callId": call_id,
        "taskId": task,
        "state": state,
        "ts": time.time_ns() // 1_000_000,
        "envelope": {
            "v": 1,
            "kind": "text",
            "streamKey": task,
            "seq": seq,
            "status": state,
            "payload": {"text": text},
        },
    }


async def paced(seconds: float, streams: int, send: Any, rate: int = 10) -> int:
    """Call ``await send(stream, due_ns)`` for every stream ``rate`` times a second, in 10 ms
    ticks (a tenth of the streams per tick at 10/s), for ``seconds``; the number of sends.

    ``due_ns`` is when the schedule produced the block (wall clock, ns), and latency counts
    from it: a sender that falls behind the schedule (its publishes block the producer) pays
    for the wait, instead of stamping its blocks late and looking fast (coordinated
    omission)."""
    loop = asyncio.get_running_loop()
    start, origin = loop.time(), time.time_ns()
    sent = 0
    for tick in range(int(seconds * 100)):
        delay = start + tick * 0.01 - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        due = origin + tick * 10_000_000
        slot = tick % (100 // rate)
        for stream in range(slot, streams, 100 // rate):
            await send(stream, due)
            sent += 1
    return sent
