"""Stopping one running tool call: :func:`stop_call`, by its call id.

Every tool call that runs under the wrapped tool runtime (:mod:`kernel_ext.instrument`, and
the integrations built on it: pydantic-ai, LangChain / LangGraph, the OpenAI Agents SDK) is
registered here by its call id while it runs. ``stop_call(call_id)`` answers one of
(:data:`StopAnswer`, the strings of :mod:`kernel_ext.observability.count_names`):

* ``"stopping"`` — the stop won: :attr:`kernel_ext.ToolCall.stop_requested` turns true, an
  async call's task is cancelled at its next ``await`` (its runtime's, not the kernel's turn:
  the wrapper catches the cancellation and the turn goes on), and the call ends *stopped*:
  the wrapped call returns :func:`stopped_result` (a normal tool result for the model), and
  its streams end with one ``aborted`` block whose payload carries ``"stopped": true``;
* ``"already_ended"`` — the call had ended first (returned, failed, or been stopped already;
  the last :data:`RECENT_ENDS` ended calls of the process are remembered);
* ``"unknown"`` — no such call in this process: also a call that is not on the convergence
  path (one seen only through its span, or set by hand with :func:`kernel_ext.use_tool_call`),
  which cannot be stopped;
* ``"refused"`` — the call id is not 16 lower-case hex digits (any other type, size or
  content): nothing is looked up.

A stop and the call's own end race through one atomic step, so exactly one wins: the answer
says which, and the pane ends once (``done`` or the stopped ``aborted``). A process forked
while calls run does not take them along: in the child a stop of one is ``unknown``. Every answer is
counted (:func:`stop_counts`, and the OpenTelemetry counter ``kernel_ext.stops`` by
``answer``). Never raises; callable from any thread.

Sync tool code is not interrupted: it sees the stop through
``current_tool_call().stop_requested`` (one attribute read) and returns early; whatever it
returns, the wrapped call returns the stopped result, with the tool's text as what it had so
far.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Final, Literal

from kernel_ext.context import CallLife, current_tool_call
from kernel_ext.observability._rare_log import RareLog
from kernel_ext.observability.count_names import (
    STOP_ALREADY_ENDED as ALREADY_ENDED,
)
from kernel_ext.observability.count_names import (
    STOP_REFUSED as REFUSED,
)
from kernel_ext.observability.count_names import (
    STOP_STOPPING as STOPPING,
)
from kernel_ext.observability.count_names import (
    STOP_UNKNOWN as UNKNOWN,
)
from kernel_ext.worker import _fork

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "ALREADY_ENDED",
    "RECENT_ENDS",
    "REFUSED",
    "SO_FAR_MAX",
    "STOPPED_MESSAGE",
    "STOPPED_RESULT_LEAD",
    "STOPPING",
    "UNKNOWN",
    "StopAnswer",
    "record_so_far",
    "stop_call",
    "stop_counts",
    "stopped_result",
]

StopAnswer = Literal["stopping", "already_ended", "unknown", "refused"]
"""What :func:`stop_call` answers (module docstring)."""

RECENT_ENDS: Final = 512
"""How many ended calls the process remembers (the last ones), to answer ``already_ended``
to a stop that arrives just after the call's end."""

SO_FAR_MAX: Final = 4000
"""The most characters of what a stopped call had said so far that its result carries
(longer: the start, cut with the protocol's truncation marker)."""

STOPPED_MESSAGE: Final = "stopped by the user"
"""The ``payload.message`` summary of a stopped call's ``aborted`` block."""

STOPPED_RESULT_LEAD: Final = "The user stopped this tool call before it finished."
"""How every :func:`stopped_result` begins: what a model (or a scripted one) reads as "this
call was stopped"."""

_CALL_ID = re.compile(r"[0-9a-f]{16}")
_log = logging.getLogger("kernel_ext.stop")
_rare = RareLog(_log)

# call id -> life, of the calls running now (written by the instrumented runtime).
_running: dict[str, CallLife] = {}
# The call ids of the last RECENT_ENDS ended calls (the runtime's end, in C: deque.append).
_ended: deque[str] = deque(maxlen=RECENT_ENDS)
# call id -> life, of the calls whose stop won, oldest first (at most RECENT_ENDS; written
# under _lock): a second stop before the call's end is told ``stopping`` again.
_stopped: dict[str, CallLife] = {}
_lock = threading.Lock()  # stops only: the runtime's path takes no lock
_counts: dict[str, int] = {}


