"""What every ``kernel-ext`` command shares: one-line argument errors, option types, the
listening socket, exit codes.

* :class:`Parser` reports a bad command line as one line on stderr,
  ``<prog>: error: <what>``, and exits with :data:`EXIT_USAGE` (2) — never a usage block,
  never a traceback. Commands report a value they refuse later (a host that does not
  resolve, a port in use) the same way, through :func:`usage_error`.
* Option types (:func:`port`, :func:`seconds` …) refuse a bad value with a message that
  names the rule.
* :func:`listen` opens the one listening socket of a server command, or says in one line
  why it cannot (the host does not resolve, is not this machine's, the port is in use or
  needs privileges).
* Exit codes: 0 done, 1 failed, 2 a bad command line, ``128 + n`` after signal ``n``
  (:func:`exit_code_after` — 130 after SIGINT, 143 after SIGTERM).
"""

from __future__ import annotations

import argparse
import errno
import math
import signal
import socket
import sys
from typing import NoReturn, TextIO
from urllib.parse import urlsplit

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "CommandLineError",
    "Parser",
    "exit_code_after",
    "http_url",
    "listen",
    "never_resolves",
    "port",
    "port_or_zero",
    "positive_seconds",
    "seconds",
    "url_host",
    "usage_error",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
"""The signals a command stops on cleanly (with :func:`exit_code_after`)."""


def exit_code_after(signum: int) -> int:
    """The exit code of a command stopped by signal ``signum``: ``128 + signum``, as a shell
    reports a process the signal ended (130 after SIGINT, 143 after SIGTERM)."""
    return 128 + int(signum)


class CommandLineError(Exception):
    """A value on the command line that cannot be used; the message says why, in one line."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2.

    argparse prints the usage block before the error; a person then has to find the one line
    that matters. Here it is the only line, with a pointer to ``--help``.
    """

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, f"{message} (see {self.prog} --help)")


def usage_error(prog: str, message: str, err: TextIO | None = None) -> NoReturn:
    """Write ``<prog>: error: <message>`` as one line and exit with :data:`EXIT_USAGE`."""
    stream = err if err is not None else sys.stderr
    one_line = " ".join(message.split())
    stream.write(f"{prog}: error: {one_line}\n")
    stream.flush()
    raise SystemExit(EXIT_USAGE)


# -- option types ----------------------------------------------------------------------------


def _integer(value: str, what: str) -> int:
    try:
        return int(value, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}, got {value!r}") from None


def port(value: str) -> int:
    """A TCP port to serve on: 1–65535."""
    number = _integer(value, "must be a port number from 1 to 65535")
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {value!r}")
    return number


def port_or_zero(value: str) -> int:
    """A TCP port to serve on, or 0 for any free one: 0–65535."""
    number = _integer(value, "must be a port number from 0 (any free port) to 65535")
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be a port number from 0 (any free port) to 65535, got {value!r}"
        )
    return number


def _number(value: str, rule: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{rule}, got {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{rule}, got {value!r}")
    return number


def seconds(value: str) -> float:
    """A number of seconds, zero or more."""
    rule = "must be a number of seconds, 0 or more"
    number = _number(value, rule)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{rule}, got {value!r}")
    return number


def positive_seconds(value: str) -> float:
    """A number of seconds greater than zero."""
    rule = "must be a number of seconds greater than 0"
    number = _number(value, rule)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{rule}, got {value!r}")
    return number


def http_url(value: str) -> str:
    """A server's base URL: ``http``/``https`` (or ``ws``/``wss``) with a host."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"is not a URL ({exc}): {value!r}") from None
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:8765, "
            f"got {value!r}"
        )
    return value


# -- the listening socket --------------------------------------------------------------------


def url_host(host: str) -> str:
    """``host`` as it appears in a URL: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def never_resolves(host: str) -> bool:
    """Whether ``host`` is a name under ``invalid.``, which by RFC 6761 (6.4) never resolves:
    the commands say so at once instead of asking a DNS server about it."""
    name = host.rstrip(".").lower()
    return name == "invalid" or name.endswith(".invalid")


def listen(host: str, port_number: int) -> socket.socket:
    """A TCP socket bound to ``host:port_number`` and listening, ready to hand to a server.

    Raises :class:`CommandLineError` saying, in one line, why it cannot be opened: the host
    does not resolve, is not an address of this machine, the port is in use or needs
    privileges.
    """
    if never_resolves(host):
        raise CommandLineError(
            f"--host {host!r} does not resolve to an address (no name under .invalid does)"
        )
    try:
        found = socket.getaddrinfo(
            host or None, port_number, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise CommandLineError(
            f"--host {host!r} does not resolve to an address ({exc.strerror})"
        ) from None
    except (UnicodeError, ValueError) as exc:
        raise CommandLineError(f"--host {host!r} is not a host name ({exc})") from None
    family, kind, proto, _, address = found[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        where = f"{url_host(host)}:{port_number}"
        if exc.errno == errno.EADDRINUSE:
            message = f"port {port_number} on {host} is in use; pick another with --port"
        elif exc.errno == errno.EADDRNOTAVAIL:
            message = f"--host {host} is not an address of this machine"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            message = f"no permission to listen on {where} (ports below 1024 need privileges)"
        else:
            message = f"cannot listen on {where}: {exc.strerror or exc}"
        raise CommandLineError(message) from None
    return sock
