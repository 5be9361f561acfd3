"""Liveness and readiness over HTTP, as a container platform asks a web process.

:func:`with_probes` wraps a relay's ASGI app (:func:`~kernel_ext.relay.create_app` does,
so ``kernel-ext relay`` does) so that two paths are answered before the app sees them:

* ``GET /healthz`` (liveness): ``200 {"status": "ok"}`` whenever the event loop answers; it
  depends on nothing else (not on Redis).
* ``GET /readyz`` (readiness): ``200 {"status": "ok"}`` when the relay can do its job
  (:meth:`ChatRelay.readiness <kernel_ext.relay.ChatRelay.readiness>`), else
  ``503 {"status": "unavailable", "reasons": [...]}``.

Both are unauthenticated and say nothing secret: fixed words, no URL, no secret. The body is
JSON with ``Cache-Control: no-store``; ``HEAD`` gets the same status without a body, any
other method ``405``. Every other path goes to the wrapped app unchanged.

The wrapper also starts the relay's Redis listener
(:meth:`RelayRedisManager.start <kernel_ext.relay.RelayRedisManager.start>`) when the server
opens the ASGI lifespan scope at start-up, or at the first request when it sends no
lifespan events, so that readiness reflects Redis from the start rather than from the first
browser. Lifespan events themselves go to the wrapped app unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from kernel_ext.relay._log import rare

__all__ = ["LIVENESS_PATH", "READINESS_PATH", "Readiness", "with_probes"]

LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Readiness:
    """Whether a relay can do its job: ready when nothing stands in the way, else the
    ``reasons`` (short fixed phrases, nothing secret)."""

    reasons: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return not self.reasons

    def body(self) -> dict[str, Any]:
        """The ``/readyz`` body: ``{"status": "ok"}`` or ``{"status": "unavailable",
        "reasons": [...]}``."""
        if self.ready:
            return {"status": "ok"}
        return {"status": "unavailable", "reasons": list(self.reasons)}


class Probed(Protocol):
    """What :func:`with_probes` needs of a relay (a :class:`~kernel_ext.relay.ChatRelay`)."""

    server: Any

    def readiness(self) -> Readiness: ...


_NOT_READY = Readiness(("readiness check failed",))


class _Probes:
    """The ASGI app :func:`with_probes` returns."""

    def __init__(self, app: ASGIApp, relay: Probed) -> None:
        self.app = app
        self.relay = relay
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The lifespan scope opens as the server starts (before it listens), whatever the
        # wrapped app then does with it; without lifespan events, the first request.
        self._start()
        if scope.get("type") == "http" and scope.get("path") in (LIVENESS_PATH, READINESS_PATH):
            await self._answer(scope, send)
            return
        await self.app(scope, receive, send)

    def _start(self) -> None:
        """Start the Redis listener once, on the running loop (idempotent there too)."""
        if self._started:
            return
        self._started = True
        delivery = getattr(self.relay, "delivery", None)
        if delivery is not None:
            try:
                delivery.start()
            except Exception:
                rare("probe_start", "relay: starting the Redis listener failed", exc_info=True)

    def _readiness(self) -> Readiness:
        try:
            return self.relay.readiness()
        except Exception:
            rare("readiness", "relay: the readiness check failed", exc_info=True)
            return _NOT_READY

    async def _answer(self, scope: Scope, send: Send) -> None:
        method = scope.get("method", "GET")
        headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
        if method not in ("GET", "HEAD"):
            status, body = 405, {"status": "method not allowed"}
            headers.append((b"allow", b"GET, HEAD"))
        elif scope.get("path") == LIVENESS_PATH:
            status, body = 200, {"status": "ok"}
        else:
            readiness = self._readiness()
            status, body = (200 if readiness.ready else 503), readiness.body()
        payload = json.dumps(body, separators=(",", ":")).encode("utf-8")
        headers.append((b"content-length", str(len(payload)).encode("ascii")))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else payload})


def with_probes(app: ASGIApp, relay: Probed) -> ASGIApp:
    """``app`` with ``/healthz`` and ``/readyz`` answered first for ``relay`` (module
    docstring), for a relay mounted in your own ASGI app (:func:`~kernel_ext.relay.mount_relay`):
    ``with_probes(socketio.ASGIApp(sio, other_asgi_app=yours), relay)``. Those two paths
    then never reach ``app``; to answer them yourself, leave this out and call
    ``relay.readiness()`` in your handler."""
    return _Probes(app, relay)
