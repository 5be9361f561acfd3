"""``kernel-ext stop``: ask the relay to stop one running tool call, as a pane's stop button does.

It connects to the ``/chat`` relay as ``kernel-ext tail`` does (the same ``--url``,
``--conversation``, ``--token``, ``--namespace`` and ``--timeout``:
:mod:`kernel_ext.viewing.terminal`), joins the conversation's room — the relay lets only a
browser in a call's room stop it — sends one ``stop_call``
``{"v": 1, "room": <conversation>, "callId": <call id>}`` and prints the relay's answer
(:data:`~kernel_ext.protocol.STOP_ANSWERS`) in one line on stdout::

    stopping 00f067aa0ba902b7: Stopping…
    already_ended 00f067aa0ba902b7: The call had already ended

the answer, the callId, the pane's words for it (``--lang``) and the relay's reason, if it
gave one, in parentheses. Anything else goes to stderr in one line, ``kernel-ext stop: …``.

Exit codes (:data:`EXIT_CODES`): 0 ``stopping`` or ``already_ended``; 1 ``refused``, or the
relay refused the connection or the join; 2 a command line that cannot be used (a
``--call-id`` that is not 16 lower-case hex digits, a conversation id over 512 characters
or not text, a ``--url`` where no relay can be reached); 3 ``unknown``; 4 ``unreachable``; 5
no usable answer (none within ``--timeout``, the connection lost, or one that is not
``{"answer": <one of the answers>}``); 130 after Ctrl-C, 143 after SIGTERM.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from kernel_ext.cli._common import EXIT_FAILED, EXIT_OK, run_until_stopped
from kernel_ext.protocol import (
    CALL_ID_PATTERN,
    JOIN_EVENT,
    NAMESPACE,
    STOP_ANSWERS,
    STOP_EVENT,
    well_formed,
)
from kernel_ext.viewing.terminal import (
    RelayClient,
    add_connection_arguments,
    clean,
    error_of,
    ok,
    shown,
)
from kernel_ext.viewing.view import labels_for

__all__ = [
    "EXIT_CODES",
    "EXIT_NO_ANSWER",
    "EXIT_UNKNOWN",
    "EXIT_UNREACHABLE",
    "add_arguments",
    "answer_line",
    "call_id",
    "read_answer",
    "run",
    "stop_call",
]

PROG = "kernel-ext stop"
EXIT_UNKNOWN = 3
EXIT_UNREACHABLE = 4
EXIT_NO_ANSWER = 5
EXIT_CODES: Mapping[str, int] = {
    "stopping": EXIT_OK,
    "already_ended": EXIT_OK,
    "refused": EXIT_FAILED,
    "unknown": EXIT_UNKNOWN,
    "unreachable": EXIT_UNREACHABLE,
}
"""The exit code of each answer (:data:`~kernel_ext.protocol.STOP_ANSWERS`)."""
_WORDS = {
    "stopping": "stopping",
    "already_ended": "stopAlreadyEnded",
    "unknown": "stopUnknown",
    "refused": "stopRefused",
    "unreachable": "stopUnreachable",
}
"""The label (:data:`kernel_ext.viewing.view.LABELS`) of each answer: the pane's words."""
MAX_REASON_CHARS = 200
"""The longest reason printed, in characters (then ``…``), as a pane shows it."""
_CALL_ID = re.compile(CALL_ID_PATTERN)


def call_id(value: str) -> str:
    """A call id: the call's span id, 16 lower-case hex digits (the protocol's rule)."""
    if not _CALL_ID.fullmatch(value):
        raise argparse.ArgumentTypeError(
            "must be a call id, the 16 lower-case hex digits a pane shows (the call's span "
            f"id), got {shown(value)}"
        )
    return value


