"""Publishing blocks: the stream layer between tool code and the one sender.

Tool code (and the A2A adapter) calls :func:`publish`; a :class:`StreamHub` attributes each
block to its tool call, applies the per-stream rules (sequencing, the T4 throttle, exactly
one terminal per stream, the call's end) and queues what passes; the one sender takes it
through :meth:`StreamHub.consumer`. The modules, downhill:

* :mod:`.counts` — the three words (admitted, delivered, dropped by reason) and their totals;
* :mod:`.state` — what the hub holds per call and per stream, and :class:`HubStats`;
* :mod:`.consumer` — queue items and building their wire form;
* :mod:`.hub` — :class:`StreamHub`, the rules (its docstring lists every guarantee), and
  :class:`HubConsumer`, the one port a sender uses (take a batch, wait for more, report
  what became of it: :meth:`HubConsumer.delivered` / :meth:`HubConsumer.dropped`);
* :mod:`.registry` — the process-wide hub and :func:`publish`.

Guarantees of :meth:`StreamHub.publish` (and the module-level :func:`kernel_ext.publish`):

* Enqueue-only: it never blocks, never raises, and may be called from the event loop or any
  thread. Blocks are built and validated on the sender's side (:mod:`.consumer`).
* Attribution by :func:`kernel_ext.resolve.attribute` (T2: the active call, else the
  near-match, else none); the room is the call's conversation id, else the
  ``conversation_id`` argument. No room → dropped (``no_room``). A running block without a
  callId is not sent (``unattributed``); a terminal without one goes out with ``callId: null``.
* A stream is one (callId, taskId); ``task_id=None`` means the callId (a local block). A
  ``str`` item becomes a pseudo-envelope, a :class:`Progress` a ``progress`` envelope, each
  with a ``seq`` from the stream's counter, strictly increasing; ``done`` text goes to
  ``payload.text``, ``aborted`` text to ``payload.message``.
* T4: at most ``max_running_per_second`` running blocks per stream in any window of one
  second (a strict sliding window); over it the newest block is dropped (``throttled``). A
  terminal is never throttled, never queued behind dropped blocks, and sent exactly once per
  stream: a second terminal is dropped (``duplicate_terminal``), and so is any running block
  after it (``closed``), for as long as the call is live — what closed is remembered with
  the call, not on a clock.
* A call's end (:meth:`StreamHub.tool_call_ended` / :meth:`StreamHub.tool_call_returned`:
  the instrumented runtime returned or raised, or the call's span ended) closes every
  stream of it: an open stream gets its provisional terminal if it has one
  (``publish(..., provisional=True)``), else ``aborted`` with the error when the call
  failed, else ``done`` with the call's result text when it is the stream the hub opened
  for the call's nested tool calls and the tool published nothing on it, else ``aborted``;
  afterwards nothing more of that call is sent (``closed``), also not from tasks the tool
  started that outlive it (they hold the ended :class:`~kernel_ext.ToolCall`).
* The ``tool_call`` line of a nested call (:meth:`StreamHub.tool_call_started`) goes on the
  calling call's own stream with a ``seq`` from its counter, the one its text and progress
  reports take theirs from: one numbering, never a seq twice.
* Bounded: at most ``max_streams`` open streams (``stream_limit`` beyond), ``max_queue``
  queued running blocks (``queue_full`` beyond; terminals are queued regardless, and their
  number is bounded by the streams), ``max_calls`` live calls with state (the oldest is
  forgotten beyond, ``call_limit``), ``max_closed_per_call`` closed streams remembered per
  call (the oldest is forgotten beyond). A stream's state is released at its terminal, a
  call's when it ends; a stream idle for ``stream_idle_ttl`` seconds (its call's end never
  came) is ended like at its call's end (counted ``expired``), so its pane ends too.
* Terminals without a callId (attribution failed) are remembered like the streams of one
  call that never ends, so a repeated one is dropped too (at most ``max_closed_per_call``).
* With no sender attached, blocks are counted ``no_sender`` and not kept.

Counts (:mod:`.counts`: admitted, delivered, dropped by reason) are in
:meth:`StreamHub.stats` and reach OpenTelemetry in batches from the sender's side.
"""

from __future__ import annotations

from kernel_ext.stream.consumer import (
    Outgoing,
    OutgoingBlock,
    OutgoingChatEvent,
    Progress,
)
from kernel_ext.stream.counts import UNFLUSHED
from kernel_ext.stream.hub import (
    ATTR_BLOCKS_ADMITTED,
    ATTR_BLOCKS_DROPPED,
    ATTR_CALL_ID_PATH,
    ATTR_STREAMS,
    HubConsumer,
    HubStats,
    PublishItem,
    PublishState,
    StreamHub,
)
from kernel_ext.stream.registry import (
    get_default_hub,
    publish,
    publish_chat_event,
    set_default_hub,
)

__all__ = [
    "ATTR_BLOCKS_ADMITTED",
    "ATTR_BLOCKS_DROPPED",
    "ATTR_CALL_ID_PATH",
    "ATTR_STREAMS",
    "UNFLUSHED",
    "HubConsumer",
    "HubStats",
    "Outgoing",
    "OutgoingBlock",
    "OutgoingChatEvent",
    "Progress",
    "PublishItem",
    "PublishState",
    "StreamHub",
    "get_default_hub",
    "publish",
    "publish_chat_event",
    "set_default_hub",
]
