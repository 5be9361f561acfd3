"""The ``kernel-ext`` command behaves like one (issue 15, item 2). Real subprocesses.

* A bad command line, or a host/port a command cannot serve on, is exactly one line on
  stderr, ``<prog>: error: …``, exit status 2, never a traceback nor a usage block; an
  unknown option after a subcommand is reported by that subcommand.
* ``tail`` against nothing says it could not connect to the URL, and why, in one line.
* ``relay`` and ``tail`` stop on SIGTERM with 143, on SIGINT with 130 and on SIGHUP with 129
  (unless it is ignored: ``nohup``), in one line and without a traceback, in every phase:
  ``relay`` while it imports its hooks, while it serves, with a browser connected; ``tail``
  while it connects and while it follows (issue 33, item 4; the demo's phases are in
  test_demo_process.py); ``relay`` prints one start-up line first.
* docs/deployment.md's systemd unit works as written: its ``ExecStart`` arguments, run by the
  installed console script in its ``WorkingDirectory``, load the hooks module there; the
  app directory is the working directory unless ``--app-dir`` names another, and one that
  is not a directory, or lacks the module, is refused naming it (issue 33, item 3).
* ``--version`` prints the package's version; ``relay --help`` shows every option with its
  default; ``python -m kernel_ext.relay`` is the same command, without a RuntimeWarning;
  ``python -m kernel_ext`` is ``kernel-ext``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
import socketio
from support import ROOT
from support.cli_helpers import (
    CLI,
    CONSOLE_SCRIPT,
    SECRET,
    STARTUP,
    WAIT,
    assert_stopped_cleanly,
    cli_env,
    running,
    unit,
    unit_command,
    write_documented_app,
)
from support.network import HOST, free_port, http_request
from support.relay_helpers import HOOKS, Browser

from kernel_ext import __version__
from kernel_ext.cli._common import exit_code_after, never_resolves
from kernel_ext.cli.entry import build_parser
from kernel_ext.web import ASSETS, asset_path


def kernel_ext(*args: str, command: Sequence[str] = CLI) -> subprocess.CompletedProcess[str]:
    """``kernel-ext ARGS`` (``command`` ``ARGS``) expected to end by itself (a refusal;
    killed at the timeout)."""
    return subprocess.run(
        [*command, *args],
        env=cli_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line on stderr of a run that exited with ``code``; nothing on stdout."""
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    return lines[0]


@contextlib.contextmanager
def port_in_use() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


# -- one-line errors ---------------------------------------------------------------------

