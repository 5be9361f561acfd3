"""A2A stream → ``tool_event_stream`` blocks, and the ready ``ask_colleague`` tool helper.

Needs the ``a2a`` extra (``pip install 'kernel-ext[a2a]'``, a2a-sdk 1.x). How a peer puts
its envelopes into A2A messages, and how states map to blocks: docs/a2a.md.

:class:`A2AStreamAdapter` turns the events of one ``client.send_message(...)`` stream into
``publish`` calls: ``working`` updates → ``running`` blocks (the peer's envelopes, else its
text); ``completed`` → ``done``; ``failed``, ``canceled``, ``rejected`` → ``aborted``;
``input-required`` and ``auth-required`` keep the stream open with a provisional terminal;
a direct ``message`` reply → ``done``.

Guarantees:

* Each A2A task is a stream of its own and gets one terminal; anything for it afterwards is
  ignored and counted.
* A malformed envelope is never passed on: it is degraded to the message's text, else
  dropped and counted (``invalid_envelope``). Once a task sent a valid envelope its seq
  numbers are the peer's, never mixed with the hub's.
* :func:`ask_colleague` / :func:`stream_colleague` run a real client with timeouts that
  suit slow colleagues; whatever happens, each stream gets exactly one terminal.

Modules: :mod:`kernel_ext.a2a.adapter` (the adapter) and :mod:`kernel_ext.a2a.colleague`
(the ``ask_colleague`` helper). Design: docs/contracts.md, "The A2A adapter".
"""

from __future__ import annotations

from kernel_ext.a2a.adapter import (
    A2AStreamAdapter,
    AdapterStats,
    ColleagueReply,
    Publisher,
    ReplyState,
    integral_floats_to_ints,
)
from kernel_ext.a2a.colleague import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_TIMEOUT,
    ask_colleague,
    colleague_http_client,
    stream_colleague,
)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "A2AStreamAdapter",
    "AdapterStats",
    "ColleagueReply",
    "Publisher",
    "ReplyState",
    "ask_colleague",
    "colleague_http_client",
    "integral_floats_to_ints",
    "stream_colleague",
]
