"""``kernel-ext demo``: start the whole path as separate processes, watch them, stop them.

Processes, each ``sys.executable -m …`` logging to a temporary directory: two colleagues
(:mod:`kernel_ext.demo.colleague_server`), the web process (:mod:`kernel_ext.demo.web`) on
``--host``/``--port`` and the worker (:mod:`kernel_ext.demo.worker`), its agent on
``--kernel``.

Guarantees:

* No orphans: every child is stopped (SIGTERM, then SIGKILL after 5 s) and reaped when the
  demo ends for any reason (Ctrl-C, SIGTERM, the time limit, an error, a child that died:
  then exit 1 and the end of its log shown). On Linux each child also gets SIGTERM if the
  demo is killed outright; Ctrl-C in a terminal reaches the demo only.
* The URL is printed once every process is ready.
* ``--headless``: one scripted conversation, printed as ``kernel-ext tail --lang`` prints;
  exit 0 once the agent answered every question and every tool call ended ``done``, else 1.
* Exit 2 when ``--host``/``--port`` cannot be served (one line says why); 130 after Ctrl-C
  (SIGINT), 143 after SIGTERM, 129 after SIGHUP, in any phase, with one line and no
  traceback (:class:`kernel_ext.cli._common.StopSignals`).
* Logs are removed after a clean run and kept (path printed) after a failure.

Design: docs/contracts.md, "The demo's processes".
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kernel_ext.cli._common import (
    EXIT_USAGE,
    CommandLineError,
    exit_code_after,
    listen,
    run_until_stopped,
)
from kernel_ext.demo.script import (
    COLLEAGUES,
    DEFAULT_BEAT,
    DEFAULT_KERNEL,
    lang_of_locale,
    wording,
)
from kernel_ext.protocol import CHAT_EVENT, NAMESPACE, TOOL_EVENT_STREAM
from kernel_ext.viewing.tail import TailPrinter, clean

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "Child", "Options", "Supervisor", "launch"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = exit_code_after(signal.SIGINT)
"""After Ctrl-C (SIGINT); another stop signal gives its own ``128 + n``."""
_STOP_GRACE = 5.0
_STARTUP_LIMIT = 60.0


class DemoFailed(Exception):
    """The demo cannot go on; the message says why (printed on stderr)."""


# -- children ----------------------------------------------------------------------------


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGTERM the child when the demo dies, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec: no imports, no locks
        prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the demo died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


@dataclass
class Child:
    """One child process: its name, command line and log file."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The process id once started."""
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the child's log (empty when there is none)."""
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Supervisor:
    """Starts children with ``sys.executable -m`` and stops every one of them."""

    log_dir: Path
    env: Mapping[str, str]
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, module: str, *args: str) -> Child:
        """Start ``python -m module args…`` as ``name`` (stdout+stderr to its log)."""
        child = Child(name, [sys.executable, "-m", module, *args], self.log_dir / f"{name}.log")
        self.children.append(child)
        with open(child.log, "wb") as log:
            child.proc = subprocess.Popen(
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.env),
                start_new_session=True,
                preexec_fn=_parent_death_signal(),
            )
        return child

    def dead(self) -> Child | None:
        """The first child that has exited, if any."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                return child
        return None

    def stop(self, grace: float = _STOP_GRACE) -> None:
        """SIGTERM every running child, SIGKILL what is left after ``grace`` seconds, and
        reap them all. Idempotent; never raises."""
        procs = [c.proc for c in self.children if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.terminate()
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)


# -- readiness ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _until(
    supervisor: Supervisor, what: str, check: Callable[[], Any], deadline: float
) -> None:
    """Poll ``check()`` (sync or async) until true; fail when a child dies or at
    ``deadline`` (loop time)."""
    loop = asyncio.get_running_loop()
    while True:
        dead = supervisor.dead()
        if dead is not None:
            raise DemoFailed(_died(dead))
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise DemoFailed(f"{what} was not ready in time")
        await asyncio.sleep(0.05)  # polling with a deadline


async def _listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _ready(client: Any, url: str) -> bool:
    """Whether the web process's relay is ready (``/readyz``: Redis too, with ``--redis``)."""
    try:
        return bool((await client.get(url + "/readyz")).status_code == 200)
    except Exception:
        return False


async def _agent_connected(client: Any, url: str, kernel: str) -> bool:
    """Whether the worker's agent is connected, on ``kernel``."""
    try:
        response = await client.get(url + "/demo/health")
        health = response.json()
        return bool(response.status_code == 200 and health == {"agent": True, "kernel": kernel})
    except Exception:
        return False


async def _check_redis(url: str) -> None:
    """Fail early, and say so, when Redis does not answer (python-socketio would only log
    every lost message)."""
    from kernel_ext.redis.ping import RedisUnreachable, ping

    try:
        await ping(url)
    except RedisUnreachable as exc:
        raise DemoFailed(f"--redis: {exc}") from exc


def _died(child: Child) -> str:
    code = child.proc.returncode if child.proc is not None else None
    tail = child.log_tail()
    return f"the {child.name} process exited (code {code})" + (
        f"; the end of its log:\n{tail}" if tail else ""
    )


# -- headless ----------------------------------------------------------------------------


class _Transcript:
    """What a headless run saw: the tail printer's panes plus the chat messages."""

    def __init__(self, out: TextIO, lang: str) -> None:
        self.out = out
        self.printer = TailPrinter(out, locale=lang)
        self.tool_calls: list[str] = []
        self.answers = 0
        self.changed = asyncio.Event()

    def _say(self, mark: str, text: str) -> None:
        for line in clean(text).split("\n"):
            self.out.write(f"{mark} {line}\n")
        self.out.flush()

    def on_block(self, block: Any) -> None:
        self.printer.block(block)
        self.changed.set()

    def on_chat_event(self, event: Any) -> None:
        if isinstance(event, Mapping) and event.get("eventScene") == "message":
            content = event.get("content")
            if isinstance(content, Mapping) and isinstance(content.get("text"), str):
                if content.get("role") == "assistant":
                    self.answers += 1
                    self._say("«", content["text"])
                else:
                    self._say("»", content["text"])
        elif isinstance(event, Mapping) and event.get("eventScene") == "tool":
            call_id = event.get("eventId")
            if isinstance(call_id, str) and call_id not in self.tool_calls:
                self.tool_calls.append(call_id)
            self.printer.snapshot(event)
        self.changed.set()

    def answered(self, count: int) -> bool:
        """Whether the agent has answered ``count`` messages."""
        return self.answers >= count

    def open_calls(self) -> list[str]:
        """Tool calls without a terminal on every stream."""
        open_ = []
        for call_id in self.tool_calls:
            pane = self.printer.store.pane(call_id)
            if pane is None or not pane.tasks or not all(t.ended for t in pane.tasks.values()):
                open_.append(call_id)
        return open_

    def aborted_calls(self) -> list[str]:
        """Tool calls with an ``aborted`` stream."""
        return [
            call_id
            for call_id in self.tool_calls
            if (pane := self.printer.store.pane(call_id)) is not None
            and any(t.outcome == "aborted" for t in pane.tasks.values())
        ]

    async def wait(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self.changed.clear()
            await self.changed.wait()


async def _converse(url: str, out: TextIO, err: TextIO, lang: str) -> int:
    """Play the questions of ``lang`` through ``/chat`` like a browser; the exit code."""
    import socketio

    transcript = _Transcript(out, lang)
    conversation_id = f"demo-headless-{uuid.uuid4().hex[:12]}"
    # handle_sigint=False: Ctrl-C is the command's (a clean stop), not engineio's
    # cancel-every-task.
    sio = socketio.AsyncClient(reconnection=False, handle_sigint=False)
    sio.on(TOOL_EVENT_STREAM, transcript.on_block, namespace=NAMESPACE)
    sio.on(CHAT_EVENT, transcript.on_chat_event, namespace=NAMESPACE)
    try:
        await sio.connect(url, namespaces=[NAMESPACE], transports=["websocket"], wait_timeout=10)
    except socketio.exceptions.ConnectionError as exc:
        raise DemoFailed(f"cannot connect to the web process at {url}: {exc}") from exc
    try:
        ack = await sio.call(
            "join_conversation",
            {"conversationId": conversation_id},
            namespace=NAMESPACE,
            timeout=10,
        )
        if not (isinstance(ack, Mapping) and ack.get("ok") is True):
            raise DemoFailed(f"joining {conversation_id} was refused: {ack!r}")
        for number, question in enumerate(wording(lang).questions, start=1):
            ack = await sio.call(
                "user_message",
                {"conversationId": conversation_id, "text": question, "lang": lang},
                namespace=NAMESPACE,
                timeout=15,
            )
            if not (isinstance(ack, Mapping) and ack.get("ok") is True):
                raise DemoFailed(f"the message was refused: {ack!r}")
            await transcript.wait(functools.partial(transcript.answered, number))
        await transcript.wait(lambda: not transcript.open_calls())
    except socketio.exceptions.SocketIOError as exc:  # a call timed out, the link dropped
        raise DemoFailed(f"talking to the web process failed: {exc!r}") from exc
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sio.disconnect(), 5)
    aborted = transcript.aborted_calls()
    calls = len(transcript.tool_calls)
    if aborted:
        err.write(f"kernel-ext demo: {len(aborted)} of {calls} tool calls aborted: {aborted}\n")
        return EXIT_FAILED
    err.write(f"kernel-ext demo: {calls} tool calls, each ended with its final answer\n")
    return EXIT_OK


# -- the command -------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """``kernel-ext demo``'s options (see :func:`kernel_ext.demo.add_arguments`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    headless: bool = False
    redis: str | None = None
    time_limit: float | None = None
    step_delay: float = DEFAULT_BEAT
    lang: str | None = None
    """The page's starting language (``None``: the browser's) and ``--headless``'s
    (``None``: the locale's, :func:`~kernel_ext.demo.script.lang_of_locale`)."""
    kernel: str = DEFAULT_KERNEL


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


async def _main(options: Options, out: TextIO, err: TextIO, log_dir: Path) -> int:
    """The demo until it ends; a stop signal cancels it (:func:`launch`), and its children
    are stopped on every way out."""
    if options.redis:
        await _check_redis(options.redis)
    env = {
        **os.environ,
        "KERNEL_EXT_SECRET": secrets.token_urlsafe(32),
        "PYTHONUNBUFFERED": "1",
    }
    supervisor = Supervisor(log_dir, env)
    url = f"http://{_url_host(options.host)}:{options.port}"
    try:
        colleague_urls = _start_children(supervisor, options, url)
        for child in supervisor.children:
            err.write(f"kernel-ext demo: {child.name} started (pid {child.pid})\n")
        err.flush()
        job = asyncio.ensure_future(_run(supervisor, options, url, colleague_urls, out, err))
        watcher = asyncio.ensure_future(_watch(supervisor))
        try:
            done, _ = await asyncio.wait(
                {job, watcher}, timeout=options.time_limit, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (job, watcher):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
        if job in done:
            return job.result()
        if watcher in done:
            return watcher.result()  # raises DemoFailed: a child died
        if options.headless:
            raise DemoFailed(f"the conversation did not finish within {options.time_limit:g} s")
        err.write(f"kernel-ext demo: time limit of {options.time_limit:g} s reached; stopping\n")
        return EXIT_OK
    finally:
        supervisor.stop()


def _start_children(supervisor: Supervisor, options: Options, url: str) -> list[str]:
    """Start the colleagues, the web process and the worker; the colleagues' URLs."""
    colleague_urls: list[str] = []
    for spec in COLLEAGUES:
        port = _free_port()
        supervisor.start(
            f"colleague-{spec.key}",
            "kernel_ext.demo.colleague_server",
            "--port", str(port),
            "--name", spec.title,
            "--delay", str(options.step_delay),
        )  # fmt: skip
        colleague_urls.append(f"http://127.0.0.1:{port}/")
    web_args = ["--host", options.host, "--port", str(options.port)]
    if options.lang is not None:
        web_args += ["--lang", options.lang]
    if options.redis:
        web_args += ["--redis", options.redis]
    supervisor.start("web", "kernel_ext.demo.web", *web_args)
    # Every message says its language; the worker's --lang is for one that would not.
    worker_args = ["--relay", url, "--kernel", options.kernel]
    for spec, colleague_url in zip(COLLEAGUES, colleague_urls, strict=True):
        worker_args += ["--colleague", f"{spec.key}={colleague_url}"]
    supervisor.start("worker", "kernel_ext.demo.worker", *worker_args)
    return colleague_urls


async def _run(
    supervisor: Supervisor,
    options: Options,
    url: str,
    colleague_urls: list[str],
    out: TextIO,
    err: TextIO,
) -> int:
    """Wait until every child is ready, then run the scripted conversation (headless) or
    tell the person where to look and wait."""
    import httpx

    deadline = asyncio.get_running_loop().time() + _STARTUP_LIMIT
    for colleague_url in colleague_urls:
        port = int(colleague_url.rsplit(":", 1)[1].strip("/"))
        await _until(supervisor, "a colleague", functools.partial(_listening, port), deadline)
    async with httpx.AsyncClient(timeout=2.0) as client:
        await _until(supervisor, "the web process", lambda: _ready(client, url), deadline)
        await _until(
            supervisor,
            f"the agent (on {options.kernel})",
            lambda: _agent_connected(client, url, options.kernel),
            deadline,
        )
    if options.headless:
        err.write(
            f"kernel-ext demo: ready at {url}, the agent on {options.kernel}; "
            "running the scripted conversation\n"
        )
        err.flush()
        lang = options.lang or lang_of_locale(os.environ)
        return await _converse(url, out, err, lang)
    out.write(
        f"kernel-ext demo is running. Open {url}/ in a browser.\n"
        "The page starts a conversation by itself; Ctrl-C stops everything.\n"
    )
    out.flush()
    await asyncio.Event().wait()  # until a signal, the time limit or a child's death
    return EXIT_OK  # pragma: no cover


async def _watch(supervisor: Supervisor) -> int:
    """Raise :class:`DemoFailed` once a child has died."""
    while True:
        dead = supervisor.dead()
        if dead is not None:
            raise DemoFailed(_died(dead))
        await asyncio.sleep(0.2)  # watching the children, not synchronising


def launch(options: Options, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the demo; returns the exit code (module docstring). Never leaves a child."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:  # the web process binds later: say now, in one line, when it could not
        listen(options.host, options.port).close()
    except CommandLineError as exc:
        err.write(f"kernel-ext demo: error: {exc}\n")
        err.flush()
        return EXIT_USAGE
    log_dir = Path(tempfile.mkdtemp(prefix="kernel-ext-demo-"))
    code = None  # stays None when a stop signal ends it here (kernel_ext.cli._common)
    try:
        code = run_until_stopped(_main(options, out, err, log_dir))
    except DemoFailed as exc:
        code = EXIT_FAILED
        err.write(f"kernel-ext demo: {exc}\n")
    except Exception:  # a defect: say so, the children are stopped already
        code = EXIT_FAILED
        err.write("kernel-ext demo: unexpected error\n")
        traceback.print_exc(file=err)
    finally:
        failed = code is not None and code != EXIT_OK and code <= 128  # > 128: stopped
        if failed and any(log_dir.iterdir()):
            err.write(f"kernel-ext demo: the processes' logs are in {log_dir}\n")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
        err.flush()
    return code
