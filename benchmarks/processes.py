"""Process plumbing shared by the benchmarks and the tests (tests/support/network.py).

Everything here runs on the loopback interface (:data:`HOST`):

* :func:`free_port`; :func:`accepts`, :func:`wait_listening` and
  :func:`wait_listening_async` — wait until a port accepts a connection, with a deadline,
  failing early (``RuntimeError``) when the process that should listen exited, else with a
  ``TimeoutError``;
* :class:`RedisServer` — a real redis-server (its command line built in one place):
  :meth:`~RedisServer.start` / :meth:`~RedisServer.stop`, or ``async with``;
* :func:`cpu_seconds` and :func:`rss_bytes` of a process (Linux);
* :func:`spawn` — a python script as a child with its stdout piped; :func:`read_line` (the
  next line with a prefix from a child), :func:`ask` (a command on a child's stdin, then its
  answer line) and, in the child, :func:`stdin_lines` (its command channel).

Not a ``bench_*`` module: ``benchmarks/run.py`` does not run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from typing import Any

HOST = "127.0.0.1"


# -- ports ------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def accepts(port: int, check: Callable[[socket.socket], bool] | None = None) -> bool:
    """Whether 127.0.0.1:``port`` accepts a connection (and ``check`` holds on it)."""
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as sock:
            return check is None or check(sock)
    except OSError:
        return False


def _exit_status(process: Any) -> int | None:
    """The exit status of a ``subprocess.Popen`` or an asyncio process, ``None`` while it
    runs."""
    poll = getattr(process, "poll", None)
    code: int | None = poll() if poll is not None else process.returncode
    return code


def _check_running(process: Any, what: str) -> None:
    if process is not None and (code := _exit_status(process)) is not None:
        raise RuntimeError(f"{what} exited with {code}")


def _not_listening(what: str, port: int, timeout: float) -> TimeoutError:
    return TimeoutError(f"{what} did not listen on port {port} (waited {timeout:g} s)")


def wait_listening(
    port: int,
    *,
    process: Any = None,
    what: str = "the server",
    timeout: float = 20.0,
    check: Callable[[socket.socket], bool] | None = None,
) -> None:
    """Return once 127.0.0.1:``port`` accepts a connection (on which ``check``, if given,
    is true). Raises ``RuntimeError`` as soon as ``process`` (a ``subprocess.Popen`` or an
    asyncio process) has exited, ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        _check_running(process, what)
        if accepts(port, check):
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _not_listening(what, port, timeout)
        time.sleep(min(0.05, remaining))  # polling with a deadline


async def wait_listening_async(
    port: int,
    *,
    process: Any = None,
    what: str = "the server",
    timeout: float = 20.0,
    check: Callable[[socket.socket], bool] | None = None,
) -> None:
    """:func:`wait_listening` from a coroutine (each attempt in a thread: the loop keeps
    running)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        _check_running(process, what)
        if await asyncio.to_thread(accepts, port, check):
            return
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise _not_listening(what, port, timeout)
        await asyncio.sleep(min(0.05, remaining))  # polling with a deadline


# -- redis-server ---------------------------------------------------------------------------


def answers_ping(sock: socket.socket) -> bool:
    """Whether a Redis server on ``sock`` answers ``PING`` (with or without a password)."""
    sock.sendall(b"PING\r\n")
    return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))


class RedisServer:
    """A real redis-server on 127.0.0.1 (``binary``, else the ``redis-server`` on the
    ``PATH``), on the same port at each start, with ``password`` required when given; its
    data lost at each stop, or kept across a restart with ``persist`` (its append-only file,
    as a production Redis).

    :meth:`start` and :meth:`stop` it (its directory stays: remove :attr:`dir` when done), or
    ``async with`` it (stopped and its directory removed on exit)."""

    def __init__(
        self, binary: str | None = None, password: str | None = None, persist: bool = False
    ) -> None:
        self.binary = binary
        self.password = password
        self.persist = persist
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kx-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    def command(self) -> list[str]:
        """Its command line."""
        binary = self.binary or shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt package redis-server)")
        return [
            binary,
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "yes" if self.persist else "no",
            "--appendfsync",
            "always",
            "--dir",
            self.dir,
            *(["--requirepass", self.password] if self.password else []),
        ]

    def _launch(self) -> subprocess.Popen[bytes]:
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return self.proc

    def start(self) -> None:
        """Start it; return once it answers ``PING``."""
        process = self._launch()
        wait_listening(
            self.port, process=process, what="redis-server", timeout=10, check=answers_ping
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    async def __aenter__(self) -> RedisServer:
        process = self._launch()
        try:
            await wait_listening_async(
                self.port, process=process, what="redis-server", timeout=10, check=answers_ping
            )
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- what a process uses ----------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_clock(pid: int) -> int | None:
    """The kernel's CPU-time clock of process *pid* (all its threads, nanoseconds)."""
    try:
        import ctypes

        clock = ctypes.c_int()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
            return None
        return clock.value
    except (OSError, AttributeError):
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far.

    Read from the process's CPU-time clock (``clock_getcpuclockid``), which counts in
    nanoseconds: ``/proc/<pid>/stat`` counts in clock ticks (10 ms), coarser than a short
    load's whole CPU time. ``/proc`` is the fallback where that clock cannot be read.
    """
    clock = _cpu_clock(pid)
    if clock is not None:
        try:
            return time.clock_gettime(clock)
        except OSError:
            pass
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- children and their lines -------------------------------------------------------------------


async def spawn(
    script: str, *args: str, stdin: int = asyncio.subprocess.DEVNULL
) -> asyncio.subprocess.Process:
    """``script`` run by this Python as a child with ``args``, its stdout piped (its stderr
    this process's)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        script,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=None,
        stdin=stdin,
    )


async def end_processes(
    procs: list[asyncio.subprocess.Process], asked: Collection[asyncio.subprocess.Process]
) -> None:
    """End ``procs`` in reverse order: each of ``asked`` by closing its stdin (its way to
    stop cleanly) and waiting up to 10 s, then killing any still running."""
    for proc in reversed(procs):
        if proc in asked and proc.stdin is not None:
            proc.stdin.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def read_line(proc: asyncio.subprocess.Process, prefix: str, timeout: float) -> str:
    """The rest of the next line of ``proc``'s stdout that starts with ``prefix`` (other
    lines are skipped); ``TimeoutError`` after ``timeout`` seconds, ``RuntimeError`` when its
    stdout ends first."""
    assert proc.stdout is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError(f"no {prefix} line in time")
        raw = await asyncio.wait_for(proc.stdout.readline(), remaining)
        if not raw:
            raise RuntimeError(f"process ended before its {prefix} line")
        line = raw.decode().strip()
        if line.startswith(prefix):
            return line[len(prefix) :].strip()


async def ask(proc: asyncio.subprocess.Process, command: str, answer: str, timeout: float) -> str:
    """Write ``command`` as a line to ``proc``'s stdin; the rest of its ``answer`` line."""
    assert proc.stdin is not None
    proc.stdin.write(f"{command}\n".encode())
    await proc.stdin.drain()
    return await read_line(proc, answer, timeout)


async def stdin_lines() -> asyncio.StreamReader:
    """This process's standard input as a stream of lines (a child's command channel)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader
