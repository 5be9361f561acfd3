"""Test helpers for the ``kernel-ext`` command run as a real subprocess: its environment (the
tests' secret, tests/support on the path for the hooks module), a long-running command read
line by line from its stderr, and the relay's start-up line."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import AsyncIterator

from support.relay_helpers import support_env

SECRET = "s3cret-for-cli-tests"
WAIT = 30.0
CLI = [sys.executable, "-m", "kernel_ext.cli"]


def cli_env() -> dict[str, str]:
    """The secret, and ``tests/support`` (the hooks module) on the path."""
    return support_env(SECRET)


class Running:
    """A long-running ``kernel-ext`` command; its stderr read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.err: list[str] = []

    async def wait_for_line(self, pattern: str) -> re.Match[str]:
        """The first stderr line matching ``pattern`` (fails at the deadline or at EOF)."""
        assert self.proc.stderr is not None
        while True:
            raw = await asyncio.wait_for(self.proc.stderr.readline(), WAIT)
            assert raw, f"exited ({await self.proc.wait()}) before {pattern!r}: {self.err}"
            self.err.append(raw.decode().rstrip("\n"))
            found = re.search(pattern, self.err[-1])
            if found:
                return found

    async def stop(self, signum: int) -> tuple[int, str]:
        self.proc.send_signal(signum)
        _, rest = await asyncio.wait_for(self.proc.communicate(), WAIT)
        self.err += rest.decode().splitlines()
        assert self.proc.returncode is not None
        return self.proc.returncode, "\n".join(self.err)


@contextlib.asynccontextmanager
async def running(*args: str) -> AsyncIterator[Running]:
    """``kernel-ext ARGS`` started (stdout and stderr piped), killed at the end if it still
    runs."""
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        *args,
        env=cli_env(),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield Running(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


STARTUP = (
    r"^kernel-ext relay: serving (http://127\.0\.0\.1:(\d+)), namespace /chat, auth: (.*?)"
    r"(?:, page (\S+) \((.+)\))?$"
)
"""The relay's start-up line: its URL, port, auth mode, and page (when it serves one) with
what it says about the page's language."""
