"""Publishing blocks: the stream layer between tool code and the one sender.

Tool code (and the A2A adapter) calls :func:`publish`; a :class:`StreamHub` attributes each
block to its tool call, applies the per-stream rules (sequencing, the T4 throttle, exactly
one terminal per stream, the call's end) and queues what passes; the one sender takes it
through :meth:`StreamHub.consumer`. The modules, downhill:

* :mod:`.counts` — the three words (admitted, delivered, dropped by reason) and their totals;
* :mod:`.consumer` — queue items, building their wire form, :class:`HubConsumer`;
* :mod:`.hub` — :class:`StreamHub`, the rules (its docstring lists every guarantee);
* :mod:`.registry` — the process-wide hub and :func:`publish`.
"""

from __future__ import annotations

from kernel_ext.stream.consumer import HubConsumer, Outgoing, OutgoingBlock, OutgoingChatEvent
from kernel_ext.stream.counts import UNFLUSHED
from kernel_ext.stream.hub import (
    ATTR_BLOCKS_ADMITTED,
    ATTR_BLOCKS_DROPPED,
    ATTR_CALL_ID_PATH,
    ATTR_STREAMS,
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
    "PublishItem",
    "PublishState",
    "StreamHub",
    "get_default_hub",
    "publish",
    "publish_chat_event",
    "set_default_hub",
]
