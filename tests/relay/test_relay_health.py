"""Health and readiness of a relay (issue 23, part 2), over real HTTP.

* ``/healthz`` answers 200 ``{"status": "ok"}`` whatever Redis does; ``/readyz`` answers 200
  only when the relay can do its job — its namespace mounted, its Redis manager subscribed —
  else 503 with the reasons. Neither says anything secret (no secret, no Redis password).
* They work on ``create_app`` (also when the application passes its own
  ``other_asgi_app``, whose paths still reach it; ``probes=False`` leaves those two to it),
  on a relay mounted in the application's own server (``with_probes``), and on
  ``kernel-ext relay``.
* Readiness follows a real redis-server: ready while it runs, not ready once it is stopped,
  ready again when it comes back on the same port; a relay started while nothing listens
  there starts, says so at WARNING with its retry schedule, and turns ready when Redis
  comes (which it logs at INFO).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import socketio
import uvicorn
from support.cli_helpers import SECRET as CLI_SECRET
from support.cli_helpers import STARTUP, running
from support.network import RedisServer, free_port, http_request, need_binary, serve_asgi, started
from support.relay_helpers import SECRET
from support.timing import wait_until

from kernel_ext.relay import ChatRelay, RelayRedisManager, create_app, mount_relay, with_probes

pytestmark = [pytest.mark.timeout(120)]

OK = {"status": "ok"}
UNREACHABLE = {"status": "unavailable", "reasons": ["redis unreachable"]}
PASSWORD = "hunter2-redis-password"


async def probe(url: str, method: str = "GET") -> tuple[int, Any]:
    """``method url``: the status and the JSON body (``None`` when empty)."""
    status, headers, body = await asyncio.to_thread(http_request, url, method)
    if body:
        assert headers["content-type"] == "application/json", headers
        assert headers["cache-control"] == "no-store", headers
    return status, json.loads(body) if body else None


async def wait_for_probe(url: str, expected: tuple[int, Any], timeout: float = 30.0) -> None:
    seen: list[tuple[int, Any]] = []

    async def answers() -> bool:
        seen.append(await probe(url))
        return seen[-1] == expected

    await wait_until(answers, timeout, lambda: f"{url}: {seen[-3:]}", interval=0.1)


async def own_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The application's own ASGI app: answers every path with ``own <path>``."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": f"own {scope['path']}".encode()})


@contextlib.contextmanager
def redis_server(password: str | None = None) -> Iterator[RedisServer]:
    """A redis-server, not started yet (its port free: nothing listens there)."""
    server = RedisServer(need_binary("redis-server", "REDIS_SERVER"), password=password)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


# -- what readiness says -----------------------------------------------------------------


def test_a_relay_is_ready_only_when_it_is_its_servers_handler_of_its_namespace() -> None:
    relay = ChatRelay(SECRET)
    assert relay.readiness().body() == {
        "status": "unavailable",
        "reasons": ["namespace /chat not mounted"],
    }
    sio = socketio.AsyncServer(async_mode="asgi")
    mount_relay(sio, SECRET)  # another relay takes /chat
    sio.register_namespace(relay)
    assert relay.readiness().ready
    sio.register_namespace(ChatRelay(SECRET))  # and now a third one
    assert relay.readiness().reasons == ("namespace /chat not mounted",)


def test_a_relay_on_a_redis_manager_that_does_not_listen_yet_is_not_ready() -> None:
    manager = RelayRedisManager(f"redis://127.0.0.1:{free_port()}/0")
    sio = socketio.AsyncServer(async_mode="asgi", client_manager=manager)
    relay = mount_relay(sio, SECRET)
    assert manager.redis_state == "idle"
    assert relay.readiness().body() == {
        "status": "unavailable",
        "reasons": ["redis listener not started"],
    }


@pytest.mark.network
async def test_a_redis_that_never_answers_is_connecting_until_the_connect_timeout() -> None:
    """A real TCP peer that accepts and never answers (what a frozen Redis looks like to a
    new connection): connecting first, unreachable once ``connect_timeout`` has passed."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        manager = RelayRedisManager(
            f"redis://127.0.0.1:{silent.getsockname()[1]}/0", connect_timeout=0.5
        )
        relay = mount_relay(socketio.AsyncServer(async_mode="asgi", client_manager=manager), SECRET)
        manager.start()
        listener = manager.thread  # python-socketio's listener task
        manager.start()
        manager.initialize()  # what the server calls at its first connection
        assert manager.thread is listener  # one listener
        assert relay.readiness().reasons == ("redis connecting",)
        assert await manager.tried(10) == "unreachable"
        assert relay.readiness().reasons == ("redis unreachable",)
        assert manager.counts["redis_unreachable"] >= 1
        await relay.aclose()


