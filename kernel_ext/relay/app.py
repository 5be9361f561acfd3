"""A relay ready to serve: :func:`mount_relay` on an existing server, :func:`create_app`
for a whole ASGI app (what ``python -m kernel_ext.relay``, the tests and the demo serve),
with ``/healthz`` and ``/readyz`` (:mod:`kernel_ext.relay.health`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import socketio

from kernel_ext.redis.manager import RelayRedisManager
from kernel_ext.relay.guarded import with_packet_guard
from kernel_ext.relay.health import with_probes
from kernel_ext.relay.namespace import ChatRelay
from kernel_ext.relay.relay_settings import RelaySettings
from kernel_ext.relay.turnstile import (
    DEFAULT_MAX_HANDSHAKE_WAITING,
    DEFAULT_MAX_HANDSHAKES,
    HandshakeTurnstile,
    with_handshake_turnstile,
)

__all__ = ["RelayApp", "create_app", "mount_relay"]

# The options of ChatRelay that are not settings (create_app's other keywords are).
_HOOKS = ("authenticate", "authorize_join", "authorize_stop")


def mount_relay(sio: socketio.AsyncServer, secret: str, **options: Any) -> ChatRelay:
    """Register a :class:`ChatRelay` (``options`` as its constructor's: the two hooks, and
    :class:`~kernel_ext.relay.relay_settings.RelaySettings`' fields or ``settings=``) on
    ``sio``."""
    relay = ChatRelay(secret, **options)
    sio.register_namespace(relay)
    return relay


@dataclass(frozen=True)
class RelayApp:
    """A ready relay: the ASGI ``app`` to serve, its ``sio`` server, the ``relay`` and the
    ``turnstile`` its new connections pass (``turnstile.waiting``: how many wait now)."""

    app: Any
    sio: socketio.AsyncServer
    relay: ChatRelay
    turnstile: HandshakeTurnstile | None = None


def create_app(
    secret: str,
    *,
    redis_url: str | None = None,
    redis_channel: str = "socketio",
    other_asgi_app: Any = None,
    cors_allowed_origins: str | list[str] | None = None,
    max_http_buffer_size: int = 4 * 1024 * 1024,
    assets_prefix: str | None = None,
    probes: bool = True,
    max_handshakes: int | None = DEFAULT_MAX_HANDSHAKES,
    max_handshake_waiting: int | None = DEFAULT_MAX_HANDSHAKE_WAITING,
    **relay_options: Any,
) -> RelayApp:
    """An ``AsyncServer`` (Redis client manager when ``redis_url`` is given) with a
    :class:`ChatRelay` mounted, wrapped in ``socketio.ASGIApp`` — for tests and the demo.
    ``relay_options``: the relay's two hooks and its settings' fields (or ``settings=``,
    :class:`~kernel_ext.relay.relay_settings.RelaySettings`); ``worker_grace``,
    ``max_workers`` and ``max_worker_streams`` go to the Redis manager too.

    ``max_http_buffer_size`` bounds one incoming message (a whole ``kx_blocks`` frame).
    A WebSocket frame that is no Engine.IO packet is counted, not raised to the ASGI server
    (:func:`~kernel_ext.relay.with_packet_guard`).
    ``assets_prefix`` (e.g. ``"/kernel_ext"``) also serves the shipped browser files there
    (:func:`kernel_ext.web.static_files`: the example page, the renderer, the Socket.IO
    client); ``None`` serves none.

    ``probes`` (default on) answers ``GET /healthz`` and ``GET /readyz`` before anything
    else, ``other_asgi_app`` included (:func:`~kernel_ext.relay.health.with_probes`), and
    starts the Redis manager's listener at start-up; ``False`` leaves those paths to
    ``other_asgi_app`` (answer them with ``relay.readiness()``).

    ``max_handshakes`` new Engine.IO sessions are handled at once, ``max_handshake_waiting``
    more wait their turn, one more is answered ``503`` (counted
    ``rejected_handshake_limit``): :func:`~kernel_ext.relay.turnstile.with_handshake_turnstile`;
    ``max_handshakes=None`` turns it off.

    Raises:
        ConfigError: a secret shorter than 16 bytes, a Redis URL that does not parse, a bad
            relay option (:class:`ChatRelay`, :class:`RelayRedisManager`), a handshake bound
            that is not a positive int.
    """
    hooks = {key: relay_options.pop(key) for key in _HOOKS if key in relay_options}
    given = relay_options.pop("settings", None)
    settings = (
        RelaySettings(**relay_options)
        if given is None
        else dataclasses.replace(given, **relay_options)
    )
    manager = None
    if redis_url is not None:
        manager = RelayRedisManager(
            redis_url,
            channel=redis_channel,
            worker_grace=settings.worker_grace,
            max_workers=settings.max_workers,
            max_worker_streams=settings.max_worker_streams,
        )
    sio = socketio.AsyncServer(
        async_mode="asgi",
        client_manager=manager,
        cors_allowed_origins=cors_allowed_origins if cors_allowed_origins is not None else [],
        max_http_buffer_size=max_http_buffer_size,
    )
    relay = mount_relay(sio, secret, settings=settings, **hooks)
    static = None
    if assets_prefix is not None:
        from kernel_ext.web import static_files

        static = static_files(assets_prefix)
    served = socketio.ASGIApp(sio, other_asgi_app=other_asgi_app, static_files=static)
    turnstile = app = with_handshake_turnstile(
        with_packet_guard(served),
        relay,
        path=served.engineio_path,
        max_handshakes=max_handshakes,
        max_handshake_waiting=max_handshake_waiting,
    )
    return RelayApp(
        app=with_probes(app, relay) if probes else app, sio=sio, relay=relay, turnstile=turnstile
    )
