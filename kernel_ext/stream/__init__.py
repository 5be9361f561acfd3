"""Publishing blocks: the stream layer between tool code and the one sender.

Tool code (and the A2A adapter) calls :func:`publish`; a :class:`StreamHub` attributes each
block to its tool call, applies the per-stream rules and queues what passes; the one sender
takes it through :meth:`StreamHub.attach_sender` (:class:`SenderPort`). Modules, downhill:
:mod:`.block_counts`, :mod:`.state`, :mod:`.outgoing` (queue items and their wire form),
:mod:`.hub` (:class:`StreamHub`, which keeps every guarantee below), :mod:`.registry`.

Guarantees of :meth:`StreamHub.publish` (and :func:`kernel_ext.publish`):

* Enqueue-only: never blocks, never raises; callable from the event loop or any thread.
* Attribution by :func:`kernel_ext.attribution.resolve.attribute` (T2); no room → dropped
  (``no_room``); a running block without a callId is not sent, a terminal goes out with
  ``callId: null``.
* A stream is one (callId, taskId); its ``seq`` strictly increases, one numbering for its
  text, progress and nested ``tool_call`` lines.
* T4: at most ``max_running_per_second`` running blocks per stream in any one-second
  window (newest dropped, ``throttled``). Exactly one terminal per stream, never throttled.
* A call's end closes every stream of it; nothing more of that call is sent, also not from
  tasks that outlive it.
* Bounded: ``max_streams``, ``max_queue``, ``max_calls``, ``max_closed_per_call`` and
  ``stream_idle_ttl`` (an idle stream is ended, counted ``expired``).
* With no sender attached, blocks are counted ``no_sender`` and not kept.

Counts: :meth:`StreamHub.stats`. Design: docs/contracts.md, "Publishing".
"""

from __future__ import annotations

from kernel_ext.stream.block_counts import UNFLUSHED
from kernel_ext.stream.hub import (
    ATTR_BLOCKS_ADMITTED,
    ATTR_BLOCKS_DROPPED,
    ATTR_CALL_ID_PATH,
    ATTR_STREAMS,
    HubStats,
    PublishItem,
    PublishState,
    SenderPort,
    StreamHub,
)
from kernel_ext.stream.outgoing import (
    Outgoing,
    OutgoingBlock,
    OutgoingChatEvent,
    Progress,
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
    "HubStats",
    "Outgoing",
    "OutgoingBlock",
    "OutgoingChatEvent",
    "Progress",
    "PublishItem",
    "PublishState",
    "SenderPort",
    "StreamHub",
    "get_default_hub",
    "publish",
    "publish_chat_event",
    "set_default_hub",
]