# -- the probes over HTTP ----------------------------------------------------------------


@pytest.mark.network
async def test_probes_answer_before_the_applications_own_app_which_gets_every_other_path() -> None:
    ready = create_app(SECRET, other_asgi_app=own_app)
    async with serve_asgi(ready.app) as port:
        base = f"http://127.0.0.1:{port}"
        assert await probe(f"{base}/healthz") == (200, OK)
        assert await probe(f"{base}/readyz") == (200, OK)
        assert await probe(f"{base}/healthz", "HEAD") == (200, None)
        assert await probe(f"{base}/readyz", "HEAD") == (200, None)
        for method in ("POST", "PUT", "DELETE"):
            assert await probe(f"{base}/readyz", method) == (405, {"status": "method not allowed"})
        for path in ("/readyz/", "/healthz/x", "/ready", "/"):
            status, _, body = await asyncio.to_thread(http_request, base + path)
            assert (status, body) == (200, f"own {path}".encode()), path
    leaves = create_app(SECRET, other_asgi_app=own_app, probes=False)
    async with serve_asgi(leaves.app) as port:
        for path in ("/healthz", "/readyz"):
            status, _, body = await asyncio.to_thread(
                http_request, f"http://127.0.0.1:{port}{path}"
            )
            assert (status, body) == (200, f"own {path}".encode()), path


@pytest.mark.network
async def test_with_probes_serves_a_relay_mounted_in_the_applications_own_server() -> None:
    sio = socketio.AsyncServer(async_mode="asgi")
    relay = mount_relay(sio, SECRET)
    app = with_probes(socketio.ASGIApp(sio, other_asgi_app=own_app), relay)
    async with serve_asgi(app) as port:
        assert await probe(f"http://127.0.0.1:{port}/readyz") == (200, OK)
    unmounted = ChatRelay(SECRET, namespace="/elsewhere")  # never registered
    app = with_probes(socketio.ASGIApp(sio), unmounted)
    async with serve_asgi(app) as port:
        base = f"http://127.0.0.1:{port}"
        assert await probe(f"{base}/readyz") == (
            503,
            {"status": "unavailable", "reasons": ["namespace /elsewhere not mounted"]},
        )
        assert await probe(f"{base}/healthz") == (200, OK)


@pytest.mark.network
@pytest.mark.redis
async def test_readiness_follows_redis_going_and_coming_back_liveness_does_not() -> None:
    with redis_server() as redis:  # not started: nothing listens on its port
        ready = create_app(SECRET, redis_url=redis.url)
        manager = ready.sio.manager
        assert isinstance(manager, RelayRedisManager)
        async with serve_asgi(ready.app) as port:  # no lifespan: the first request starts it
            base = f"http://127.0.0.1:{port}"
            assert await probe(f"{base}/healthz") == (200, OK)
            await wait_for_probe(f"{base}/readyz", (503, UNREACHABLE))
            assert await probe(f"{base}/healthz") == (200, OK)
            await asyncio.to_thread(redis.start)
            await wait_for_probe(f"{base}/readyz", (200, OK))
            await asyncio.to_thread(redis.stop)
            await wait_for_probe(f"{base}/readyz", (503, UNREACHABLE))
            assert await probe(f"{base}/healthz") == (200, OK)
            await asyncio.to_thread(redis.start)
            await wait_for_probe(f"{base}/readyz", (200, OK))
        assert manager.counts["redis_unreachable"] >= 2
        await ready.relay.aclose()