PORT_RANGE = "must be a port number from 1 to 65535"
ANY_PORT_RANGE = "must be a port number from 0 (any free port) to 65535"
URL = ["--conversation", "c", "--url"]
USAGE_ERRORS = {
    "demo port too large": (["demo", "--port", "99999"], f"--port: {PORT_RANGE}, got '99999'"),
    "demo port negative": (["demo", "--port", "-1"], f"--port: {PORT_RANGE}, got '-1'"),
    "demo port not a number": (["demo", "--port", "web"], f"--port: {PORT_RANGE}, got 'web'"),
    "demo host unresolvable": (
        ["demo", "--host", "nosuchhost.invalid"],
        "--host 'nosuchhost.invalid' does not resolve to an address",
    ),
    "demo step delay negative": (
        ["demo", "--step-delay", "-1"],
        "--step-delay: must be a number of seconds, 0 or more, got '-1'",
    ),
    "demo step delay nan": (
        ["demo", "--step-delay", "nan"],
        "--step-delay: must be a number of seconds, 0 or more, got 'nan'",
    ),
    "demo time limit zero": (
        ["demo", "--time-limit", "0"],
        "--time-limit: must be a number of seconds greater than 0, got '0'",
    ),
    "demo unknown flag": (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    "relay port too large": (
        ["relay", "--port", "99999", *HOOKS],
        f"--port: {ANY_PORT_RANGE}, got '99999'",
    ),
    "relay port negative": (["relay", "--port", "-1", *HOOKS], f"--port: {ANY_PORT_RANGE}"),
    "relay host unresolvable": (
        ["relay", "--host", "nosuchhost.invalid", *HOOKS],
        "--host 'nosuchhost.invalid' does not resolve to an address",
    ),
    "relay unknown flag": (["relay", "--bogus"], "unrecognized arguments: --bogus"),
    "relay without hooks": (["relay"], "give both --authenticate and --authorize-join"),
    "tail port too large": (
        ["tail", *URL, "http://127.0.0.1:99999"],
        "--url: is not a URL (Port out of range 0-65535)",
    ),
    "tail not http": (["tail", *URL, "ftp://relay"], "--url: must be an http:// or https:// URL"),
    "tail timeout negative": (
        ["tail", *URL, "http://127.0.0.1:8765", "--timeout", "-1"],
        "--timeout: must be a number of seconds greater than 0, got '-1'",
    ),
    "tail no url": (["tail", "--conversation", "c"], "the following arguments are required: --url"),
    "tail empty conversation": (
        ["tail", *URL, "http://127.0.0.1:8765", "--conversation", " "],
        "--conversation: must be a conversation id, got an empty string",
    ),
    "tail conversation too long": (
        ["tail", *URL, "http://127.0.0.1:8765", "--conversation", "c" * 513],
        "--conversation: must be a conversation id of at most 512 characters, got 'ccc",
    ),
    "stop no call id": (
        ["stop", *URL, "http://127.0.0.1:8765", "--conversation", "c"],
        "the following arguments are required: --call-id",
    ),
    "unknown command": (["bogus"], "invalid choice: 'bogus'"),
}


# Refused after the command line parsed, by which time the demo has checked its Python.
DEMO_NEEDS_311 = pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="on Python 3.10 the demo first says it needs 3.11 (tested in test_demo_options.py)",
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=DEMO_NEEDS_311) if case == "demo host unresolvable" else case
        for case in USAGE_ERRORS
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_2(case: str) -> None:
    args, phrase = USAGE_ERRORS[case]
    line = one_line(kernel_ext(*args), 2)
    command = args[0] if args[0] in ("demo", "relay", "tail", "stop") else ""
    prog = f"kernel-ext {command}".strip()
    assert line.startswith(f"{prog}: error: "), line  # the subcommand's own name
    assert phrase in line


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "command",
    [pytest.param(["demo"], marks=DEMO_NEEDS_311), ["relay", *HOOKS]],
    ids=["demo", "relay"],
)
def test_a_port_in_use_is_one_line_and_exit_2(command: list[str]) -> None:
    with port_in_use() as port:
        line = one_line(kernel_ext(*command, "--port", str(port)), 2)
    assert line == (
        f"kernel-ext {command[0]}: error: port {port} on 127.0.0.1 is in use; pick another "
        "with --port"
    )


def test_a_host_that_is_not_this_machines_is_one_line_and_exit_2() -> None:
    line = one_line(kernel_ext("relay", "--host", "192.0.2.1", "--port", "0", *HOOKS), 2)
    assert line == "kernel-ext relay: error: --host 192.0.2.1 is not an address of this machine"


@pytest.mark.network
@pytest.mark.timeout(120)
def test_tail_against_a_dead_relay_says_it_could_not_connect_to_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = one_line(kernel_ext("tail", "--url", url, "--conversation", "c"), 2)
    assert line.startswith(f"kernel-ext tail: cannot connect to {url}: "), line
    assert "nothing is listening on 127.0.0.1:" in line
    assert "ssl" not in line


@pytest.mark.timeout(120)
def test_tail_against_a_host_that_does_not_resolve_says_so() -> None:
    url = "http://nosuchhost.invalid:8765"
    line = one_line(kernel_ext("tail", "--url", url, "--conversation", "c"), 2)
    assert line.startswith(f"kernel-ext tail: cannot connect to {url}: "), line
    assert "the host name 'nosuchhost.invalid' does not resolve" in line


