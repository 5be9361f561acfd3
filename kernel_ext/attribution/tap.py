"""The trajectory tap: the live tool calls of each conversation, fed by the span processor.

:class:`Tap` holds, per conversation, the tool calls whose ``execute_tool`` span has started
and not ended (name, call id, start order). The span processor adds a call at span start and
removes it at span end; the near-match resolver (:mod:`kernel_ext.attribution.resolve`) reads it.

Guarantees:

* Bounded: at most ``max_per_conversation`` live calls per conversation and ``max_calls``
  overall. Adding to a full tap evicts the oldest call (of that conversation, or overall),
  counts it on ``kernel_ext.tap.evictions`` and logs it. Nothing else grows: a conversation
  with no live call takes no memory (ended calls' tool-call ids are bounded below).
* Never a wrong near-match after an eviction: an evicted call may still be live, so until
  its span's end is seen (:meth:`Tap.discard`) or ``evicted_ttl`` seconds have passed,
  :meth:`Tap.near_match` for its conversation and tool name answers "ambiguous" (no call),
  whatever else is live. At most ``max_calls`` such evicted calls are remembered (the
  oldest is forgotten first).
* The model's tool-call id outlives the call a while: :meth:`Tap.llm_call_id` answers for a
  live call and, for ``ended_ttl`` seconds after its end was seen (:meth:`Tap.discard`),
  for an ended one; at most ``max_calls`` ended calls are remembered (the oldest is
  forgotten first), only those that had an id; the end of each such call forgets those
  whose time is up. Attribution never sees an ended call: :meth:`Tap.get`,
  :meth:`Tap.live` and :meth:`Tap.near_match` answer for live calls only.
* Thread-safe: every operation holds one lock for O(1) work, except the queries by tool
  name (:meth:`Tap.live`, :meth:`Tap.near_match`), which scan one conversation's live
  calls (at most ``max_per_conversation``).
* Never raises on its operational methods; only the constructor rejects bad bounds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

from opentelemetry.util.types import AttributeValue

from kernel_ext._shared.bounded import BoundedMap
from kernel_ext.errors import check_positive_ints, check_positive_numbers
from kernel_ext.observability import otel_metrics
from kernel_ext.observability._rare_log import RareLog
from kernel_ext.worker import _fork

__all__ = ["CallSink", "LiveCall", "Tap", "default_tap"]

_log = logging.getLogger(__name__)


class LiveCall(NamedTuple):
    """A tool call whose ``execute_tool`` span has started and not ended (an immutable
    record; a NamedTuple: as cheap to build as a plain tuple, per tool span)."""

    call_id: str
    tool_name: str
    conversation_id: str | None
    llm_call_id: str | None = None
    parent_call_id: str | None = None
    started_ns: int = 0
    trace_id: int = 0
    """The span's trace id when the span is sampled, else ``0`` (:attr:`ToolCall.trace_id
    <kernel_ext.context.ToolCall.trace_id>`)."""


class CallSink(Protocol):
    """What the span processor and the instrumentor tell the stream layer about tool calls.

    Every member is required (the processor calls the first two, the instrumentor the last
    two). Implementations must be enqueue-only and must never raise: they run on the thread
    that starts or ends the span, inside the traced code.

    A sink may also have ``tool_call_returned(call, result)`` (:class:`kernel_ext.stream.
    StreamHub` has): for a call that returned, the instrumented runtime calls it, when the
    sink has it, in place of ``tool_call_ended(call, None)``, with what the call's code
    returned (the ``done`` text of the streams the hub opened for the call).
    """

    def tool_call_started(self, parent: LiveCall, child: LiveCall) -> None:
        """A tool call ``child`` started while ``parent`` was live (a nested tool call):
        emit a ``tool_call`` block (child's tool name, start marker) attributed to parent."""

    def tool_call_ended(self, call: LiveCall, error: str | None) -> None:
        """``call`` ended: failed with ``error`` (a one-line summary; ``""`` when there is
        none), or returned when ``error`` is ``None``. Every stream of it with no terminal
        yet gets exactly one terminal (:meth:`kernel_ext.stream.StreamHub.tool_call_ended`
        says which)."""

    def call_attributes(self, call_id: str) -> Mapping[str, AttributeValue]:
        """Span attributes describing ``call_id``'s streams so far (blocks sent and dropped,
        how the callId was resolved), written onto the call's span while it is still live
        (invariant 7). Return an empty mapping when there is nothing to say (what an
        explicit subclass of this protocol inherits)."""
        return {}


class Tap:
    """The live tool calls of each conversation, in start order.

    Calls are keyed by call id; a call whose span carried no conversation id lives under
    the conversation ``None`` (and is found only by queries for ``None``).

    Args:
        max_calls: live calls kept overall (default 10,000).
        max_per_conversation: live calls kept per conversation (default 256).
        evicted_ttl: seconds an evicted call keeps near-matches of its conversation and
            tool name ambiguous unless its end is seen first (default 600, the default
            deadline of ``ask_colleague``).
        ended_ttl: seconds after its end that :meth:`llm_call_id` still answers for a
            call (default 60).
        clock: the monotonic clock of ``evicted_ttl`` and ``ended_ttl`` (tests pass a
            fake).

    Raises:
        ConfigError: a bound is not a positive number.
    """

    __slots__ = (
        "__weakref__",
        "_by_conversation",
        "_calls",
        "_clock",
        "_ended",
        "_evicted",
        "_lock",
        "_rare",
        "_uncertain",
        "_unsure",
        "ended_ttl",
        "evicted_ttl",
        "max_calls",
        "max_per_conversation",
    )

    def __init__(
        self,
        *,
        max_calls: int = 10_000,
        max_per_conversation: int = 256,
        evicted_ttl: float = 600.0,
        ended_ttl: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_positive_ints(max_calls=max_calls, max_per_conversation=max_per_conversation)
        check_positive_numbers(evicted_ttl=evicted_ttl, ended_ttl=ended_ttl)
        self.max_calls = max_calls
        self.max_per_conversation = max_per_conversation
        self.evicted_ttl = float(evicted_ttl)
        self.ended_ttl = float(ended_ttl)
        self._clock = clock
        self._rare = RareLog(_log)
        self._fresh_state()
        _fork.reset_in_child(self._reset_after_fork)

    def _fresh_state(self) -> None:
        """The lock, the live calls and the ended calls' tool-call ids, new and empty."""
        self._lock = threading.Lock()
        # Insertion-ordered dicts: the first key is the oldest live call.
        self._calls: dict[str, LiveCall] = {}
        self._by_conversation: dict[str | None, dict[str, LiveCall]] = {}
        self._evicted = 0
        # Evicted calls that may still be live: call id -> (conversation, tool, forget at),
        # oldest first; and how many of them each (conversation, tool name) has.
        self._uncertain: dict[str, tuple[str | None, str, float]] = {}
        self._unsure: dict[tuple[str | None, str], int] = {}
        # Ended calls' tool-call ids (call id -> llm call id), for llm_call_id().
        self._ended: BoundedMap[str, str] = BoundedMap(
            self.max_calls, self.ended_ttl, clock=self._clock
        )

    def _reset_after_fork(self) -> None:
        """In a forked child: no live calls and no ended ones. The parent's calls end in
        the parent; kept here they would never end, and would make near-matches ambiguous
        forever."""
        self._fresh_state()

    # -- feeding (the span processor) -------------------------------------------------

    def add(self, call: LiveCall) -> bool:
        """Make ``call`` live. Returns ``False`` (and changes nothing) when a call with the
        same id is already live. Evicts the oldest call when a bound is reached."""
        call_id = call.call_id
        conversation_id = call.conversation_id
        # acquire/release rather than ``with``: half the cost on CPython 3.11 (a hot path:
        # the span processor calls this for every tool span).
        lock = self._lock
        lock.acquire()
        try:
            calls = self._calls
            if call_id in calls:
                return False
            conversation = self._by_conversation.get(conversation_id)
            if conversation is None:
                if len(calls) < self.max_calls:
                    self._by_conversation[conversation_id] = {call_id: call}
                    calls[call_id] = call
                    return True
            elif len(conversation) < self.max_per_conversation and len(calls) < self.max_calls:
                conversation[call_id] = call
                calls[call_id] = call
                return True
            evicted = self._add_evicting(call)
        finally:
            lock.release()
        for old, scope in evicted:
            self._report_eviction(old, scope)
        return True

    def _add_evicting(self, call: LiveCall) -> list[tuple[LiveCall, str]]:
        """Add ``call`` to a full tap, evicting the oldest calls; the lock is held."""
        calls = self._calls
        evicted: list[tuple[LiveCall, str]] = []
        conversation = self._by_conversation.get(call.conversation_id)
        if conversation is not None and len(conversation) >= self.max_per_conversation:
            evicted.append((self._remove(next(iter(conversation))), "conversation"))
        if len(calls) >= self.max_calls:
            evicted.append((self._remove(next(iter(calls))), "overall"))
        # An eviction may have emptied (and dropped) this conversation's dict.
        conversation = self._by_conversation.get(call.conversation_id)
        if conversation is None:
            conversation = self._by_conversation[call.conversation_id] = {}
        conversation[call.call_id] = call
        calls[call.call_id] = call
        self._evicted += len(evicted)
        forget_at = self._clock() + self.evicted_ttl
        for old, _ in evicted:
            self._remember_evicted(old, forget_at)
        return evicted

    def _remember_evicted(self, call: LiveCall, forget_at: float) -> None:
        """Keep near-matches for ``call``'s conversation and tool ambiguous (lock held)."""
        uncertain = self._uncertain
        if len(uncertain) >= self.max_calls:
            self._forget_evicted(next(iter(uncertain)))
        uncertain[call.call_id] = (call.conversation_id, call.tool_name, forget_at)
        key = (call.conversation_id, call.tool_name)
        self._unsure[key] = self._unsure.get(key, 0) + 1

    def _forget_evicted(self, call_id: str) -> None:
        """Forget an evicted call (lock held): its end was seen, or its time is up."""
        conversation_id, tool_name, _ = self._uncertain.pop(call_id)
        key = (conversation_id, tool_name)
        left = self._unsure[key] - 1
        if left:
            self._unsure[key] = left
        else:
            del self._unsure[key]

    def _expire_evicted(self) -> None:
        """Forget evicted calls whose time is up (lock held; oldest first, one clock read)."""
        uncertain = self._uncertain
        now = self._clock()
        while uncertain:
            call_id = next(iter(uncertain))
            if uncertain[call_id][2] > now:
                return
            self._forget_evicted(call_id)

    def discard(self, call_id: str) -> LiveCall | None:
        """Forget the live call ``call_id`` (its end was seen); return it, or ``None`` when
        it was not live (an evicted call's end: near-matches of its conversation may be sure
        again). Its tool-call id stays known to :meth:`llm_call_id` for ``ended_ttl``
        seconds."""
        lock = self._lock
        lock.acquire()  # not ``with``: see add()
        try:
            call = self._calls.pop(call_id, None)
            if call is not None:
                conversation_id = call.conversation_id
                conversation = self._by_conversation[conversation_id]
                del conversation[call_id]
                if not conversation:
                    del self._by_conversation[conversation_id]
                llm_call_id = call.llm_call_id
                if llm_call_id is not None:
                    ended = self._ended
                    ended.set(call_id, llm_call_id, refresh=True)
                    ended.expire()
            elif call_id in self._uncertain:
                self._forget_evicted(call_id)
            return call
        finally:
            lock.release()

    def clear(self) -> None:
        """Forget every live call, evicted call and ended call (evictions are not
        counted)."""
        with self._lock:
            self._ended.clear()
            self._calls.clear()
            self._by_conversation.clear()
            self._uncertain.clear()
            self._unsure.clear()

    # -- queries ------------------------------------------------------------------------

    def get(self, call_id: str) -> LiveCall | None:
        """The live call ``call_id``, or ``None``."""
        return self._calls.get(call_id)

    def llm_call_id(self, call_id: str) -> str | None:
        """The model's tool-call id (``LiveCall.llm_call_id``) of the live call ``call_id``,
        or of the call ``call_id`` whose end was seen less than ``ended_ttl`` seconds ago
        (one of the last ``max_calls`` ended calls that had one); else ``None``. For
        showing an ended call, never for attribution."""
        live = self._calls.get(call_id)
        if live is not None:
            return live.llm_call_id
        with self._lock:
            return self._ended.get(call_id)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._calls

    def __len__(self) -> int:
        """The number of live calls overall."""
        return len(self._calls)

    def live(
        self, conversation_id: str | None, tool_name: str | None = None
    ) -> tuple[LiveCall, ...]:
        """The live calls of ``conversation_id`` (only those named ``tool_name`` when it is
        given), oldest first."""
        with self._lock:
            found = self._by_conversation.get(conversation_id)
            if not found:
                return ()
            if tool_name is None:
                return tuple(found.values())
            return tuple(c for c in found.values() if c.tool_name == tool_name)

    def near_match(
        self, conversation_id: str | None, tool_name: str
    ) -> tuple[LiveCall | None, int]:
        """``(call, n)``: ``n`` live calls named ``tool_name`` in ``conversation_id``
        (counting stops at 2), and ``call`` the one of them when ``n == 1``, else ``None``.
        While a call of that name and conversation was evicted and may still be live, ``n``
        is 2 (ambiguous). Costs O(live calls of the conversation)."""
        with self._lock:
            if self._unsure:
                self._expire_evicted()
                if (conversation_id, tool_name) in self._unsure:
                    return None, 2
            found = self._by_conversation.get(conversation_id)
            if not found:
                return None, 0
            match: LiveCall | None = None
            for call in found.values():
                if call.tool_name == tool_name:
                    if match is not None:
                        return None, 2
                    match = call
            return match, 1 if match is not None else 0

    def conversations(self) -> int:
        """The number of conversations with at least one live call."""
        return len(self._by_conversation)

    def snapshot(self) -> tuple[LiveCall, ...]:
        """Every live call, oldest first."""
        with self._lock:
            return tuple(self._calls.values())

    @property
    def evicted(self) -> int:
        """Calls evicted from this tap since it was made."""
        return self._evicted

    @property
    def ended(self) -> int:
        """Ended calls whose tool-call id is remembered now (see :meth:`llm_call_id`)."""
        with self._lock:
            self._ended.expire()
            return len(self._ended)

    @property
    def uncertain(self) -> int:
        """Evicted calls remembered because they may still be live (see the module)."""
        return len(self._uncertain)

    def __repr__(self) -> str:
        return (
            f"Tap(live={len(self._calls)}, conversations={len(self._by_conversation)}, "
            f"max_calls={self.max_calls}, max_per_conversation={self.max_per_conversation})"
        )

    # -- internals ------------------------------------------------------------------------

    def _remove(self, call_id: str) -> LiveCall:
        """Remove the live call ``call_id`` from every index; the lock is held."""
        call = self._calls.pop(call_id)
        conversation = self._by_conversation[call.conversation_id]
        del conversation[call_id]
        if not conversation:
            del self._by_conversation[call.conversation_id]
        return call

    def _report_eviction(self, call: LiveCall, scope: str) -> None:
        with contextlib.suppress(Exception):
            otel_metrics.evictions.add(1, {"scope": scope})
        self._rare(
            "tap_eviction_" + scope,
            "trajectory tap full (%s bound): evicted live call %s (%s) of conversation %r",
            scope,
            call.call_id,
            call.tool_name,
            call.conversation_id,
        )


_default_tap: Tap | None = None
_default_lock = threading.Lock()


def default_tap() -> Tap:
    """The process-wide tap (made on first use with the default bounds); always the same
    object. The span processor and the resolver use it when given none."""
    global _default_tap
    tap = _default_tap
    if tap is None:
        with _default_lock:
            if _default_tap is None:
                _default_tap = Tap()
            tap = _default_tap
    return tap
