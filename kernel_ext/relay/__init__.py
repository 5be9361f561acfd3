"""The web-process side: the ``/chat`` relay from internal senders to browsers' rooms.

Every public name (``__all__``) is importable from here. Each module has one job, and
imports only the ones above it in this list (none imports the worker side: ``stream``,
``emit``, ``plugin``):

=================  =======================================================================
``_log``           the package's one logger (``kernel_ext.relay``), rare log, frames metric
``workers``        which streams each worker has open; ending a gone worker's streams
``terminals``      terminals emitted: a re-send not shown twice, late joiners still served
``auth``           who connects: the internal secret and worker id, the browsers' hooks
``hostile``        hostile packets: event-name and arity checks, the library log filter
``redis``          :class:`RelayRedisManager`: terminals published again after a Redis
                   outage, write-only workers' streams ended when they are gone
``namespace``      :class:`ChatRelay`: connections, joins, ``kx_blocks``/``kx_chat_event``
``app``            :func:`mount_relay`, :func:`create_app`, :class:`RelayApp`
``command``        ``python -m kernel_ext.relay`` (:func:`main`), loaded on first use
=================  =======================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kernel_ext.protocol import (
    CHAT_EVENT,
    JOIN_EVENT,
    KX_BLOCKS,
    KX_CHAT_EVENT,
    LEAVE_EVENT,
    TOOL_EVENT_STREAM,
)
from kernel_ext.relay.app import RelayApp, create_app, mount_relay
from kernel_ext.relay.auth import BrowserAuth, JoinAuth, allow_all
from kernel_ext.relay.namespace import ChatRelay
from kernel_ext.relay.redis import RelayRedisManager
from kernel_ext.relay.workers import DEFAULT_WORKER_GRACE, WORKER_GONE_MESSAGE

if TYPE_CHECKING:
    from kernel_ext.relay.command import is_loopback_host, main

__all__ = [
    "CHAT_EVENT",
    "DEFAULT_WORKER_GRACE",
    "JOIN_EVENT",
    "KX_BLOCKS",
    "KX_CHAT_EVENT",
    "LEAVE_EVENT",
    "TOOL_EVENT_STREAM",
    "WORKER_GONE_MESSAGE",
    "BrowserAuth",
    "ChatRelay",
    "JoinAuth",
    "RelayApp",
    "RelayRedisManager",
    "allow_all",
    "create_app",
    "is_loopback_host",
    "main",
    "mount_relay",
]

# The command's names load its module (argparse, the settings) on first use only.
_COMMAND_NAMES = frozenset({"is_loopback_host", "main"})


def __getattr__(name: str) -> Any:
    if name in _COMMAND_NAMES:
        from kernel_ext.relay import command

        return getattr(command, name)
    raise AttributeError(f"module 'kernel_ext.relay' has no attribute {name!r}")
