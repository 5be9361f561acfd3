"""A2A stream → ``tool_event_stream`` blocks, and the ready ``ask_colleague`` tool helper.

Needs the ``a2a`` extra (``pip install 'kernel-ext[a2a]'``, a2a-sdk 1.x). How a peer puts
its envelopes into A2A messages, and how states map to blocks: docs/a2a.md.

:class:`A2AStreamAdapter` turns the events of one ``client.send_message(...)`` stream into
``publish`` calls (the signature of ``kernel_ext.stream.publish``, docs/contracts.md):

* ``working`` status update whose message holds envelope objects in data parts → one
  ``running`` block per valid envelope, passed through unchanged except that integral
  floats (A2A carries every number as a double) come back as integers, recursively;
* ``working`` update with text only (a third-party peer) → ``running`` with the text,
  which ``publish`` wraps in a pseudo-envelope with its own per-stream seq;
* a malformed envelope → degraded to a pseudo-envelope of the message's text if there is
  any, else dropped and counted (metric ``kernel_ext.blocks`` reason
  ``invalid_envelope``); logged (WARNING once per task, then DEBUG);
* once a task has sent a valid envelope, its seq numbers are the peer's: a later update
  without a valid envelope is not shown as text (its seq from the hub's counter would
  collide with the peer's); a malformed envelope in it is dropped and counted;
* ``completed`` → one ``done`` block; its text is the status message's text parts, or,
  when those are empty, the text of the task's artifacts (in order of first appearance);
  ``failed``, ``canceled``, ``rejected`` → one ``aborted`` block with the colleague's
  message (or a default);
* ``input-required`` and ``auth-required`` are not terminal in A2A: the question's message
  is shown like a ``working`` one (its envelopes, else its text as a running block) and the
  stream stays open with a *provisional* terminal (``publish(..., provisional=True)``):
  ``done`` with the question (``aborted`` with the message for ``auth-required``). A
  follow-up in the same tool call (same task id) continues the stream and ends it with its
  own terminal; if the call ends first (the tool returned the question to the model), the
  provisional terminal ends it;
* a direct ``message`` reply (no task) → one ``done`` block with its text;
* artifact updates are collected for the final answer; v1 emits no blocks for them;
* anything for a task after its terminal is ignored (and counted);
* each A2A task keeps its own taskId, so a follow-up task under the same call is its own
  stream; a terminal before any task exists (connection refused) goes out with
  ``task_id=None``, which ``publish`` turns into the callId (a local block).

:func:`ask_colleague` / :func:`stream_colleague` wrap the adapter around a real client
with timeouts that suit slow colleagues: no read timeout on the SSE stream by default
(a2a's own 5 s default cuts slow colleagues off), a connect timeout, an optional idle
timeout and an overall deadline. Whatever happens, each stream gets exactly one terminal.
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
