"""The web-process side: the ``/chat`` relay from internal senders to browsers' rooms.

Every public name (``__all__``) is importable from here, each module loaded on first use.
Each module has one job, and imports only the ones above it in this list (none imports the
worker side: ``stream``, ``emit``, ``worker``):

=====================  ===================================================================
``_log``               the package's one logger (``kernel_ext.relay``), rare log, frames metric
``workers``            which streams each worker has open; ending a gone worker's streams
``emitted_terminals``  the terminals this relay emitted: a re-send not shown twice, late
                       joiners of an empty room still served
``replay``             what the relay keeps of each conversation's streams for catch-up
``frames``             a frame, a block, a chat event, a join: parsed and checked, no I/O
``ordering``           one internal connection's jobs, emitted in arrival order
``_send``              emitting to one room's browsers on this process, no task per browser
``auth``               who connects: the internal secret and worker id, the browsers' hooks
``limits``             :class:`~kernel_ext.relay.limits.Admission`: browsers per process and
                       per identity, conversations and joins per second per browser
``guarded``            hostile packets: event-name and arity checks, the library log filter,
                       :func:`with_packet_guard` for frames below Socket.IO
``delivery``           how a block reaches a room's browsers, supplied by the server's client
                       manager (in process, python-socketio's pub/sub, or the Redis manager's
                       own); the one place catch-up memory is filled
``health``             :class:`Readiness`, :func:`with_probes`: ``/healthz`` and ``/readyz``
``turnstile``          new connections' handshakes a few at a time, a bounded queue, ``503``
``backpressure``       what each browser may hold (packets, bytes), paced acknowledgements,
                       the catch-up bytes in flight in all
``catch_up``           a join's catch-up: sent as the browser reads, within its budget

``gone_workers``       a connected worker gone past its grace: its open streams ended
``joins``              a browser's entry into a room: caught up, or served late terminals
``outbound``           what goes out to the rooms: a frame's blocks past the checks, within
                       back-pressure, by the delivery; chat events; ``aborted`` blocks
``relay_settings``     :class:`~kernel_ext.relay.relay_settings.RelaySettings`: every option,
                       by part, with its defaults
``stops``              a browser's ``stop_call``: who may stop what, its rate, the answer of
                       the worker that owns the call (here, or through the delivery)
``namespace``          :class:`ChatRelay`: receives the events and hands each to its part
``app``                :func:`mount_relay`, :func:`create_app`, :class:`RelayApp`; picks the
                       server's client manager
=====================  ===================================================================

``kernel-ext relay`` (= ``python -m kernel_ext.relay``, :func:`main`) is the command line's:
:mod:`kernel_ext.cli.relay`.

:class:`RelayRedisManager` is importable from here; its home is :mod:`kernel_ext.redis`
(everything that speaks Redis), which only ``app`` imports (the namespace never asks which
manager its server has: ``delivery``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernel_ext._shared.lazy import module_getattr
from kernel_ext.protocol import (
    CHAT_EVENT,
    JOIN_EVENT,
    KX_BLOCKS,
    KX_CHAT_EVENT,
    LEAVE_EVENT,
    TOOL_EVENT_STREAM,
)

if TYPE_CHECKING:
    from kernel_ext.cli.relay import is_loopback_host, main
    from kernel_ext.redis.manager import RelayRedisManager
    from kernel_ext.relay.app import RelayApp, create_app, mount_relay
    from kernel_ext.relay.auth import BrowserAuth, JoinAuth, allow_all
    from kernel_ext.relay.guarded import with_packet_guard
    from kernel_ext.relay.health import Readiness, with_probes
    from kernel_ext.relay.namespace import ChatRelay
    from kernel_ext.relay.workers import DEFAULT_WORKER_GRACE, WORKER_GONE_MESSAGE

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
    "Readiness",
    "RelayApp",
    "RelayRedisManager",
    "allow_all",
    "create_app",
    "is_loopback_host",
    "main",
    "mount_relay",
    "with_packet_guard",
    "with_probes",
]

# Every other name loads its module on first use (PEP 562): importing the package, as the
# ``kernel-ext`` command does for ``kernel-ext relay``'s options, loads no Socket.IO.
_LAZY = {
    "RelayApp": "app",
    "create_app": "app",
    "mount_relay": "app",
    "BrowserAuth": "auth",
    "JoinAuth": "auth",
    "allow_all": "auth",
    "is_loopback_host": "kernel_ext.cli.relay",
    "main": "kernel_ext.cli.relay",
    "with_packet_guard": "guarded",
    "Readiness": "health",
    "with_probes": "health",
    "ChatRelay": "namespace",
    "RelayRedisManager": "kernel_ext.redis.manager",
    "DEFAULT_WORKER_GRACE": "workers",
    "WORKER_GONE_MESSAGE": "workers",
}


__getattr__ = module_getattr(
    __name__,
    {name: home if "." in home else f"{__name__}.{home}" for name, home in _LAZY.items()},
)


def __dir__() -> list[str]:
    return sorted(__all__)
