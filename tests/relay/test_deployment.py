"""docs/deployment.md, run for real: its nginx configuration (TLS, WebSocket upgrade, sticky
sessions) in front of two web processes started with its systemd unit's ``ExecStart`` command,
behind a real redis-server, a worker that enables kernel_ext against one web process, and
browsers (python-socketio clients) on WebSocket and on long-polling through nginx; the probe
paths of its pod specification, asked of those web processes.

The page's blocks are taken as they are; the test only swaps what must differ on a test
machine (ports, certificate paths, the hooks module, the console script's path), and fails if
one of those strings is no longer on the page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import socketio
from support import ROOT, SUPPORT
from support.cli_helpers import unit_command
from support.network import RedisServer, free_port, http_request, need_binary, wait_listening
from support.timing import CALL_TIMEOUT, wait_until

pytestmark = [pytest.mark.network, pytest.mark.redis, pytest.mark.timeout(120)]

PAGE = ROOT / "docs" / "deployment.md"
SECRET = "deployment-test-secret"
ROOM = "conv-of-alice"  # tests/support/relay_cli_hooks.py: alice may join it
TOKEN = "token-of-alice"
NS = "/chat"


def page_block(lang: str) -> str:
    """The one fenced ``lang`` block of the deployment page."""
    text = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)
    assert len(blocks) == 1, f"deployment.md should hold one {lang} block, has {len(blocks)}"
    return blocks[0]


def swap(text: str, old: str, new: str) -> str:
    assert old in text, f"deployment.md no longer holds {old!r}: update this test with it"
    return text.replace(old, new)


def self_signed(folder: Path) -> tuple[Path, Path]:
    openssl = need_binary("openssl")
    cert, key = folder / "cert.pem", folder / "key.pem"
    request = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    subprocess.run(
        [openssl, *request, "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def relay_command(port: int) -> list[str]:
    """The unit's ExecStart with the port for ``%i``, this Python's ``kernel-ext`` and the
    tests' hooks module for ``myapp.auth`` (the unit as written, console script and working
    directory included: test_cli.py)."""
    script, *args = unit_command(port)
    assert script == "/srv/myapp/venv/bin/kernel-ext"
    line = swap(shlex.join(args), "myapp.auth:", "relay_cli_hooks:")
    return [sys.executable, "-m", "kernel_ext.cli.entry", *shlex.split(line)]


def unit_environment(redis_url: str) -> dict[str, str]:
    """The environment file the unit names, as its comment spells it."""
    unit = page_block("ini")
    assert "EnvironmentFile=" in unit
    names = set(re.findall(r"(KERNEL_EXT_[A-Z_]+)=", unit))
    assert names == {"KERNEL_EXT_SECRET", "KERNEL_EXT_REDIS_URL"}, names
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_EXT_")}
    tests_path = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))
    return {
        **base,
        "KERNEL_EXT_SECRET": SECRET,
        "KERNEL_EXT_REDIS_URL": redis_url,
        "PYTHONPATH": tests_path,
    }


def nginx_conf(folder: Path, listen: int, upstreams: tuple[int, int], sticky: bool) -> Path:
    cert, key = self_signed(folder)
    site = page_block("nginx")
    site = swap(site, "listen 443 ssl;", f"listen 127.0.0.1:{listen} ssl;")
    site = swap(site, "server 127.0.0.1:8001;", f"server 127.0.0.1:{upstreams[0]};")
    site = swap(site, "server 127.0.0.1:8002;", f"server 127.0.0.1:{upstreams[1]};")
    site = swap(site, "/etc/ssl/chat.example.com/fullchain.pem", str(cert))
    site = swap(site, "/etc/ssl/chat.example.com/privkey.pem", str(key))
    if not sticky:
        site = swap(site, "    ip_hash;", "    # (not sticky)")
    for temp in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (folder / temp).mkdir()
    conf = folder / "nginx.conf"
    conf.write_text(
        "daemon off;\nmaster_process off;\n"
        f"pid {folder / 'nginx.pid'};\nerror_log {folder / 'error.log'} warn;\n"
        "events { worker_connections 256; }\n"
        "http {\n    access_log off;\n"
        + "".join(f"    {t}_temp_path {folder / t};\n" for t in ("client_body", "proxy"))
        + "".join(f"    {t}_temp_path {folder / t};\n" for t in ("fastcgi", "uwsgi", "scgi"))
        + site
        + "}\n",
        encoding="utf-8",
    )
    return conf


@contextlib.contextmanager
def process(argv: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        argv, env=env, cwd=SUPPORT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def started(proc: subprocess.Popen[str], port: int, what: str) -> None:
    try:
        wait_listening(port, process=proc, what=what, timeout=30)
    except (RuntimeError, TimeoutError):
        proc.kill()
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{what} did not start: {err or out}")


@contextlib.contextmanager
def deployment(tmp_path: Path, sticky: bool = True) -> Iterator[tuple[int, int, int]]:
    """redis-server, two web processes (the unit's command), nginx (the page's site):
    yields (nginx port, web process 1 port, web process 2 port)."""
    nginx = need_binary("nginx")
    redis = RedisServer(need_binary("redis-server", "REDIS_SERVER"))
    redis.start()
    try:
        env = unit_environment(redis.url)
        web = (free_port(), free_port())
        listen = free_port()
        conf = nginx_conf(tmp_path, listen, web, sticky)
        with contextlib.ExitStack() as stack:
            for port in web:
                proc = stack.enter_context(process(relay_command(port), env))
                started(proc, port, f"web process on {port}")
            check = subprocess.run(
                [nginx, "-t", "-p", str(tmp_path), "-c", str(conf)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert check.returncode == 0, check.stderr
            proxy = stack.enter_context(process([nginx, "-p", str(tmp_path), "-c", str(conf)]))
            started(proxy, listen, "nginx")
            yield listen, web[0], web[1]
    finally:
        redis.stop()


class Viewer:
    """A browser's Socket.IO client through the proxy (or straight to a web process)."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.client = socketio.AsyncClient(reconnection=False, ssl_verify=False)
        self.blocks: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.client.on("tool_event_stream", self._on_block, namespace=NS)

    def _on_block(self, block: dict[str, Any]) -> None:
        self.blocks.append(block)
        self.changed.set()

    async def open(self, url: str) -> None:
        await asyncio.wait_for(
            self.client.connect(
                url,
                namespaces=[NS],
                auth={"token": TOKEN},
                transports=[self.transport],
                wait_timeout=10,
            ),
            timeout=15,
        )
        ack = await self.client.call(
            "join_conversation", {"conversationId": ROOM}, namespace=NS, timeout=10
        )
        assert ack == {"ok": True}, ack

    async def stream(self, call_id: str) -> list[dict[str, Any]]:
        """The blocks of ``call_id`` once its terminal has arrived."""

        def mine() -> list[dict[str, Any]]:
            return [b for b in self.blocks if b["callId"] == call_id]

        await wait_until(
            lambda: any(b["state"] != "running" for b in mine()),
            30,
            lambda: f"{self.transport}: {self.blocks}",
            wake=self.changed,
        )
        return mine()


