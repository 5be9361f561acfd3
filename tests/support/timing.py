"""Time in tests: waiting for a condition with a deadline, and a clock the test moves.

* :func:`wait_until` — poll a condition (sync or async) until it holds, or fail with a
  ``TimeoutError`` that says what was awaited (a message, or a callable describing the
  state at the deadline). Given an ``asyncio.Event`` that is set on every change, it waits
  for the event instead of polling. :func:`wait_until_sync` is the same rule for threads
  and fixtures without an event loop.
* :data:`CALL_TIMEOUT` — the deadline of one round trip to a local server.
* :class:`FakeClock` — a monotonic clock for the library's injectable ``clock`` arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable

Message = str | Callable[[], object]
"""What a timed-out wait says: a text, or a callable describing the state (called once,
at the deadline)."""

DEFAULT_MESSAGE = "condition not met in time"

CALL_TIMEOUT = 30.0
"""Seconds a test gives one round trip to a server of its own on 127.0.0.1 (a Socket.IO
call or connect, an HTTP request, a client's shutdown): a deadline that fails a hang, not a
slow machine — CI may share its two cores with other work, where 5 s was seen to run out."""


def _timed_out(message: Message, timeout: float) -> TimeoutError:
    text = message() if callable(message) else message
    return TimeoutError(f"{text} (waited {timeout:g} s)")


def wait_until_sync(
    condition: Callable[[], object],
    timeout: float = 10.0,
    message: Message = DEFAULT_MESSAGE,
    *,
    interval: float = 0.02,
) -> None:
    """Return once ``condition()`` is true; raise ``TimeoutError`` (saying ``message``) when
    it is still false after ``timeout`` seconds. An exception of ``condition`` propagates
    at once (a condition fails early that way, e.g. when a process it waits on exited)."""
    deadline = time.monotonic() + timeout
    while not condition():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(message, timeout)
        time.sleep(min(interval, remaining))  # polling with a deadline


async def wait_until(
    condition: Callable[[], object | Awaitable[object]],
    timeout: float = 10.0,
    message: Message = DEFAULT_MESSAGE,
    *,
    interval: float = 0.01,
    wake: asyncio.Event | None = None,
) -> None:
    """:func:`wait_until_sync` on the running loop: ``condition`` may be sync or async.

    With ``wake`` (an event set whenever what ``condition`` reads changed), the condition
    is checked again on each change rather than every ``interval`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        if wake is not None:
            wake.clear()  # before the check: a change during it sets the event again
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise _timed_out(message, timeout)
        if wake is None:
            await asyncio.sleep(min(interval, remaining))  # polling with a deadline
        else:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), remaining)


class FakeClock:
    """A monotonic clock the test moves by hand (``now``, or :meth:`advance`); pass it
    where the library takes a ``clock`` callable."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
