"""What every ``kernel-ext`` command shares: one-line argument errors, option types, the
listening socket, exit codes, how a stop signal ends it, the application directory.

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
* Stop signals (:data:`STOP_SIGNALS`: SIGINT, SIGTERM, SIGHUP) are handled one way by every
  command, in every phase (:func:`run_command`, :class:`StopSignals`,
  :func:`on_stop_signal`, :func:`run_until_stopped`): one line on stderr,
  ``<prog>: stopping (SIGINT)``, then exit ``128 + n`` — never a traceback.
* :func:`use_app_dir` puts an application directory first on the import path, as uvicorn's
  ``--app-dir`` does, before a command imports ``module:function`` hooks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from types import FrameType, TracebackType
from typing import Any, NoReturn, TextIO
from urllib.parse import urlsplit

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "STOP_SIGNALS",
    "CommandLineError",
    "Parser",
    "StopSignals",
    "Stopped",
    "exit_code_after",
    "http_url",
    "listen",
    "never_resolves",
    "on_stop_signal",
    "port",
    "port_or_zero",
    "positive_seconds",
    "run_command",
    "run_until_stopped",
    "seconds",
    "url_host",
    "usage_error",
    "use_app_dir",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
"""The signals a command stops on cleanly (:class:`StopSignals`): Ctrl-C, a service
manager's stop, a closed terminal."""


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


# -- the application directory ---------------------------------------------------------------


def use_app_dir(directory: str, option: str = "--app-dir") -> str:
    """Put ``directory`` (relative to the working directory) first on ``sys.path`` and return
    it as an absolute path: ``module:function`` specs are then looked up there before the
    installed packages, as ``python -m`` does with the working directory and uvicorn with
    its ``--app-dir``. Raises :class:`CommandLineError` naming ``option`` when it is not a
    directory."""
    path = os.path.abspath(directory)
    if not os.path.isdir(path):
        raise CommandLineError(f"{option} {directory!r} is not a directory")
    if not sys.path or sys.path[0] != path:
        sys.path.insert(0, path)
    return path


# -- stopping on a signal --------------------------------------------------------------------


class Stopped(KeyboardInterrupt):
    """A stop signal that arrived where no event loop takes it (an import, a blocking call):
    raised where it arrives, as Python raises ``KeyboardInterrupt`` on Ctrl-C, and swallowed
    by :class:`StopSignals`. A ``KeyboardInterrupt``, so that asyncio and every library
    unwind from it as they do from Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_Target = tuple[asyncio.AbstractEventLoop, Callable[[int], object]]

_active: StopSignals | None = None
"""The running command's :class:`StopSignals` (signal handlers are the process's)."""


class StopSignals:
    """How a command stops on a signal, from ``with StopSignals(prog) as stop:`` to its end.

    For each of :data:`STOP_SIGNALS` that is not ignored when the block starts (``nohup``
    keeps SIGHUP ignored), on the main thread (elsewhere nothing changes):

    * the first one writes one line on stderr, ``<prog>: stopping (SIGINT)``, and makes the
      exit code ``128 + n`` (:meth:`exit_code`), whatever the command returns;
    * inside :func:`on_stop_signal`, every one calls that callback on its event loop (a
      graceful stop); anywhere else the first one raises :class:`Stopped` where it arrives
      (later ones are ignored while the command unwinds), and the block swallows it, as it
      swallows a ``KeyboardInterrupt`` (taken for SIGINT);
    * the handlers in place before are put back when the block ends.
    """

    def __init__(self, prog: str, err: TextIO | None = None) -> None:
        self.prog = prog
        self.signum: int | None = None
        """The first stop signal that arrived (``None``: none yet)."""
        self._err = err
        self._said = False
        self._target: _Target | None = None
        self._previous: dict[int, Any] = {}
        self._outer: StopSignals | None = None

    def exit_code(self, code: int) -> int:
        """``code``, or ``128 + n`` (:func:`exit_code_after`) once stop signal ``n`` arrived."""
        return exit_code_after(self.signum) if self.signum is not None else code

    def __enter__(self) -> StopSignals:
        global _active
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._on_signal)
        self._outer, _active = _active, self
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        global _active
        _active = self._outer
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        stopped = isinstance(exc, KeyboardInterrupt)
        if stopped and self.signum is None:
            self.signum = getattr(exc, "signum", signal.SIGINT)
        self._say()
        return stopped

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if self._target is not None:
            loop, callback = self._target
            try:
                loop.call_soon_threadsafe(self._deliver, signum, callback)
                return
            except RuntimeError:  # the loop has closed meanwhile
                pass
        if first:
            raise Stopped(signum)

    def _deliver(self, signum: int, callback: Callable[[int], object]) -> None:
        self._say()
        callback(signum)

    def _say(self) -> None:
        if self.signum is None or self._said:
            return
        self._said = True
        err = self._err if self._err is not None else sys.stderr
        with contextlib.suppress(OSError, ValueError):  # stderr closed: still stop
            err.write(f"{self.prog}: stopping ({signal.Signals(self.signum).name})\n")
            err.flush()


def run_command(prog: str, command: Callable[[StopSignals], int]) -> int:
    """``command(stop)``'s exit code, run inside ``StopSignals(prog)`` (``command`` may set
    ``stop.prog`` once it knows its name): after a stop signal, ``128 + n``."""
    with StopSignals(prog) as stop:
        return stop.exit_code(command(stop))
    return stop.exit_code(EXIT_FAILED)  # a stop signal ended it before it returned


@contextlib.contextmanager
def on_stop_signal(callback: Callable[[int], object]) -> Iterator[None]:
    """While inside (on a running event loop), a stop signal calls ``callback(signum)`` on
    that loop — every one of them, after the command's one line — instead of raising
    :class:`Stopped`: how a command that can stop gracefully stops. Outside a
    :class:`StopSignals` block it changes nothing."""
    stops = _active
    if stops is None:
        yield
        return
    outer = stops._target
    stops._target = (asyncio.get_running_loop(), callback)
    try:
        yield
    finally:
        stops._target = outer


def run_until_stopped(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` on a new event loop (``asyncio.run``) to its exit code. Inside a
    :class:`StopSignals` block a stop signal cancels it — its ``finally`` blocks run, its
    children are stopped, its connections closed — and the code is then ``128 + n``."""
    return asyncio.run(_until_stopped(main))


async def _until_stopped(main: Coroutine[Any, Any, int]) -> int:
    task = asyncio.ensure_future(main)
    stopped_by: list[int] = []

    def stop(signum: int) -> None:
        if not stopped_by:  # once: a second Ctrl-C must not cut the clean-up short
            stopped_by.append(signum)
            task.cancel()

    with on_stop_signal(stop):
        try:
            return await task
        except asyncio.CancelledError:
            if not stopped_by:
                raise
            return exit_code_after(stopped_by[0])