@pytest.mark.network
@pytest.mark.redis
async def test_the_app_starts_listening_to_redis_at_lifespan_start_up() -> None:
    with redis_server() as redis:
        await asyncio.to_thread(redis.start)
        ready = create_app(SECRET, redis_url=redis.url, other_asgi_app=own_app)
        manager = ready.sio.manager
        assert isinstance(manager, RelayRedisManager)
        started("network")
        config = uvicorn.Config(
            ready.app, host="127.0.0.1", port=free_port(), log_level="warning", lifespan="on"
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        try:
            # No request at all: the lifespan start-up alone started the listener.
            assert await manager.tried(10) == "connected"
            assert ready.relay.readiness().ready
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 20)
            await ready.relay.aclose()


# -- kernel-ext relay --------------------------------------------------------------------


def relay_on(redis_url: str) -> tuple[str, ...]:
    """``kernel-ext relay`` on ``redis_url``; ``--log-level info``: the recovery is at INFO."""
    return (
        "relay",
        "--port",
        "0",
        "--allow-anyone",
        "--redis-url",
        redis_url,
        "--log-level",
        "info",
    )


@pytest.mark.network
@pytest.mark.redis
async def test_kernel_ext_relay_readiness_follows_a_real_redis_and_says_nothing_secret() -> None:
    with redis_server(password=PASSWORD) as redis:
        await asyncio.to_thread(redis.start)
        async with running(*relay_on(redis.url)) as relay:
            found = await relay.wait_for_line(STARTUP)
            assert "(connected), channel socketio" in found.group(3)
            base = found.group(1)
            answers = [await probe(f"{base}/readyz"), await probe(f"{base}/healthz")]
            assert answers == [(200, OK), (200, OK)]
            await asyncio.to_thread(redis.stop)
            await wait_for_probe(f"{base}/readyz", (503, UNREACHABLE))
            answers.append(await probe(f"{base}/healthz"))
            assert answers[-1] == (200, OK)
            await asyncio.to_thread(redis.start)
            await wait_for_probe(f"{base}/readyz", (200, OK))
            code, err = await relay.stop(signal.SIGTERM)
        assert code == 143
        for text in [json.dumps(answer) for answer in answers] + [err]:
            assert PASSWORD not in text
            assert CLI_SECRET not in text
        assert "does not answer" in err
        assert "answers again" in err


@pytest.mark.network
@pytest.mark.redis
async def test_kernel_ext_relay_starts_without_redis_warns_with_its_schedule_and_turns_ready() -> (
    None
):
    with redis_server() as redis:  # not started: nothing listens on its port
        async with running(*relay_on(redis.url)) as relay:
            warning = await relay.wait_for_line(r"^kernel-ext relay: warning: relay: Redis at ")
            assert re.search(
                rf"Redis at redis://127\.0\.0\.1:{redis.port}/0 does not answer \(.+\); "
                r"retrying \(0\.5 s between attempts, doubling up to 5 s\) until it does, "
                r"not ready until then",
                warning.string,
            ), warning.string
            found = await relay.wait_for_line(STARTUP)
            assert found.group(3).endswith(
                f"Redis {redis.url} (unreachable: retrying, not ready until it answers), "
                "channel socketio"
            )
            base = found.group(1)
            assert await probe(f"{base}/readyz") == (503, UNREACHABLE)
            assert await probe(f"{base}/healthz") == (200, OK)
            await asyncio.to_thread(redis.start)
            await wait_for_probe(f"{base}/readyz", (200, OK))
            code, err = await relay.stop(signal.SIGTERM)
        assert code == 143
        assert f"kernel-ext relay: info: relay: Redis at {redis.url} answers again (after " in err
        assert "Traceback" not in err