def read_answer(ack: Any) -> tuple[str, str | None] | None:
    """A ``stop_call`` acknowledgement as received: ``(answer, reason)`` — the reason a
    non-empty string or ``None`` — or ``None`` when it is not ``{"answer": <one of
    STOP_ANSWERS>}``."""
    answer = ack.get("answer") if isinstance(ack, Mapping) else None
    if not isinstance(answer, str) or answer not in STOP_ANSWERS:
        return None
    reason = ack.get("reason")
    return answer, reason if isinstance(reason, str) and reason else None


def answer_line(call: str, answer: str, reason: str | None, locale: str = "zh") -> str:
    """The line printed for ``answer``: ``<answer> <callId>: <words>[ (<reason>)]``, every
    character that could steer a terminal escaped."""
    colon = ": " if locale == "en" else "："
    line = f"{answer} {call}{colon}{labels_for(locale)[_WORDS[answer]]}"
    if reason is not None:
        cut = f"{reason[:MAX_REASON_CHARS]}…" if len(reason) > MAX_REASON_CHARS else reason
        line += f" ({cut})"
    return well_formed(clean(" ".join(line.split("\n"))))


async def stop_call(
    url: str,
    conversation_id: str,
    call: str,
    *,
    token: str | None = None,
    namespace: str = NAMESPACE,
    timeout: float = 10.0,
    locale: str = "zh",
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Ask the relay at ``url`` to stop call ``call`` of ``conversation_id``; print the
    answer on ``out`` and return its exit code (see the module's)."""
    import socketio

    out = out if out is not None else sys.stdout
    client = RelayClient(PROG, url, namespace=namespace, timeout=timeout, err=err, reconnect=False)
    try:
        failed = await client.connect(token)
        if failed is not None:
            return failed
        event = JOIN_EVENT
        try:
            join = {"conversationId": conversation_id}
            ack = await client.sio.call(event, join, namespace=namespace, timeout=timeout)
            if not ok(ack):
                client.say(
                    f"joining conversation {shown(conversation_id)} was refused: {error_of(ack)}"
                )
                return EXIT_FAILED
            event = STOP_EVENT
            request = {"v": 1, "room": conversation_id, "callId": call}
            ack = await client.sio.call(event, request, namespace=namespace, timeout=timeout)
        except socketio.exceptions.TimeoutError:
            client.say(f"the relay did not answer {event} within {timeout:g} s")
            return EXIT_NO_ANSWER
        except socketio.exceptions.SocketIOError as exc:
            detail = clean(str(exc) or type(exc).__name__)
            client.say(
                f"the connection to the relay was lost before it answered {event} ({detail})"
            )
            return EXIT_NO_ANSWER
        read = read_answer(ack)
        if read is None:
            choices = ", ".join(STOP_ANSWERS)
            client.say(
                f"the relay's answer to {STOP_EVENT} is not one of {choices}: "
                f"{well_formed(clean(repr(ack)))[:200]}"
            )
            return EXIT_NO_ANSWER
        answer, reason = read
        try:
            out.write(answer_line(call, answer, reason, locale) + "\n")
            out.flush()
        except (BrokenPipeError, ValueError):
            pass
        return EXIT_CODES[answer]
    finally:
        await client.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``stop``'s options to ``parser``."""
    add_connection_arguments(parser, "seconds to connect, to join and for the answer")
    parser.add_argument(
        "--call-id",
        required=True,
        type=call_id,
        help="the call to stop: its callId, 16 lower-case hex digits (required)",
    )
    parser.add_argument(
        "--lang", choices=("zh", "en"), default="zh", help="labels (default: %(default)s)"
    )


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``kernel-ext stop`` with parsed ``args``; returns the exit code. A stop signal
    ends it as every command's does (:func:`kernel_ext.cli._common.run_until_stopped`)."""
    return run_until_stopped(
        stop_call(
            args.url,
            args.conversation,
            args.call_id,
            token=args.token,
            namespace=args.namespace,
            timeout=args.timeout,
            locale=args.lang,
            out=out,
            err=err,
        )
    )
