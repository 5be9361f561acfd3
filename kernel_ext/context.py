"""The active tool call, held in a contextvar: the convergence path of decision T2.

While a tool's code runs under the instrumented runtime (or inside
:func:`use_tool_call`), :func:`current_tool_call` returns that call and
:func:`current_call_id` its call id, the span id of its ``execute_tool`` span.

Guarantees:

* Each asyncio task and each thread started through ``contextvars.copy_context()`` or
  ``asyncio.to_thread`` sees the call that was active where it was created; concurrent
  calls of the same tool each see their own.
* A nested tool call shadows the enclosing one for its duration; the enclosing one is
  back afterwards (:attr:`ToolCall.parent` links them).
* :func:`use_tool_call` always restores what was there before, also on exceptions and
  cancellation.
* :func:`current_tool_call` and :func:`current_call_id` are each one ``ContextVar.get()``:
  the bound ``get`` of a dedicated contextvar, so each costs what a bare ``get`` costs.
* :func:`span_id_hex` is the one way a span id becomes a call id.
* A call's end is shared by every context that holds it: once the instrumented runtime (or
  the stream hub, when the call's span ends) has ended it, :attr:`ToolCall.ended` is true
  everywhere, also in tasks the tool started that outlive it; the stream hub then drops what
  they still publish for it.
* A process forked while a call is active does not take the call along: in the child that
  call (and the calls it nests in) is ended, since it runs on, and streams on, in the parent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from kernel_ext.worker import _fork

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "CallLife",
    "ToolCall",
    "ToolCallToken",
    "current_call_id",
    "current_tool_call",
    "reset_tool_call",
    "set_tool_call",
    "span_id_hex",
    "use_tool_call",
]


class CallLife:
    """Whether a tool call has ended, and whether it was asked to stop: flags shared by
    every copy of the context that holds the call (each set once, never cleared).

    ``ended`` and ``stop_requested`` are class defaults until set on the instance: a new
    life is then built without a Python ``__init__`` (one per wrapped tool call, on its hot
    path). ``stop_requested`` is set by :func:`kernel_ext.stop_call` when its stop won the
    race with the call's own end; ``task`` is the asyncio task an async call's runtime runs
    it in (:func:`kernel_ext.stop_call` cancels it), ``None`` for sync code.
    """

    ended: bool = False
    stop_requested: bool = False
    task: asyncio.Task[Any] | None = None
    cancelling: bool = False  # the stop has cancelled ``task``
    so_far: str | None = None  # what the call has said so far (kernel_ext.stop.record_so_far)

    def end(self) -> None:
        """Mark the call ended."""
        self.ended = True

    def __repr__(self) -> str:
        return f"CallLife(ended={self.ended}, stop_requested={self.stop_requested})"

    # A call's life is not part of its value: two records of one call compare equal.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, CallLife)

    def __hash__(self) -> int:
        return 0


class _ToolCallFields(NamedTuple):
    call_id: str
    tool_name: str
    conversation_id: str | None = None
    llm_call_id: str | None = None
    parent: ToolCall | None = None
    life: CallLife = cast("CallLife", None)  # always set by ToolCall.__new__
    trace_id: int = 0


_tuple_new = tuple.__new__


class ToolCall(_ToolCallFields):
    """One running tool call, as tool code sees it (an immutable record).

    ``call_id`` is the span id of the call's ``execute_tool`` span as 16 lower-case hex
    digits (the callId of its blocks); ``llm_call_id`` is the model's tool-call id
    (``gen_ai.tool.call.id``), a different thing; ``parent`` is the enclosing call when
    tools nest. ``life`` tells whether the call has ended (:attr:`ended`); a new one is made
    when none is given, and it is not part of the call's equality or repr. ``trace_id`` is
    the span's trace id (an int, as OpenTelemetry keeps it) when the span is sampled, else
    ``0``: the ``traceId`` of the call's blocks.
    """

    __slots__ = ()

    def __new__(
        cls,
        call_id: str,
        tool_name: str,
        conversation_id: str | None = None,
        llm_call_id: str | None = None,
        parent: ToolCall | None = None,
        life: CallLife | None = None,
        trace_id: int = 0,
    ) -> ToolCall:
        return _tuple_new(
            cls,
            (
                call_id,
                tool_name,
                conversation_id,
                llm_call_id,
                parent,
                life if life is not None else CallLife(),
                trace_id,
            ),
        )

    @property
    def ended(self) -> bool:
        """Whether the call has ended (its runtime returned or raised, or its span ended)."""
        return self.life.ended

    @property
    def stop_requested(self) -> bool:
        """Whether the call, or a call it runs in (:attr:`parent`, transitively), was asked to
        stop (:func:`kernel_ext.stop_call` answered ``"stopping"``): an attribute read per
        level, cheap enough for a sync tool's loop. Sync code checks it and returns early;
        async code is cancelled at its next ``await`` anyway."""
        call: ToolCall | None = self
        while call is not None:
            if call.life.stop_requested:
                return True
            call = call.parent
        return False

    def __repr__(self) -> str:
        return (
            f"ToolCall(call_id={self.call_id!r}, tool_name={self.tool_name!r}, "
            f"conversation_id={self.conversation_id!r}, llm_call_id={self.llm_call_id!r}, "
            f"parent={self.parent!r})"
        )


def span_id_hex(span_id: int) -> str:
    """The call id of a span id: its 16 lower-case hex digits, zero-padded
    (``0xA1`` → ``"00000000000000a1"``).

    Raises ``OverflowError`` for a negative id or one over 64 bits. The invalid span id 0
    gives sixteen zeros: callers check a span's validity first.
    """
    return span_id.to_bytes(8, "big").hex()


_CURRENT_CALL: ContextVar[ToolCall | None] = ContextVar(
    "kernel_ext.current_tool_call", default=None
)
_CURRENT_CALL_ID: ContextVar[str | None] = ContextVar("kernel_ext.current_call_id", default=None)


def _end_inherited_calls() -> None:
    """In a forked child: the calls active where the fork happened (and the calls they
    nest in) run on in the parent, whose blocks they are; the child ends its copies, so
    what it publishes for them is dropped (counted ``closed``), never sent twice or ended
    by the child."""
    call = _CURRENT_CALL.get()
    while call is not None:
        call.life.end()  # the child's copy of the life: the parent's call goes on
        call = call.parent


_fork.call_in_child(_end_inherited_calls)


current_tool_call = _CURRENT_CALL.get
"""``current_tool_call() -> ToolCall | None``: the tool call whose code is running in this
context, or ``None`` outside any.

