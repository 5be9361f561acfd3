"""Real servers and browsers for the tests, on 127.0.0.1.

* :func:`free_port`, :func:`need_binary`, :func:`need_module` (skip outside CI when
  something is missing, fail in CI, where it must be there);
* :func:`wait_listening` — the one way a test waits for a server: until its port accepts a
  connection, with a deadline, failing early when its process exited;
* :class:`RedisServer` (a real redis-server), :func:`serve_asgi` (uvicorn in the running
  loop), :func:`chromium` (headless Chromium through Playwright);
* :func:`http_request` — one plain HTTP request with a timeout (status, headers, body);
* :class:`LoopThread` (an event loop on a thread of its own, for tests whose thread
  belongs to Playwright's sync API), :class:`NoWebSocketProxy` (an HTTP proxy that
  refuses WebSocket upgrades, as some corporate proxies do) and :class:`FlakyNetwork` (a
  TCP proxy whose network drops and comes back);
* :func:`started` — what a test started (``network``, ``redis``, ``browser``), recorded by
  the helpers above; conftest fails a test that started something it is not marked for.

The ports, the waiting and redis-server are the benchmarks' process plumbing
(benchmarks/processes.py), with what a test started recorded on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from types import ModuleType
from typing import Any

import processes
import pytest
from processes import HOST, free_port
from processes import accepts as accepts  # re-exported: part of this module's API

from kernel_ext.testing.browser import CHROMIUM_ARGS
from support.timing import wait_until

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# -- what a test started ----------------------------------------------------------------

KINDS = ("network", "redis", "browser")
"""The markers of tests that start something: a server on 127.0.0.1, a redis-server,
headless Chromium."""

_started: set[str] = set()


def started(*kinds: str) -> None:
    """Record that the running test started ``kinds`` (each one of :data:`KINDS`)."""
    unknown = set(kinds) - set(KINDS)
    assert not unknown, f"unknown kinds {sorted(unknown)}"
    _started.update(kinds)


def take_started() -> set[str]:
    """What was recorded since the last call (and forget it)."""
    kinds = set(_started)
    _started.clear()
    return kinds


def missing_markers(kinds: set[str], markers: set[str]) -> list[str]:
    """The markers a test that started ``kinds`` lacks, given the ``markers`` it carries."""
    return sorted(set(kinds) - set(markers))


# -- what must be installed ---------------------------------------------------------------


def _missing(what: str, how: str, installed_by: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is required in CI ({installed_by} installs it)")
    # Also at a test module's top level (a module that needs the package throughout).
    pytest.skip(f"{what} is not installed ({how}); CI runs this test", allow_module_level=True)


def need_binary(name: str, env_var: str | None = None) -> str:
    """Path of a system binary; skip outside CI when absent, fail in CI (it must be there)."""
    path = (os.environ.get(env_var) if env_var else None) or shutil.which(name)
    if path:
        return path
    _missing(name, f"apt-get install {name}", ".ci/run")
    raise AssertionError("unreachable")  # pragma: no cover


def need_module(name: str, install: str) -> ModuleType:
    """Import ``name``; skip outside CI when it is not installed, fail in CI (the ``test``
    extra installs it)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        _missing(name, install, "the test extra")
        raise AssertionError("unreachable") from None  # pragma: no cover


# -- waiting for a server -----------------------------------------------------------------


def wait_listening(
    port: int,
    *,
    process: subprocess.Popen[Any] | None = None,
    what: str = "the server",
    timeout: float = 20.0,
    check: Callable[[socket.socket], bool] | None = None,
) -> None:
    """Return once 127.0.0.1:``port`` accepts a connection (on which ``check``, if given,
    is true). Raises ``RuntimeError`` as soon as ``process`` has exited, ``TimeoutError``
    after ``timeout`` seconds."""
    started("network")
    processes.wait_listening(port, process=process, what=what, timeout=timeout, check=check)


async def wait_listening_async(
    port: int,
    *,
    process: subprocess.Popen[Any] | None = None,
    what: str = "the server",
    timeout: float = 20.0,
) -> None:
    """:func:`wait_listening` from a coroutine (the loop keeps running)."""
    started("network")
    await processes.wait_listening_async(port, process=process, what=what, timeout=timeout)


# -- servers --------------------------------------------------------------------------------


class RedisServer(processes.RedisServer):
    """A real redis-server on 127.0.0.1, started and stopped by the test (on the same port
    each time), with ``password`` required when given; its data lost at each stop, or kept
    across a restart with ``persist`` (its append-only file, as a production Redis). Its
    :attr:`dir` stays after :meth:`stop`: remove it when done."""

    def __init__(self, binary: str, password: str | None = None, persist: bool = False) -> None:
        super().__init__(binary, password=password, persist=persist)

    def start(self) -> None:
        """Start it; return once it answers ``PING``."""
        started("redis", "network")
        super().start()

    async def __aenter__(self) -> RedisServer:
        started("redis", "network")
        await super().__aenter__()
        return self


def http_request(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """One HTTP request (10 s timeout): the status, the headers (lower-case names) and the
    body, an error status included."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            headers = {k.lower(): v for k, v in response.headers.items()}
            return response.status, headers, response.read()
    except urllib.error.HTTPError as exc:
        headers = {k.lower(): v for k, v in exc.headers.items()}
        return exc.code, headers, exc.read()


@contextlib.asynccontextmanager
async def serve_asgi(app: Any, port: int | None = None) -> AsyncIterator[int]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 inside the running loop; yield its port."""
    import uvicorn

    started("network")
    port = port or free_port()
    config = uvicorn.Config(app, host=HOST, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())

    def up() -> bool:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped before it started")
        return bool(server.started)

    try:
        await wait_until(up, 10, "uvicorn did not start")
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)