@pytest.mark.parametrize(
    ("host", "never"),
    [
        ("nosuchhost.invalid", True),
        ("NoSuchHost.INVALID.", True),
        ("invalid", True),
        ("a.b.invalid", True),
        ("invalid.example", False),
        ("notinvalid", False),
        ("127.0.0.1", False),
        ("localhost", False),
    ],
)
def test_names_under_invalid_are_refused_without_asking_dns(host: str, never: bool) -> None:
    """RFC 6761: the commands answer for ``.invalid`` names themselves, so neither the
    tests above nor a user's typo sends a DNS query off the machine."""
    assert never_resolves(host) is never


# -- version and help ---------------------------------------------------------------------


def test_version_is_the_packages() -> None:
    result = kernel_ext("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"kernel-ext {importlib.metadata.version('kernel-ext')}\n"
    assert importlib.metadata.version("kernel-ext") == __version__


def test_python_m_kernel_ext_is_the_kernel_ext_command() -> None:
    script = shutil.which(CONSOLE_SCRIPT.name, path=str(CONSOLE_SCRIPT.parent))
    assert script is not None, "the kernel-ext console script is not installed next to python"
    for args, code in ((["--version"], 0), (["relay", "--port", "-1", *HOOKS], 2)):
        runs = [
            kernel_ext(*args, command=command)
            for command in ([sys.executable, "-W", "error", "-m", "kernel_ext"], [script])
        ]
        assert [(run.returncode, run.stdout, run.stderr) for run in runs] == 2 * [
            (runs[1].returncode, runs[1].stdout, runs[1].stderr)
        ]
        assert runs[0].returncode == code, runs[0].stderr
    assert runs[0].stderr.startswith("kernel-ext relay: error: ")
    assert f"--port: {ANY_PORT_RANGE}" in runs[0].stderr


def test_relay_help_lists_every_option_with_its_default() -> None:
    result = kernel_ext("relay", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps the help at the terminal width
    relay = build_parser().get_default("subparsers")["relay"]
    options = [action for action in relay._actions if action.dest != "help"]
    assert len(options) >= 9
    for action in options:
        assert action.option_strings[-1] in text
        assert action.help is not None
        assert "(default: " in action.help, action.option_strings
    for default in ("(default: 127.0.0.1)", "(default: 8765)", "(default: warning)"):
        assert default in text
    assert "$KERNEL_EXT_REDIS_URL" in text


def test_python_m_kernel_ext_relay_is_the_same_command_without_a_runtime_warning() -> None:
    args = ["--port", "-1", *HOOKS]
    alias = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "kernel_ext.relay", *args],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    line = one_line(alias, 2)
    assert line == one_line(kernel_ext("relay", *args), 2).replace(
        "kernel-ext relay", "python -m kernel_ext.relay"
    )


# -- stopped by a signal ------------------------------------------------------------------


STOPS = [signal.SIGTERM, signal.SIGINT]


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", STOPS, ids=["SIGTERM", "SIGINT"])
async def test_relay_prints_one_startup_line_and_stops_on_a_signal(signum: int) -> None:
    async with running("relay", "--port", "0", *HOOKS) as relay:
        found = await relay.wait_for_line(STARTUP)
        assert found.group(3) == (
            "hooks relay_cli_hooks:authenticate and relay_cli_hooks:authorize_join, "
            "no Redis (this process only)"
        )
        assert found.group(4) == f"{found.group(1)}/kernel_ext/example.html?conversation=ID"
        assert found.group(5) == "English labels: &lang=en"
        assert relay.err == [found.group(0)]  # the only line
        code, err = await relay.stop(signum)
    assert code == exit_code_after(signum) == {signal.SIGTERM: 143, signal.SIGINT: 130}[signum]
    assert "Traceback" not in err
    assert "Warning" not in err
    assert_stopped_cleanly(code, relay.err, "kernel-ext relay", signum, STARTUP)


def test_the_documented_startup_line_is_the_relays() -> None:
    web = (ROOT / "docs" / "web.md").read_text(encoding="utf-8").splitlines()
    (line,) = [text for text in web if text.startswith("kernel-ext relay: serving ")]
    found = re.search(STARTUP, line)
    assert found, line
    assert found.group(4) == "http://127.0.0.1:8765/kernel_ext/example.html?conversation=ID"
    assert found.group(5) == "English labels: &lang=en"


@pytest.mark.network
@pytest.mark.timeout(120)
async def test_relay_startup_line_names_the_open_mode_and_redis_without_its_password() -> None:
    redis = "redis://:hunter2@127.0.0.1:1/0"  # nothing listens there: tried at start
    async with running(
        "relay", "--port", "0", "--allow-anyone", "--redis-url", redis, "--no-page"
    ) as relay:
        found = await relay.wait_for_line(STARTUP)
        assert found.group(3) == (
            "open: without hooks every browser may join any conversation, "
            "Redis redis://:***@127.0.0.1:1/0 (unreachable: retrying, not ready until it "
            "answers), channel socketio"
        )
        assert found.group(4) is None  # --no-page
        assert found.group(5) is None
        code, err = await relay.stop(signal.SIGTERM)
    assert code == 143
    assert "hunter2" not in err


def _get(url: str) -> tuple[int, str, bytes]:
    status, headers, body = http_request(url)
    return status, headers.get("content-type", "") if status == 200 else "", body


@pytest.mark.network
@pytest.mark.timeout(120)
async def test_relay_serves_the_shipped_page_and_its_scripts_and_nothing_else() -> None:
    async with running("relay", "--port", "0", "--allow-anyone") as relay:
        url = (await relay.wait_for_line(STARTUP)).group(1)
        for name in ASSETS:
            status, kind, body = await asyncio.to_thread(_get, f"{url}/kernel_ext/{name}")
            assert status == 200, name
            assert body == asset_path(name).read_bytes(), name
            expected = {".js": "text/javascript", ".html": "text/html", ".woff2": "font/woff2"}.get(
                os.path.splitext(name)[1], "text/plain"
            )
            assert kind.startswith(expected), (name, kind)
        others = ("__init__.py", "typescript.py", "vendor/vendor.json", "fonts/font.json")
        for other in (*others, "font.py", "../cli.py", ""):
            status, _, _ = await asyncio.to_thread(_get, f"{url}/kernel_ext/{other}")
            assert status == 404, other
        await relay.stop(signal.SIGTERM)
    async with running("relay", "--port", "0", "--allow-anyone", "--no-page") as relay:
        url = (await relay.wait_for_line(STARTUP)).group(1)
        status, _, _ = await asyncio.to_thread(_get, f"{url}/kernel_ext/example.html")
        assert status == 404
        await relay.stop(signal.SIGTERM)


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", STOPS, ids=["SIGTERM", "SIGINT"])
async def test_tail_stops_on_a_signal(signum: int) -> None:
    async with running("relay", "--port", "0", "--allow-anyone") as relay:
        url = (await relay.wait_for_line(STARTUP)).group(1)
        async with running("tail", "--url", url, "--conversation", "conv-1") as tail:
            await tail.wait_for_line(r"following conversation 'conv-1'")
            code, err = await tail.stop(signum)
        assert code == exit_code_after(signum)
        assert "Traceback" not in err
        following = rf"kernel-ext tail: following conversation 'conv-1' at {url} \(.*\)"
        assert_stopped_cleanly(code, tail.err, "kernel-ext tail", signum, following)
        assert (await relay.stop(signal.SIGTERM))[0] == 143


SLOW_APP = """
import sys
import threading

sys.stderr.write("slowapp: importing\\n")
sys.stderr.flush()
threading.Event().wait()  # an application that takes its time to import: forever, here
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", STOPS, ids=["SIGTERM", "SIGINT"])
async def test_relay_stops_in_one_line_while_it_imports_its_hooks(
    tmp_path: Path, signum: int
) -> None:
    """Start-up: the signal arrives before any event loop runs, inside the import of the
    hooks' module (``python -m`` has the working directory on the path)."""
    (tmp_path / "slowapp.py").write_text(SLOW_APP, encoding="utf-8")
    hooks = ["--authenticate", "slowapp:authenticate", "--authorize-join", "slowapp:authorize"]
    async with running("relay", "--port", "0", *hooks, cwd=tmp_path) as relay:
        await relay.wait_for_line("^slowapp: importing$")
        code, _ = await relay.stop(signum)
    assert_stopped_cleanly(code, relay.err, "kernel-ext relay", signum, "slowapp: importing")


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[int, asyncio.Event]]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers: its port, and an
    event set once it has accepted one."""
    accepted = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        accepted.set()

    server = await asyncio.start_server(hold, HOST, 0)
    try:
        yield server.sockets[0].getsockname()[1], accepted
    finally:
        for writer in held:
            writer.close()
        server.close()


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", STOPS, ids=["SIGTERM", "SIGINT"])
async def test_relay_stops_in_one_line_while_it_waits_for_redis_at_start_up(signum: int) -> None:
    """Start-up: serving, but its start-up line waits for the first attempt to reach Redis
    (a Redis that never answers); the stop does not wait for it, nor print that line."""
    async with silent_server() as (port, accepted):
        redis = f"redis://{HOST}:{port}/0"
        async with running("relay", "--port", "0", *HOOKS, "--redis-url", redis) as relay:
            await asyncio.wait_for(accepted.wait(), WAIT)
            code, _ = await relay.stop(signum)
    assert_stopped_cleanly(code, relay.err, "kernel-ext relay", signum, "")


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", STOPS, ids=["SIGTERM", "SIGINT"])
async def test_relay_stops_in_one_line_with_a_browser_connected(signum: int) -> None:
    async with running("relay", "--port", "0", *HOOKS) as relay:
        port = int((await relay.wait_for_line(STARTUP)).group(2))
        browser = Browser(reconnect=False)
        try:
            await browser.connect(port, auth={"token": "token-of-alice"})
            assert await browser.join("conv-of-alice") == {"ok": True}
            code, _ = await relay.stop(signum)
        finally:
            await browser.close()
    assert_stopped_cleanly(code, relay.err, "kernel-ext relay", signum, STARTUP)


@pytest.mark.network
@pytest.mark.timeout(120)
async def test_a_closed_terminal_stops_the_relay_in_one_line_unless_nohup_ignores_it() -> None:
    async with running("relay", "--port", "0", *HOOKS) as relay:
        await relay.wait_for_line(STARTUP)
        code, _ = await relay.stop(signal.SIGHUP)
    assert_stopped_cleanly(code, relay.err, "kernel-ext relay", signal.SIGHUP, STARTUP)
    nohup = shutil.which("nohup")
    if nohup is None:
        pytest.skip("no nohup here")
    async with running("relay", "--port", "0", *HOOKS, command=[nohup, *CLI]) as relay:
        await relay.wait_for_line(STARTUP)
        relay.proc.send_signal(signal.SIGHUP)  # ignored, as nohup asks
        code, _ = await relay.stop(signal.SIGTERM)
    assert_stopped_cleanly(code, relay.err, "kernel-ext relay", signal.SIGTERM, STARTUP)


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", STOPS, ids=["SIGTERM", "SIGINT"])
async def test_tail_stops_in_one_line_while_it_connects(signum: int) -> None:
    """Start-up: a server that accepts the connection and never answers holds ``tail`` in
    its handshake."""
    async with silent_server() as (port, accepted):
        args = ["--url", f"http://{HOST}:{port}", "--conversation", "conv-1", "--timeout", "100"]
        async with running("tail", *args) as tail:
            await asyncio.wait_for(accepted.wait(), WAIT)
            code, _ = await tail.stop(signum)
    assert_stopped_cleanly(code, tail.err, "kernel-ext tail", signum, "")


# -- the app directory: the documented unit as written --------------------------------------


def unit_env() -> dict[str, str]:
    """The unit's environment file (its comment names the secret and a Redis URL; one web
    process needs no Redis): the secret, and nothing added to the import path."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_EXT_")}
    return {**base, "KERNEL_EXT_SECRET": SECRET}