Bound directly to ``ContextVar.get`` (a C call, no Python frame): the package's hot paths
(:meth:`kernel_ext.stream.StreamHub.publish`,
:func:`kernel_ext.attribution.resolve.attribute`, the span processor) read the active call
through it.
"""

current_call_id = _CURRENT_CALL_ID.get
"""``current_call_id() -> str | None``: the call id of :func:`current_tool_call`, or ``None``.

Bound directly to ``ContextVar.get`` so that the hot path costs a single lookup.
"""

# set_tool_call / reset_tool_call in halves, without their ToolCallToken (no NamedTuple built
# per call): the contextvars' own bound methods (C calls), for the instrumented
# runtime's per-call path (kernel_ext.instrument). Set both, reset both in reverse order;
# tool code and integrations use use_tool_call / set_tool_call instead.
set_call = _CURRENT_CALL.set
"""Make a call the active one (``set_call(call) -> Token``); pair with :data:`set_call_id`."""
reset_call = _CURRENT_CALL.reset
"""Undo :data:`set_call` with its token."""
set_call_id = _CURRENT_CALL_ID.set
"""Make a call id the active one (``set_call_id(call.call_id) -> Token``)."""
reset_call_id = _CURRENT_CALL_ID.reset
"""Undo :data:`set_call_id` with its token."""


class ToolCallToken(NamedTuple):
    """What :func:`set_tool_call` returns; hand it to :func:`reset_tool_call`."""

    call: Token[ToolCall | None]
    call_id: Token[str | None]


def set_tool_call(call: ToolCall | None) -> ToolCallToken:
    """Make ``call`` the active tool call in this context; return the token to undo it.

    Prefer :func:`use_tool_call`; this pair is for runtimes whose enter and exit happen
    in different places (hooks). Reset in the same context, in reverse order.
    """
    return ToolCallToken(set_call(call), set_call_id(call.call_id if call is not None else None))


def reset_tool_call(token: ToolCallToken) -> None:
    """Restore the tool call that was active before the matching :func:`set_tool_call`."""
    reset_call_id(token.call_id)
    reset_call(token.call)


@contextmanager
def use_tool_call(call: ToolCall | None) -> Iterator[ToolCall | None]:
    """Run a block with ``call`` as the active tool call; always restores in ``finally``.

    For runtimes that cannot be wrapped by the instrumentor::

        call_id = span_id_hex(span.get_span_context().span_id)
        with use_tool_call(ToolCall(call_id=call_id, tool_name="ask_colleague")):
            await ask_colleague(...)
    """
    token = set_tool_call(call)
    try:
        yield call
    finally:
        reset_tool_call(token)
