"""Test helpers for ``kernel-ext demo``: skipping where its agent cannot run, the words it
speaks, the whole demo as a subprocess (:func:`demo`), and what its page shows once calls
have ended (:data:`ENDED`)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest

from kernel_ext.demo.script import wording
from support.network import free_port, started

PY_REASON = "kernel-ext demo needs pydantic-ai, which needs Python >= 3.11"
"""Why a test of the demo's agent skips."""

CJK = re.compile("[\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef]")
"""A Chinese, Japanese or Korean character (or full-width form)."""

FIRST_QUESTION, SECOND_QUESTION = wording().questions
"""The demo's two questions, in Chinese: the one it asks first, and the follow-up."""


def skip_without_pydantic_ai() -> None:
    """Skip unless pydantic-ai, which the demo's agent needs, is installed."""
    pytest.importorskip("pydantic_ai", reason=PY_REASON)


def skip_unless_kernel(kernel: str) -> None:
    """Skip unless the demo can run with its agent on ``kernel`` here."""
    skip_without_pydantic_ai()
    if kernel == "langgraph":
        pytest.importorskip("langgraph", reason="--kernel langgraph needs langgraph")


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class Demo:
    """``kernel-ext demo`` in a subprocess, its output read by threads; its locale is
    ``locale`` (``LANG``; ``LC_ALL`` and ``LC_MESSAGES`` unset)."""

    def __init__(self, *argv: str, locale: str = "C.UTF-8") -> None:
        started("network")  # its colleagues and web process listen on 127.0.0.1
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("LC_ALL", "LC_MESSAGES")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kernel_ext.cli.entry", "demo", "--port", str(self.port), *argv],
            env={**env, "LANG": locale, "LC_CTYPE": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out, "out")),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err, "err")),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def _read(self, stream: Any, into: list[str], name: str) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))
            self._lines.put((name, line))

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        """Wait until a line containing ``needle`` was printed (either stream)."""
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in self.out + self.err):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.proc.poll() is not None and self._lines.empty()):
                raise AssertionError(f"no {needle!r} in time:\n" + "\n".join(self.err))
            with suppress(queue.Empty):
                self._lines.get(timeout=min(remaining, 1.0))

    def finish(self, timeout: float = 90) -> int:
        code = self.proc.wait(timeout=timeout)
        for thread in self._threads:
            thread.join(timeout=10)
        return code

    @property
    def child_pids(self) -> list[int]:
        return [int(m.group(1)) for line in self.err if (m := re.search(r"\(pid (\d+)\)", line))]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pid in self.child_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@contextmanager
def demo(*argv: str, locale: str = "C.UTF-8") -> Iterator[Demo]:
    """``kernel-ext demo ARGV`` running (a :class:`Demo`), killed with its children at the
    end."""
    running = Demo(*argv, locale=locale)
    try:
        yield running
    finally:
        running.close()


ENDED = """([nodes, answers]) =>
  document.querySelectorAll(".node-tool[data-status='ended']").length === nodes &&
  document.querySelectorAll(".node-message[data-role='assistant']").length === answers"""
"""A page function: whether ``nodes`` tool calls have ended on the demo's page and
``answers`` assistant messages are shown (its argument ``[nodes, answers]``)."""