@contextlib.asynccontextmanager
async def viewers(*pairs: tuple[str, str]) -> AsyncIterator[list[Viewer]]:
    opened = [Viewer(transport) for transport, _ in pairs]
    try:
        for viewer, (_, url) in zip(opened, pairs, strict=True):
            await viewer.open(url)
        yield opened
    finally:
        for viewer in opened:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(viewer.client.shutdown(), timeout=CALL_TIMEOUT)


async def run_worker(relay_url: str, call_id: str) -> None:
    """A worker that enables kernel_ext against ``relay_url`` (the page's
    KERNEL_EXT_RELAY_URL), publishes one tool call and shuts down with adisable()."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_EXT_")}
    env["KERNEL_EXT_SECRET"] = SECRET
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SUPPORT / "shutdown_worker.py"),
        "async-adisable",
        relay_url,
        ROOM,
        call_id,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    assert '"flushed": true' in out.decode(), out.decode()


@pytest.fixture(scope="module")
def sticky(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, int]]:
    """The page's deployment as it is (ports: nginx, web process 1, web process 2)."""
    with deployment(tmp_path_factory.mktemp("deployment")) as ports:
        yield ports


async def test_the_page_s_deployment_carries_a_call_to_browsers_on_both_transports(
    sticky: tuple[int, int, int],
) -> None:
    proxy, web1, web2 = sticky
    public = f"https://127.0.0.1:{proxy}"
    async with viewers(
        ("websocket", public),
        ("polling", public),
        ("websocket", f"http://127.0.0.1:{web2}"),  # the other web process, via Redis
    ) as (ws, polling, other):
        for call_id, web in (("0000000000000d01", web1), ("0000000000000d02", web2)):
            await run_worker(f"http://127.0.0.1:{web}", call_id)
            for viewer in (ws, polling, other):
                stream = await viewer.stream(call_id)
                assert [b["state"] for b in stream] == ["running", "done"], viewer.transport
                assert stream[-1]["envelope"]["payload"] == {"text": "the final answer"}
        assert ws.client.transport() == "websocket"  # the upgrade went through nginx
        assert polling.client.transport() == "polling"


