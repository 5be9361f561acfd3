"""Senders: take what a :class:`~kernel_ext.stream.StreamHub` lets through and deliver it.

* :class:`LoopbackEmitter` (:mod:`kernel_ext.emit.loopback`) — a python-socketio
  ``AsyncClient`` on the web process's ``/chat`` namespace (internal credential), batching
  blocks into ``kx_blocks`` frames.
* :class:`RedisEmitter` (its home is :mod:`kernel_ext.redis.emitter`, with everything else
  that speaks Redis; importable from here, loaded on first use) — python-socketio's
  write-only ``AsyncRedisManager``: emits ``tool_event_stream`` into the room through
  Redis, with no web process on this machine.

Both build on :class:`Emitter` (:mod:`kernel_ext.emit.base`: the send task, stop and flush,
the one counting-and-health mechanism) and owe their terminals through
:mod:`kernel_ext.emit.owed_terminals` (held within bounds, degraded when refused). A sender for
tests, ``MemoryEmitter``, is in :mod:`kernel_ext.testing`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernel_ext._shared.lazy import module_getattr
from kernel_ext.emit.base import DEFAULT_NAMESPACE, Emitter
from kernel_ext.emit.loopback import LoopbackEmitter
from kernel_ext.protocol import CHAT_EVENT, KX_BLOCKS, KX_CHAT_EVENT, TOOL_EVENT_STREAM

__all__ = [
    "CHAT_EVENT",
    "DEFAULT_NAMESPACE",
    "KX_BLOCKS",
    "KX_CHAT_EVENT",
    "TOOL_EVENT_STREAM",
    "Emitter",
    "LoopbackEmitter",
    "RedisEmitter",
]

if TYPE_CHECKING:
    from kernel_ext.redis.emitter import RedisEmitter

# kernel_ext.redis.emitter builds on kernel_ext.emit.base: loaded on first use, so that
# importing either package first works (PEP 562).
__getattr__ = module_getattr(__name__, {"RedisEmitter": "kernel_ext.redis.emitter"})
