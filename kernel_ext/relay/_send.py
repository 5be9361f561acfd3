"""Emitting to the browsers of one room on this process, without a task per browser.

:func:`send_local` is what python-socketio's ``AsyncManager.emit`` does for an emit
without a callback: the packet encoded once by the server's packet class, one Engine.IO
message queued to each participant's connection in turn. It leaves out the task per
browser and the wait on them: with them every emit took a trip through the event loop, so
each block of a frame waited for the one before, and a frame's parsed blocks stayed alive
across garbage collections (docs/operations.md, "Where it saturates first", has the
figures at 5,000 browsers on one web process).

Nothing in it suspends while the connections are alive: Engine.IO's queue per connection
is unbounded, so the blocks of a room go into each browser's queue in the order they were
sent, in the step that picked the browsers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any

from socketio.async_manager import AsyncManager

from kernel_ext._shared import compat as _compat

__all__ = ["event_text", "local_sends", "send_local"]

_MARK = "kx-block-goes-here"
_message_packet, _encode_event = _compat.packet_makers()


def local_sends(manager: Any) -> bool:
    """Whether :func:`send_local` does what ``emit`` would do with ``manager``: only for the
    in-process manager itself. A manager of another class keeps its own ``emit``."""
    return manager.__class__ is AsyncManager


async def send_local(
    server: Any,
    namespace: str,
    event: str,
    data: Any,
    room: Any,
    skip: Collection[str] | None = None,
) -> int:
    """Emit ``event`` with ``data`` (as ``emit``: a tuple is several arguments, ``None``
    none) to the browsers of ``room`` (a room, a
    sid, or ``None`` for every connection of ``namespace``) on this process but those in
    ``skip``; how many it went to. A connection gone meanwhile is skipped by Engine.IO, as
    for ``emit``."""
    targets = [
        eio_sid
        for sid, eio_sid in server.manager.get_participants(namespace, room)
        if not skip or sid not in skip
    ]
    if not targets:
        return 0
    # As emit: a tuple is several arguments, None none.
    args = list(data) if isinstance(data, tuple) else [] if data is None else [data]
    encoded = _encode_event(server, namespace, [event, *args])
    eio = server.eio
    send = _compat.send_packet
    if not isinstance(encoded, list):
        packet = _message_packet(encoded)
        for eio_sid in targets:
            await send(eio, eio_sid, packet)
        return len(targets)
    packets = [_message_packet(part) for part in encoded]  # binary attachments
    for eio_sid in targets:
        for packet in packets:
            await send(eio, eio_sid, packet)
    return len(targets)


def event_text(server: Any, namespace: str, event: str) -> Callable[[bytes], str]:
    """A maker of the text of the Socket.IO packet of ``event`` in ``namespace`` with one
    argument, given as its compact JSON (UTF-8): what the server's packet class encodes for
    ``emit(event, data)``, made without parsing or encoding ``data`` again."""
    template = _encode_event(server, namespace, [event, _MARK])
    assert isinstance(template, str), template  # no binary attachment
    head, tail = template.split(server.packet_class.json.dumps(_MARK), 1)

    def text(data: bytes) -> str:
        if data.isascii():
            return head + data.decode("ascii") + tail
        # As emit encodes it (non-ASCII escaped: a lone surrogate cannot be sent raw).
        block = json.loads(data.decode("utf-8", "surrogatepass"))
        encoded = _encode_event(server, namespace, [event, block])
        assert isinstance(encoded, str), encoded  # no binary attachment
        return encoded

    return text
