"""Shared fixtures: free ports, a real redis-server, an in-loop uvicorn server."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def need_binary(name: str, env_var: str | None = None) -> str:
    """Path of a system binary; skip outside CI when absent, fail in CI (it must be there)."""
    path = (os.environ.get(env_var) if env_var else None) or shutil.which(name)
    if path:
        return path
    if IN_CI:
        pytest.fail(f"{name} is required in CI (.ci/run installs it)")
    pytest.skip(f"{name} is not installed (apt-get install {name}); CI runs this test")


CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""Launch flags for Debian's chromium under Playwright (``executable_path``), as root in CI."""


class RedisServer:
    """A real redis-server on 127.0.0.1, started and stopped by the test."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kx-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = 10.0
        step = 0.02
        waited = 0.0
        while waited < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(step)  # polling with a deadline while the server boots
            waited += step
        raise RuntimeError("redis-server did not answer within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh real redis-server for one test (skips outside CI when not installed)."""
    server = RedisServer(need_binary("redis-server", "REDIS_SERVER"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


@asynccontextmanager
async def serve_asgi(app: Any, port: int | None = None) -> AsyncIterator[int]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 inside the running loop; yield its port."""
    import uvicorn

    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while not server.started:  # poll with a deadline until uvicorn is listening
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped before it started")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("uvicorn did not start within 10 s")
            await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)