async def test_a_browser_the_relay_s_hooks_refuse_is_refused_through_the_proxy(
    sticky: tuple[int, int, int],
) -> None:
    proxy = sticky[0]
    client = socketio.AsyncClient(reconnection=False, ssl_verify=False)
    with pytest.raises(socketio.exceptions.ConnectionError):
        await asyncio.wait_for(
            client.connect(
                f"https://127.0.0.1:{proxy}",
                namespaces=[NS],
                auth={"token": "not-a-session"},
                transports=["websocket"],
                wait_timeout=10,
            ),
            timeout=15,
        )
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.shutdown(), timeout=CALL_TIMEOUT)


async def test_long_polling_needs_the_sticky_upstream_the_page_configures(
    tmp_path: Path,
) -> None:
    """The page's "Sticky sessions" claim: without ``ip_hash`` nginx spreads one polling
    session's requests over both web processes, and the session fails; WebSocket-only
    browsers are unaffected."""
    with deployment(tmp_path, sticky=False) as (proxy, _, _):
        public = f"https://127.0.0.1:{proxy}"
        polling = Viewer("polling")
        with pytest.raises((socketio.exceptions.ConnectionError, TimeoutError)):
            await polling.open(public)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(polling.client.shutdown(), timeout=CALL_TIMEOUT)
        async with viewers(("websocket", public), ("websocket", public)) as opened:
            assert all(v.client.connected for v in opened)


async def test_the_pod_s_probe_paths_answer_on_the_page_s_web_processes(
    sticky: tuple[int, int, int],
) -> None:
    pod = page_block("yaml")
    probes = dict(re.findall(r"^ +(\w+Probe):\n +httpGet:\n +path: (\S+)\n", pod, re.M))
    assert probes == {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}, pod
    for web in sticky[1:]:
        for path in probes.values():
            status, _, body = await asyncio.to_thread(http_request, f"http://127.0.0.1:{web}{path}")
            assert (status, json.loads(body)) == (200, {"status": "ok"}), (web, path)


def page_number(pattern: str) -> int:
    """The number ``pattern``'s one group matches in the page's nginx block."""
    found = re.findall(pattern, page_block("nginx"))
    assert len(found) == 1, f"deployment.md's nginx block should hold {pattern!r} once"
    return int(found[0])


async def test_the_page_s_caps_per_client_address_refuse_past_their_bounds(
    tmp_path: Path,
) -> None:
    """The page's "Caps at the proxy": while ``limit_conn`` WebSockets from one address are
    open the next is refused with 429; new sessions past the ``limit_req`` bucket are
    refused with 429, and admitted again once it refills. A deployment of its own: the
    test spends the shared one's bucket."""
    connections = page_number(r"limit_conn kx_conn (\d+);")
    burst = page_number(r"limit_req zone=kx_sessions burst=(\d+) nodelay;")
    assert "limit_conn_status 429;" in page_block("nginx")
    assert "limit_req_status 429;" in page_block("nginx")
    with deployment(tmp_path) as (proxy, _, _):
        public = f"https://127.0.0.1:{proxy}/socket.io/?EIO=4"
        async with aiohttp.ClientSession() as session:
            async with contextlib.AsyncExitStack() as held:
                for _ in range(connections):
                    ws = await held.enter_async_context(
                        session.ws_connect(
                            f"{public}&transport=websocket",
                            ssl=False,
                            timeout=aiohttp.ClientWSTimeout(15),
                        )
                    )
                    opening = await ws.receive(timeout=15)
                    assert str(opening.data).startswith("0{"), opening
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(f"{public}&transport=websocket", ssl=False)
                assert refused.value.status == 429

            async def new_session() -> int:
                async with session.get(f"{public}&transport=polling", ssl=False) as answer:
                    await answer.read()
                    return answer.status

            statuses = [await new_session() for _ in range(2 * burst)]
            assert statuses[0] == 200
            assert 429 in statuses, statuses
            assert set(statuses) == {200, 429}

            async def admitted_again() -> bool:
                return await new_session() == 200

            await wait_until(admitted_again, 30, "no new session admitted again", interval=0.2)
