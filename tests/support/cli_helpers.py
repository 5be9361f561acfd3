"""Test helpers for the ``kernel-ext`` command run as a real subprocess: its environment (the
tests' secret, tests/support on the path for the hooks module), its installed console script,
a long-running command read line by line from its stderr, the relay's start-up line, how
every command ends on a stop signal (:func:`assert_stopped_cleanly`), and the systemd unit
and hooks module the docs show (:func:`unit`, :func:`write_documented_app`)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from support import ROOT
from support.relay_helpers import support_env

SECRET = "s3cret-for-cli-tests"
WAIT = 30.0
CLI = [sys.executable, "-m", "kernel_ext.cli.entry"]
CONSOLE_SCRIPT = Path(sys.executable).parent / "kernel-ext"
"""The installed ``kernel-ext`` entry point next to this Python (a venv's, a tox env's)."""


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
async def running(
    *args: str,
    command: Sequence[str] = CLI,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Running]:
    """``kernel-ext ARGS`` (``command ARGS``, in ``cwd``) started (stdout and stderr piped),
    killed at the end if it still runs."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        *args,
        cwd=cwd,
        env=env if env is not None else cli_env(),
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


# -- a stop signal -------------------------------------------------------------------------

EXIT_AFTER = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
"""The exit status of a command a stop signal ended: ``128 + n``, as a shell reports it."""


def stopping_line(prog: str, signum: int) -> str:
    """The one line a command writes when stop signal ``signum`` arrives."""
    return f"{prog}: stopping ({signal.Signals(signum).name})"


def assert_stopped_cleanly(
    code: int, err: Sequence[str], prog: str, signum: int, before: str, out: str = ""
) -> None:
    """How every long-running command ends on a stop signal, whatever it was doing: exit
    status ``128 + n``, no traceback, and one line saying so, the last on stderr; each line
    before it is one the command prints before the signal (matches ``before``)."""
    text = "\n".join([*err, out])
    assert code == EXIT_AFTER[signal.Signals(signum)], (code, text)
    for word in ("Traceback", "CancelledError", "KeyboardInterrupt"):
        assert word not in text, text
    assert err, "nothing on stderr"
    assert err[-1] == stopping_line(prog, signum), err
    for line in err[:-1]:
        assert re.fullmatch(before, line), (line, err)


# -- what the docs show ----------------------------------------------------------------------

DEPLOYMENT = ROOT / "docs" / "deployment.md"
WEB = ROOT / "docs" / "web.md"


def unit() -> dict[str, str]:
    """The systemd unit of docs/deployment.md (its one ``ini`` block): each setting's value."""
    text = DEPLOYMENT.read_text(encoding="utf-8")
    (block,) = re.findall(r"^```ini\n(.*?)^```$", text, re.S | re.M)
    settings = {}
    for line in block.splitlines():
        name, equals, value = line.partition("=")
        if equals and not line.startswith(("#", "[")):
            settings[name.strip()] = value.strip()
    return settings


def unit_command(port: int) -> list[str]:
    """The unit's ``ExecStart`` as argv, with ``port`` for ``%i``."""
    return shlex.split(unit()["ExecStart"].replace("%i", str(port)))


def write_documented_app(folder: Path) -> Path:
    """``folder/myapp/auth.py`` as docs/web.md shows it (token-of-alice is alice, who may join
    conv-1; any other token is refused); returns ``folder``."""
    text = WEB.read_text(encoding="utf-8")
    (module,) = re.findall(r"^```python\n(# myapp/auth\.py\n.*?)^```$", text, re.S | re.M)
    (folder / "myapp").mkdir(parents=True)
    (folder / "myapp" / "__init__.py").write_text("", encoding="utf-8")
    (folder / "myapp" / "auth.py").write_text(module, encoding="utf-8")
    return folder