class LoopThread:
    """An asyncio event loop running on a thread of its own: servers and clients for a test
    whose own thread belongs to Playwright's sync API (which refuses a running loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Run ``coro`` on the loop; its result, or its exception (``TimeoutError`` after
        ``timeout`` seconds)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class _Proxy:
    """A server on 127.0.0.1 (:attr:`port` once started) in front of
    ``127.0.0.1:target_port``, handling each connection in a task of its own
    (:meth:`_handle`); :meth:`stop` ends them all."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        started("network")
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class NoWebSocketProxy(_Proxy):
    """An HTTP proxy on 127.0.0.1 in front of ``127.0.0.1:target_port`` that refuses every
    WebSocket upgrade with ``403`` and forwards every other request — what a proxy that
    blocks WebSocket does to a page. It marks each request ``Connection: close`` so that
    every request comes on a connection of its own and is inspected. ``refused`` and
    ``forwarded`` count requests. Start and stop it on its loop (:class:`LoopThread`)."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.refused = 0
        self.forwarded = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            request, *headers = head[:-4].split(b"\r\n")
            names = [line.split(b":", 1)[0].strip().lower() for line in headers]
            upgrade = any(
                name == b"upgrade" and b"websocket" in line.lower()
                for name, line in zip(names, headers, strict=True)
            )
            if upgrade:
                self.refused += 1
                writer.write(
                    b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                await writer.drain()
                return
            kept = [
                line
                for name, line in zip(names, headers, strict=True)
                if name not in (b"connection", b"keep-alive")
            ]
            up_reader, upstream = await asyncio.open_connection(HOST, self.target_port)
            upstream.write(b"\r\n".join([request, *kept, b"Connection: close", b"", b""]))
            self.forwarded += 1
            to_upstream = asyncio.ensure_future(_pipe(reader, upstream))
            try:
                await _pipe(up_reader, writer)  # until the server closes: one request
            finally:
                to_upstream.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await to_upstream
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the browser or the server went away
        except asyncio.TimeoutError:
            pass  # no request head within 30 s
        finally:
            for stream in (writer, upstream):
                if stream is not None:
                    stream.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copy ``source`` to ``sink`` until ``source`` ends."""
    while chunk := await source.read(65536):
        sink.write(chunk)
        await sink.drain()


class FlakyNetwork(_Proxy):
    """A TCP proxy on 127.0.0.1 in front of ``127.0.0.1:target_port`` whose network can
    drop: :meth:`offline` cuts every connection through it (no goodbye reaches either end)
    and cuts each new one at once until :meth:`online` — what a closed laptop lid or a
    mobile hand-off does to a client. Start, use and stop it on one loop."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self._online = True
        self._open: set[asyncio.StreamWriter] = set()

    def offline(self) -> None:
        """Cut every connection now, and every new one until :meth:`online`."""
        self._online = False
        for writer in list(self._open):
            writer.transport.abort()

    def online(self) -> None:
        self._online = True

    async def stop(self) -> None:
        self.offline()
        await super().stop()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._online:
            writer.transport.abort()
            return
        super()._accept(reader, writer)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection(HOST, self.target_port)
            if not self._online:
                return  # went offline meanwhile
            self._open.update((writer, upstream))
            to_upstream = asyncio.ensure_future(_pipe(reader, upstream))
            try:
                await _pipe(up_reader, writer)
            finally:
                to_upstream.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await to_upstream
        except OSError:
            pass  # cut, or one end went away
        finally:
            for stream in (writer, upstream):
                if stream is not None:
                    self._open.discard(stream)
                    stream.transport.abort()


@contextlib.asynccontextmanager
async def flaky_network(target_port: int) -> AsyncIterator[FlakyNetwork]:
    """A started :class:`FlakyNetwork` in front of ``target_port``, on the running loop."""
    network = FlakyNetwork(target_port)
    await network.start()
    try:
        yield network
    finally:
        await network.stop()


@contextlib.contextmanager
def no_websocket_proxy(target_port: int) -> Iterator[NoWebSocketProxy]:
    """A :class:`NoWebSocketProxy` in front of ``target_port``, on a loop of its own."""
    runner = LoopThread()
    proxy = NoWebSocketProxy(target_port)
    try:
        runner.run(proxy.start())
        yield proxy
    finally:
        with contextlib.suppress(Exception):
            runner.run(proxy.stop(), timeout=10)
        runner.close()


# -- a browser ----------------------------------------------------------------------------

# CHROMIUM_ARGS: the launch flags, from kernel_ext.testing.browser (imported above).


@contextlib.contextmanager
def chromium(env: dict[str, str] | None = None) -> Iterator[Any]:
    """Headless Chromium (Debian's ``chromium``, or ``$CHROMIUM``) driven by Playwright's sync
    API; yields the Playwright ``Browser``. ``env``: the browser process's environment
    (default: this one's). Skips outside CI when Playwright or Chromium is missing, fails
    in CI."""
    executable = need_binary("chromium", "CHROMIUM")
    sync_api = need_module("playwright.sync_api", "pip install playwright")
    started("browser")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, args=CHROMIUM_ARGS, timeout=60_000, env=env
        )
        try:
            yield browser
        finally:
            browser.close()