def _forget_in_child() -> None:
    """In a forked child: the parent's running calls run on in the parent, not here; a stop
    the child gets for one is ``unknown``. A fresh lock: the parent's may have been held."""
    global _lock
    _running.clear()
    _ended.clear()
    _stopped.clear()
    _lock = threading.Lock()


_fork.call_in_child(_forget_in_child)

# The instrumented runtime's two steps, each the C method of a builtin container (no Python
# frame on the hot path of every wrapped call):
register = _running.__setitem__
"""``register(call_id, life)``: the call has begun."""

note_end = _ended.append
"""``note_end(call_id)``: the call is ending; then :data:`take_running`."""

take_running = _running.pop
"""``take_running(call_id, None) is None``: after :data:`note_end`, whether a stop won
first (the call then ends stopped). The atomic ``dict.pop`` decides against a concurrent
stop; as the end is noted before, a stop that finds the call no longer running always
finds it ended (``already_ended``), never ``unknown``."""


def stop_call(call_id: object, *, reason: object = None) -> StopAnswer:
    """Stop the running tool call ``call_id`` (module docstring). ``reason`` is kept for the
    log only. Never raises."""
    try:
        answer = _stop(call_id)
    except Exception:  # pragma: no cover - defensive: a stop never raises
        _rare("stop_error", "stop_call failed", exc_info=True)
        answer = UNKNOWN
    with _lock:
        _counts[answer] = _counts.get(answer, 0) + 1
    _metric(answer)
    if answer == STOPPING:
        _log.info("tool call %s stopped (%s)", call_id, _reason_text(reason))
    return answer


def _stop(call_id: object) -> StopAnswer:
    if not isinstance(call_id, str) or len(call_id) != 16 or _CALL_ID.fullmatch(call_id) is None:
        return REFUSED
    with _lock:
        life = _running.pop(call_id, None)
        if life is None:
            if call_id in _ended:
                return ALREADY_ENDED
            stopped = _stopped.get(call_id)
            return STOPPING if stopped is not None and not stopped.ended else UNKNOWN
        life.stop_requested = True
        _stopped[call_id] = life
        if len(_stopped) > RECENT_ENDS:
            del _stopped[next(iter(_stopped))]
    task = life.task
    if task is not None:
        task.get_loop().call_soon_threadsafe(_cancel, life, task)
    return STOPPING


def _cancel(life: CallLife, task: asyncio.Task[Any]) -> None:
    """On the call's loop: cancel its task, unless the call ended meanwhile (the task then
    runs the kernel's code, which a stop must not touch)."""
    if not life.ended and life.task is task:
        life.cancelling = True
        task.cancel()


def _reason_text(reason: object) -> str:
    if isinstance(reason, str):
        return reason[:200].encode("utf-8", "backslashreplace").decode("utf-8")
    return "no reason given"


def stop_counts() -> dict[str, int]:
    """The answers :func:`stop_call` gave in this process, by answer."""
    return dict(_counts)


def _metric(answer: str) -> None:
    try:
        from kernel_ext.observability.otel_metrics import stops

        stops.add(1, {"answer": answer})
    except Exception:  # pragma: no cover - the OpenTelemetry API does not raise
        pass


def record_so_far(text: str) -> None:
    """What the running call has said so far (replacing what was recorded): the stopped
    result carries it. For tool helpers such as ``ask_colleague``; a no-op outside a call."""
    call = current_tool_call()
    if call is not None and isinstance(text, str):
        call.life.so_far = text


def stopped_result(so_far: object = None) -> str:
    """The tool result a stopped call returns to the model: it says the user stopped the
    call, with what the call had said so far when that is a non-empty string (at most
    :data:`SO_FAR_MAX` characters, cut with the protocol's truncation marker)."""
    text = STOPPED_RESULT_LEAD
    if isinstance(so_far, str) and so_far.strip():
        from kernel_ext.protocol import TRUNCATION_MARKER, well_formed

        if len(so_far) > SO_FAR_MAX:
            so_far = so_far[:SO_FAR_MAX] + TRUNCATION_MARKER.format(n=len(so_far) - SO_FAR_MAX)
        text += " What it had said so far:\n" + well_formed(so_far)
    else:
        text += " It had no result yet."
    return text
