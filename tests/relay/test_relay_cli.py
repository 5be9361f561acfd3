"""``python -m kernel_ext.relay`` is not open by accident (issue 13, item 9). Real
subprocesses; the ones that start bind 127.0.0.1 and are reached with real python-socketio
clients.

* Without hooks it refuses to start (one line, exit status 2) unless ``--allow-anyone``;
  with it, it warns at start-up and any browser may join any conversation.
* A non-loopback ``--host`` without both hooks is refused even with ``--allow-anyone``.
* ``--authenticate`` / ``--authorize-join`` load ``module:function`` hooks, which the
  relay then applies; a spec that cannot be loaded is refused with a clear error.
* ``--help`` is short and shows every option's default.
* Once serving it tunes the process's garbage collector (``--gc-threshold``, by default
  1000, the start-up heap frozen; 0 leaves it as CPython sets it), as its INFO record says;
  a bad value is refused naming the option.
* Misconfiguration is caught before it starts, all at once (issue 23, part 3): a Redis URL
  that does not parse, a secret under 16 bytes (with how to make one; exactly 16 starts),
  and everything missing together in one line listing each requirement.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import socketio
from support.network import free_port
from support.relay_helpers import (
    HOOKS,
    NS,
    Browser,
    RelayProcess,
    barrier,
    block,
    frame,
    support_env,
    worker,
)

pytestmark = [pytest.mark.network, pytest.mark.timeout(120)]


def run_relay(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the relay expecting it to stop by itself (a refusal); a relay that starts
    instead is killed at the timeout and the test fails."""
    return subprocess.run(
        [sys.executable, "-m", "kernel_ext.relay", "--port", str(free_port()), *args],
        env=env or support_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def assert_refused(result: subprocess.CompletedProcess[str], *phrases: str) -> str:
    """Exit status 2, one line on stderr naming the problem, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m kernel_ext.relay: error: "), lines[0]
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    assert result.stdout == ""
    return lines[0]


class CliRelay(RelayProcess):
    """The standalone relay with the given arguments; its log goes to a file (:meth:`log`)."""

    __test__ = False

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__()
        self.args = args
        self.env = env or support_env()
        handle, name = tempfile.mkstemp(prefix="kx-relay-cli-", suffix=".log")
        os.close(handle)
        self.log_path = Path(name)

    def start(self) -> None:
        cmd = [sys.executable, "-m", "kernel_ext.relay", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


@contextlib.asynccontextmanager
async def cli_relay(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[CliRelay]:
    relay = CliRelay(*args, env=env)
    relay.start()
    try:
        await relay.wait_ready()
        yield relay
    finally:
        relay.stop()


@contextlib.contextmanager
def no_secret_env() -> Iterator[dict[str, str]]:
    env = support_env()
    env.pop("KERNEL_EXT_SECRET")
    yield env


def test_without_hooks_or_allow_anyone_it_refuses_to_start() -> None:
    line = assert_refused(run_relay(), "--allow-anyone", "--authenticate", "--authorize-join")
    assert "every browser may join any conversation" in line
    # One hook is not enough either: the other one is open.
    assert_refused(run_relay(*HOOKS[:2]), "--authorize-join", "--allow-anyone")
    assert_refused(run_relay(*HOOKS[2:]), "--authenticate", "--allow-anyone")
    with no_secret_env() as env:
        assert_refused(run_relay("--allow-anyone", env=env), "KERNEL_EXT_SECRET")


def test_a_non_loopback_host_without_hooks_is_refused_even_with_allow_anyone() -> None:
    for host in ("0.0.0.0", "::", "", "10.1.2.3", "relay.example"):
        assert_refused(
            run_relay("--host", host, "--allow-anyone"), "reachable from the network", "hooks"
        )
    assert_refused(run_relay("--host", "0.0.0.0", "--allow-anyone", *HOOKS[:2]), "network")


def test_hook_specs_that_cannot_be_loaded_are_refused_with_a_clear_error() -> None:
    for spec, problem in (
        ("no_such_module_kx:authenticate", "ModuleNotFoundError"),
        ("relay_cli_hooks:no_such_function", "AttributeError"),
        ("relay_cli_hooks", "package.module:function"),
        ("relay_cli_hooks:NOT_CALLABLE", "not callable"),
        (":authenticate", "Empty module name"),
    ):
        line = assert_refused(run_relay("--authenticate", spec, *HOOKS[2:]), problem)
        assert "--authenticate" in line
        assert repr(spec) in line


def test_help_is_short_and_shows_every_default() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kernel_ext.relay", "--help"],
        env=support_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    options = [
        "--host",
        "--port",
        "--redis-url",
        "--namespace",
        "--log-level",
        "--authenticate",
        "--authorize-join",
        "--allow-anyone",
        "--max-browsers",
        "--max-per-identity",
        "--max-browser-rooms",
        "--join-rate",
        "--max-handshakes",
        "--handshake-queue",
        "--gc-threshold",
    ]
    described = " ".join(text.split())  # argparse wraps the help texts
    for option, default in zip(
        options,
        (
            "127.0.0.1",
            "8765",
            "$KERNEL_EXT_REDIS_URL",
            "/chat",
            "warning",
            "none",
            "none",
            "off",
            "10000",
            "64",
            "100",
            "5",
            "4",
            "1000",
            "1000",
        ),
        strict=True,
    ):
        assert option in text
        assert f"(default: {default}" in described, option
    assert "Guarantees" not in text  # not the module docstring
    assert len(text.splitlines()) < 50


async def test_allow_anyone_on_loopback_starts_warns_and_any_browser_may_join() -> None:
    async with cli_relay("--allow-anyone") as relay:
        browser = Browser("anyone")
        try:
            await browser.connect(relay.port)  # no credentials at all
            assert await browser.join("any-conversation") == {"ok": True}
            async with worker(relay.port) as sender:
                ack = await sender.call(
                    "kx_blocks", frame("any-conversation", [block(1)]), namespace=NS
                )
            assert ack == {"ok": True, "accepted": 1, "rejected": 0}
            await browser.wait_for(lambda blocks: len(blocks) >= 1)
        finally:
            await browser.close()
        log = relay.log()
    assert browser.blocks == [block(1)]
    warnings = [line for line in log.splitlines() if "--allow-anyone" in line]
    assert len(warnings) == 1, log
    assert warnings[0].startswith("python -m kernel_ext.relay: warning: relay started with")
    assert "every browser may join any conversation" in warnings[0]


async def test_hooks_given_as_module_specs_are_applied() -> None:
    async with cli_relay(*HOOKS) as relay:
        for auth in (None, {"token": "wrong"}, {"token": None}):
            intruder = Browser("intruder", reconnect=False)
            with pytest.raises(socketio.exceptions.ConnectionError):
                await intruder.connect(relay.port, auth=auth)
            await intruder.close()
        alice = Browser("alice")
        try:
            await alice.connect(relay.port, auth={"token": "token-of-alice"})
            assert await alice.join("conv-of-bob") == {"ok": False, "error": "forbidden"}
            assert await alice.join("conv-of-alice") == {"ok": True}
            async with worker(relay.port) as sender:
                for room, seq in (("conv-of-bob", 1), ("conv-of-alice", 2)):
                    ack = await sender.call(
                        "kx_blocks", frame(room, [block(seq, task_id=room)]), namespace=NS
                    )
                    assert ack == {"ok": True, "accepted": 1, "rejected": 0}
            await alice.wait_for(lambda blocks: len(blocks) >= 1)
            await alice.client.call(  # a round trip: anything sent to alice before arrived
                "leave_conversation", {"conversationId": "__barrier__"}, namespace=NS
            )
        finally:
            await alice.close()
        log = relay.log()
    assert alice.blocks == [block(2, task_id="conv-of-alice")]
    assert "--allow-anyone" not in log


# -- misconfiguration caught at start, all of it at once (issue 23, part 3) -----------------


def test_a_redis_url_that_does_not_parse_is_refused_naming_it_without_its_password() -> None:
    for url, problem in (
        ("notaurl", "redis://, rediss://, unix://"),
        ("http://127.0.0.1:6379/0", "redis://, rediss://, unix://"),
        ("redis://:hunter2@127.0.0.1:notaport/0", "notaport"),
    ):
        line = assert_refused(run_relay("--allow-anyone", "--redis-url", url), problem)
        assert "--redis-url: is not a Redis URL" in line
        assert "hunter2" not in line
    env = dict(support_env(), KERNEL_EXT_REDIS_URL="redis://:hunter2@127.0.0.1:99999/0")
    line = assert_refused(run_relay("--allow-anyone", env=env), "Port out of range")
    assert "KERNEL_EXT_REDIS_URL (redis_url): is not a Redis URL" in line
    assert "redis://:***@127.0.0.1:99999/0" in line
    assert "hunter2" not in line


def test_a_secret_shorter_than_16_bytes_is_refused_with_how_to_make_one() -> None:
    for short in ("s3cret", "a" * 15, "é" * 7 + "a"):  # 15 bytes, 8 characters
        env = dict(support_env(), KERNEL_EXT_SECRET=short)
        line = assert_refused(
            run_relay("--allow-anyone", env=env),
            "KERNEL_EXT_SECRET (secret): must be at least 16 bytes (UTF-8), got ",
            'make one with: python -c "import secrets; print(secrets.token_urlsafe(32))"',
        )
        assert short not in line


async def test_a_secret_of_exactly_16_bytes_starts_the_relay() -> None:
    sixteen = "é" * 8  # 16 bytes, 8 characters
    async with (
        cli_relay("--allow-anyone", env=dict(support_env(), KERNEL_EXT_SECRET=sixteen)) as relay,
        worker(relay.port, secret=sixteen) as sender,
    ):
        ack = await sender.call("kx_blocks", frame("conv", [block(1)]), namespace=NS)
    assert ack == {"ok": True, "accepted": 1, "rejected": 0}


def test_everything_missing_at_once_is_one_line_listing_each_requirement() -> None:
    env = support_env()
    del env["KERNEL_EXT_SECRET"]
    env["KERNEL_EXT_MAX_QUEUE"] = "none"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                *[sys.executable, "-m", "kernel_ext.relay", "--port", str(port)],
                *["--redis-url", "notaurl", "--authenticate", "no_such_module_kx:f"],
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    line = assert_refused(result, "6 problems: (1) ")
    parts = line.split(": error: 6 problems: ", 1)[1]
    expected = [
        "--redis-url: is not a Redis URL",
        "KERNEL_EXT_MAX_QUEUE (max_queue):",
        "set KERNEL_EXT_SECRET to the internal senders' shared secret (at least 16 bytes; "
        'make one with: python -c "import secrets; print(secrets.token_urlsafe(32))")',
        "without --authorize-join every authenticated browser may join any conversation",
        "--authenticate 'no_such_module_kx:f' cannot be loaded",
        f"port {port} on 127.0.0.1 is in use",
    ]
    for number, phrase in enumerate(expected, 1):
        start = parts.index(f"({number}) ")
        assert phrase in parts[start:], (number, phrase, parts)
        parts = parts[start:]


async def blocks_of_a_late_joiner(relay: CliRelay) -> list[dict[str, Any]]:
    """Two blocks go to a room with nobody in it, then a browser joins: what it holds."""
    async with worker(relay.port) as sender:
        await sender.call("kx_blocks", frame("conv-late", [block(1), block(2)]), namespace=NS)
    late = Browser("late")
    try:
        await late.connect(relay.port)
        assert await late.join("conv-late") == {"ok": True}
        await barrier(late, relay.port)
        return late.blocks
    finally:
        await late.close()


async def test_no_catch_up_keeps_nothing_for_a_browser_that_joins_late() -> None:
    async with cli_relay("--allow-anyone", "--no-catch-up") as relay:
        assert await blocks_of_a_late_joiner(relay) == []


async def test_catch_up_memory_at_one_conversations_bound_starts_and_catches_up() -> None:
    async with cli_relay("--allow-anyone", "--catch-up-memory", "4") as relay:
        assert await blocks_of_a_late_joiner(relay) == [block(1), block(2)]


@pytest.mark.parametrize("value", ["3", "0", "-4", "4.5", "lots"])
def test_catch_up_memory_below_one_conversations_bound_is_refused(value: str) -> None:
    assert_refused(run_relay("--allow-anyone", "--catch-up-memory", value), "--catch-up-memory")


# -- the admission caps (issue 36, item 4): options win over their variables ---------------


async def connect_error(port: int, auth: Any = None) -> Any:
    """The ``connect_error`` data of a browser the relay refuses."""
    refused = Browser("refused", reconnect=False)
    errors: list[Any] = []
    refused.client.on("connect_error", errors.append, namespace=NS)
    try:
        with pytest.raises(socketio.exceptions.ConnectionError):
            await refused.connect(port, auth=auth)
    finally:
        await refused.close()
    assert len(errors) == 1, errors
    return errors[0]


async def test_the_caps_come_from_their_options_and_variables() -> None:
    env = dict(support_env(), KERNEL_EXT_JOIN_RATE="0.001", KERNEL_EXT_MAX_PER_IDENTITY="5")
    alice = {"token": "token-of-alice"}
    caps = ("--max-per-identity", "1", "--max-browser-rooms", "1")
    async with cli_relay(*HOOKS, *caps, env=env) as relay:
        first = Browser("alice", reconnect=False)
        try:
            await first.connect(relay.port, auth=alice)
            refused = await connect_error(relay.port, alice)
            assert refused["data"] == {"reason": "identity_limit", "limit": 1}
            assert await first.join("conv-of-alice") == {"ok": True}
            assert await first.join("conv-of-bob") == {
                "ok": False,
                "error": "room_limit",
                "limit": 1,
            }
            again = await first.join("conv-of-alice")  # its bucket: one join, then 0.001/s
            assert (again["ok"], again["error"]) == (False, "join_rate")
        finally:
            await first.close()
    env = dict(support_env(), KERNEL_EXT_MAX_BROWSERS="1")
    async with cli_relay("--allow-anyone", "--max-browsers", "2", env=env) as relay:
        two = [Browser(f"b{i}", reconnect=False) for i in range(2)]
        try:
            for browser in two:
                await browser.connect(relay.port)
            refused = await connect_error(relay.port)
            assert refused["data"] == {"reason": "browser_limit", "limit": 2}
        finally:
            for browser in two:
                await browser.close()


def test_a_bad_handshake_bound_is_refused_at_start_naming_its_option_or_variable() -> None:
    env = dict(support_env(), KERNEL_EXT_MAX_HANDSHAKE_WAITING="-1")
    line = assert_refused(
        run_relay("--allow-anyone", "--max-handshakes", "0", env=env),
        "2 problems",
        "--max-handshakes: Input should be greater than or equal to 1 (got '0')",
        "KERNEL_EXT_MAX_HANDSHAKE_WAITING (max_handshake_waiting): ",
    )
    assert "Traceback" not in line


def test_a_bad_cap_is_refused_at_start_naming_its_option_or_variable() -> None:
    env = dict(support_env(), KERNEL_EXT_JOIN_RATE="nan")
    line = assert_refused(
        run_relay("--allow-anyone", "--max-browsers", "0", "--max-browser-rooms", "2.5", env=env),
        "3 problems",
        "--max-browsers: Input should be greater than or equal to 1 (got '0')",
        "--max-browser-rooms: Input should be a valid integer",
        "KERNEL_EXT_JOIN_RATE (join_rate): ",
    )
    assert "Traceback" not in line


# -- the garbage collector of the process the command owns (issue 36, item 6) ----------------


async def gc_record(relay: CliRelay) -> str:
    """The relay's INFO record of its garbage collector, once it serves."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = [line for line in relay.log().splitlines() if "garbage collector:" in line]
        if found:
            assert len(found) == 1, relay.log()
            return found[0]
        await asyncio.sleep(0.05)  # polling the relay's log file
    raise AssertionError(relay.log())


def frozen(record: str) -> int:
    return int(record.split("garbage collector: ")[1].split()[0])


def cpython_gc() -> tuple[int, tuple[int, int, int]]:
    """What a fresh interpreter of this version has: objects frozen, thresholds (a
    Python 3.12 process may hold a few hundred frozen objects of its own: a relay left as
    CPython sets it is told from a tuned one by the start-up heap, over 10,000)."""
    out = subprocess.run(
        [sys.executable, "-c", "import gc; print(gc.get_freeze_count(), *gc.get_threshold())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    young, middle, old = (int(value) for value in out[1:])
    return int(out[0]), (young, middle, old)


async def test_by_default_it_freezes_its_heap_and_raises_the_full_collection_threshold() -> None:
    async with cli_relay("--allow-anyone", "--log-level", "info") as relay:
        record = await gc_record(relay)
    assert record.startswith("python -m kernel_ext.relay: info: garbage collector: "), record
    _, (young, middle, _) = cpython_gc()
    assert record.endswith(f" objects frozen, thresholds {young}/{middle}/1000"), record
    assert frozen(record) > 10_000, record  # the modules and the app, at least


async def test_the_gc_threshold_option_sets_the_full_collection_threshold() -> None:
    async with cli_relay("--allow-anyone", "--log-level", "info", "--gc-threshold", "1") as relay:
        record = await gc_record(relay)
    _, (young, middle, _) = cpython_gc()
    assert record.endswith(f" objects frozen, thresholds {young}/{middle}/1"), record
    assert frozen(record) > 10_000, record


async def test_gc_threshold_0_leaves_the_garbage_collector_as_cpython_sets_it() -> None:
    async with cli_relay("--allow-anyone", "--log-level", "info", "--gc-threshold", "0") as relay:
        record = await gc_record(relay)
    _, thresholds = cpython_gc()
    assert frozen(record) < 10_000, record  # not the start-up heap: as CPython leaves it
    assert record.endswith(" thresholds " + "/".join(map(str, thresholds))), record


@pytest.mark.parametrize("value", ["-1", "2.5", "lots", ""])
def test_a_bad_gc_threshold_is_refused_naming_the_option(value: str) -> None:
    line = assert_refused(run_relay("--allow-anyone", "--gc-threshold", value), "--gc-threshold")
    assert "must be a whole number, 0 (CPython's garbage collector as is) or more" in line
