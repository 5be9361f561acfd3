"""What the terminal commands ``kernel-ext tail`` and ``kernel-ext stop`` share: what they print
and how they connect to the ``/chat`` relay, as a browser.

* :func:`clean` — peer text made safe for a terminal (control characters and bidirectional
  overrides as visible escapes); :func:`shown` — a value quoted in a message.
* :func:`add_connection_arguments` — the options both take: ``--url``, ``--conversation``,
  ``--token`` (sent as ``auth={"token": T}``), ``--namespace``, ``--timeout``.
* :class:`RelayClient` — a Socket.IO client that connects once, saying in one line on stderr
  why it could not (the relay refused it: exit 1; no relay can be reached at the URL: exit 2,
  the host that does not resolve, the port nobody listens on, the host that does not answer,
  the server that is no relay), and that writes its messages as ``<prog>: <message>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import socket
import sys
from collections.abc import Awaitable, Mapping
from typing import Any, TextIO
from urllib.parse import urlsplit

from kernel_ext.cli._common import (
    EXIT_FAILED,
    EXIT_USAGE,
    http_url,
    never_resolves,
    positive_seconds,
)
from kernel_ext.protocol import MAX_CONVERSATION_ID_CHARS, NAMESPACE

__all__ = [
    "RelayClient",
    "add_connection_arguments",
    "clean",
    "conversation_id",
    "error_of",
    "ok",
    "quietly",
    "shown",
]

# C0 controls but tab and newline, DEL, C1 controls, bidi embeddings/overrides/isolates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SHOWN_CHARS = 40


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(text: str) -> str:
    """``text`` with every character that could steer a terminal shown as a visible escape
    (``\\x1b``, ``\\x0d``, ``\\u202e`` …); tabs and newlines are kept."""
    return _UNSAFE.sub(_escape, text)


def shown(value: str) -> str:
    """``value`` as a message quotes it: ``repr`` (escapes, lone surrogates as ``\\udcff``),
    cut after 40 characters with its length said."""
    if len(value) <= _SHOWN_CHARS:
        return repr(value)
    return f"{value[:_SHOWN_CHARS]!r}… ({len(value):,} characters)"


def conversation_id(value: str) -> str:
    """A conversation id as the relay takes it: not blank, at most
    :data:`~kernel_ext.protocol.MAX_CONVERSATION_ID_CHARS` characters, no lone surrogate (a
    byte the terminal's encoding could not decode)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must be a conversation id, got an empty string")
    if len(value) > MAX_CONVERSATION_ID_CHARS:
        raise argparse.ArgumentTypeError(
            f"must be a conversation id of at most {MAX_CONVERSATION_ID_CHARS} characters, "
            f"got {shown(value)}"
        )
    if _SURROGATE.search(value):
        raise argparse.ArgumentTypeError(
            f"holds bytes that are not text in this terminal's encoding: {shown(value)}"
        )
    return value


def add_connection_arguments(parser: argparse.ArgumentParser, timeout_help: str) -> None:
    """Add the options of the connection to the relay to ``parser``; ``timeout_help`` says
    what ``--timeout`` bounds."""
    parser.add_argument(
        "--url",
        required=True,
        type=http_url,
        help="the relay's base URL, e.g. http://127.0.0.1:8765 (required)",
    )
    parser.add_argument(
        "--conversation",
        required=True,
        type=conversation_id,
        help="the conversation id, the room to join (required)",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="sent as auth {'token': TOKEN} on connect (default: none, no auth)",
    )
    parser.add_argument(
        "--namespace", default=NAMESPACE, help="Socket.IO namespace (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=10.0,
        metavar="S",
        help=f"{timeout_help} (default: %(default)g)",
    )


class RelayClient:
    """One command's Socket.IO client of the relay (namespace ``namespace`` at ``url``).

    :meth:`connect` connects once, or says why not and returns the exit status;
    :meth:`close` disconnects. ``reconnect``: whether a dropped connection is retried (the
    client's own reconnection, 1 s doubling to 5 s). SIGINT is left to the command.
    """

    def __init__(
        self,
        prog: str,
        url: str,
        *,
        namespace: str = NAMESPACE,
        timeout: float = 10.0,
        err: TextIO | None = None,
        reconnect: bool = True,
    ) -> None:
        import socketio

        self.prog = prog
        self.url = url
        self.namespace = namespace
        self.timeout = timeout
        self.err = err if err is not None else sys.stderr
        # handle_sigint=False: SIGINT is ours (a clean exit), not engineio's cancel-everything.
        self.sio = socketio.AsyncClient(
            reconnection=reconnect, reconnection_delay_max=5, handle_sigint=False
        )
        self.refused: list[Any] = []
        self.sio.on("connect_error", self.on_connect_error, namespace=namespace)

    def on_connect_error(self, data: Any = None) -> None:
        self.refused.append(data)

    def say(self, message: str) -> None:
        """Write ``<prog>: <message>`` on stderr (nothing if stderr is closed)."""
        try:
            self.err.write(f"{self.prog}: {message}\n")
            self.err.flush()
        except (BrokenPipeError, ValueError):
            pass

    async def connect(self, token: str | None) -> int | None:
        """Connect; ``None``, else the exit status (the reason said)."""
        import socketio

        host = urlsplit(self.url).hostname or ""
        if never_resolves(host):
            reason = f"the host name {host!r} does not resolve (no name under .invalid does)"
            self.say(f"cannot connect to {self.url}: {reason}")
            return EXIT_USAGE
        try:
            await self.sio.connect(
                self.url,
                namespaces=[self.namespace],
                auth={"token": token} if token is not None else None,
                wait_timeout=self.timeout,
                retry=False,
            )
        except socketio.exceptions.ConnectionError as exc:
            if self.refused and isinstance(self.refused[-1], Mapping):  # the server said no
                reason = _refusal_of(self.refused[-1])
                hint = " (check --token)" if "auth" in reason.lower() else ""
                self.say(f"the relay at {self.url} refused the connection: {reason}{hint}")
                return EXIT_FAILED
            why = await _why_unreachable(self.url, self.timeout, exc)
            self.say(f"cannot connect to {self.url}: {why}")
            return EXIT_USAGE
        return None

    async def close(self) -> None:
        """Disconnect (within :attr:`timeout`; never raises)."""
        await quietly(self.sio.disconnect(), self.timeout)


async def _why_unreachable(url: str, timeout: float, error: Exception) -> str:
    """Why a Socket.IO connection to ``url`` failed, in words a person can act on: a plain
    TCP connection to its host and port tells a name that does not resolve, a port nobody
    listens on and a host that does not answer apart from a server that is no relay.
    (The Socket.IO client's own message is aiohttp's, ``… ssl:default [Connect call
    failed …]`` even for plain http.)"""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
    except ValueError:
        return f"{url!r} has no usable port"
    where = f"{host}:{port}"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except socket.gaierror as exc:
        return f"the host name {host!r} does not resolve ({exc.strerror})"
    except ConnectionRefusedError:
        return f"nothing is listening on {where} (connection refused)"
    except (asyncio.TimeoutError, TimeoutError):
        return f"{where} did not answer within {timeout:g} s"
    except OSError as exc:
        return f"{where} cannot be reached ({exc.strerror or exc})"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    detail = clean(str(error) or type(error).__name__)
    return f"{where} answers, but not as a Socket.IO relay at this URL ({detail})"


def ok(ack: Any) -> bool:
    """Whether a join's acknowledgement accepted it."""
    return isinstance(ack, Mapping) and ack.get("ok") is True


def error_of(ack: Any) -> str:
    """Why a join was refused, from its acknowledgement (escaped)."""
    if isinstance(ack, Mapping) and isinstance(ack.get("error"), str):
        return clean(ack["error"])
    return f"unexpected acknowledgement {clean(repr(ack))[:200]}"


def _refusal_of(data: Any) -> str:
    if isinstance(data, Mapping) and isinstance(data.get("message"), str):
        return clean(data["message"])
    if isinstance(data, str):
        return clean(data)
    return "no reason given"


async def quietly(awaitable: Awaitable[Any], timeout: float) -> None:
    """Await ``awaitable`` for at most ``timeout`` seconds, ignoring how it ends."""
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(awaitable, timeout)