async def assert_the_documented_hooks_hold(port: int) -> None:
    """docs/web.md's myapp/auth.py is the relay's: a wrong token is refused, alice's is
    accepted, and alice may join conv-1 and no other conversation."""
    intruder = Browser("intruder", reconnect=False)
    with pytest.raises(socketio.exceptions.ConnectionError):
        await intruder.connect(port, auth={"token": "wrong"})
    await intruder.close()
    alice = Browser("alice", reconnect=False)
    try:
        await alice.connect(port, auth={"token": "token-of-alice"})
        assert await alice.join("conv-1") == {"ok": True}
        assert await alice.join("conv-2") == {"ok": False, "error": "forbidden"}
    finally:
        await alice.close()
    status, _, body = await asyncio.to_thread(http_request, f"http://{HOST}:{port}/readyz")
    assert (status, json.loads(body)) == (200, {"status": "ok"})


@pytest.mark.network
@pytest.mark.timeout(120)
async def test_the_documented_unit_loads_the_hooks_from_its_working_directory(
    tmp_path: Path,
) -> None:
    """docs/deployment.md's unit as systemd runs it: the installed console script, in the
    ``WorkingDirectory`` (holding docs/web.md's myapp/auth.py), with exactly the
    ``ExecStart`` arguments; SIGTERM, systemd's stop, ends it with a status the unit counts
    as a success."""
    settings = unit()
    port = free_port()
    argv = unit_command(port)
    assert argv[0] == f"{settings['WorkingDirectory']}/venv/bin/{CONSOLE_SCRIPT.name}"
    app = write_documented_app(tmp_path / "srv-myapp")
    async with running(*argv[1:], command=[str(CONSOLE_SCRIPT)], cwd=app, env=unit_env()) as relay:
        found = await relay.wait_for_line(STARTUP)
        assert int(found.group(2)) == port
        await assert_the_documented_hooks_hold(port)
        code, _ = await relay.stop(signal.SIGTERM)
    assert_stopped_cleanly(code, relay.err, "kernel-ext relay", signal.SIGTERM, STARTUP)
    assert str(code) in settings["SuccessExitStatus"].split()


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("spelled", ["absolute", "relative"])
async def test_app_dir_names_another_directory_to_import_the_hooks_from(
    tmp_path: Path, spelled: str
) -> None:
    app = write_documented_app(tmp_path / "apps" / "myapp-1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    app_dir = str(app) if spelled == "absolute" else "../apps/myapp-1"
    port = free_port()
    args = [*unit_command(port)[1:], "--app-dir", app_dir]
    command = [str(CONSOLE_SCRIPT)]
    async with running(*args, command=command, cwd=elsewhere, env=unit_env()) as relay:
        await relay.wait_for_line(STARTUP)
        await assert_the_documented_hooks_hold(port)
        await relay.stop(signal.SIGTERM)


def test_an_app_dir_that_is_no_directory_or_lacks_the_hooks_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    argv = unit_command(0)
    hooks = argv[argv.index("--authenticate") :]
    assert hooks == [
        "--authenticate",
        "myapp.auth:authenticate",
        "--authorize-join",
        "myapp.auth:authorize_join",
    ]
    missing = tmp_path / "nowhere"
    line = one_line(kernel_ext("relay", "--port", "0", "--app-dir", str(missing), *hooks), 2)
    assert f"--app-dir '{missing}' is not a directory" in line
    line = one_line(kernel_ext("relay", "--port", "0", "--app-dir", str(tmp_path), *hooks), 2)
    not_found = "(ModuleNotFoundError: No module named 'myapp'); the app directory (--app-dir)"
    assert line.count(f"{not_found} is {tmp_path}") == 2, line
