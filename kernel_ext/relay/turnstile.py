"""The handshake turnstile: new Engine.IO sessions a few at a time, the loop free in between.

:func:`with_handshake_turnstile` wraps the ASGI app that serves a relay's server
(:func:`~kernel_ext.relay.create_app` applies it). It guarantees, on this web process:

* a request that opens a new Engine.IO session — under the Engine.IO path, with no ``sid``
  in its query, WebSocket or long-polling — is handled by the app only while fewer than
  ``max_handshakes`` others are; the rest wait, first come first served, and each one
  waiting is let in on its own turn of the event loop as one before it is done (the app
  sent its first message: the WebSocket's Engine.IO open packet, the polling response, a
  refusal — or returned);
* at most ``max_handshake_waiting`` wait: one more is answered ``503 Service Unavailable``
  (with ``Retry-After: 1``; a WebSocket through the ASGI server's denial response, else
  closed before it is accepted), counted ``rejected_handshake_limit`` by the relay and
  logged on the 1st, 2nd, 4th … time;
* a request of a session that exists (its ``sid`` in the query) and everything else — the
  probes, static files, the application's own routes — pass untouched; so do clients that
  reconnect: they wait their turn, and one refused retries with its backoff;
* a slot is freed whatever the app does, raises included; a waiting request whose task is
  cancelled leaves the queue.

``None`` for a bound means no bound; ``max_handshakes=None`` turns the turnstile off.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol
from urllib.parse import parse_qs

from kernel_ext.errors import check_positive_ints
from kernel_ext.observability.count_names import HANDSHAKE_LIMIT

__all__ = [
    "DEFAULT_MAX_HANDSHAKES",
    "DEFAULT_MAX_HANDSHAKE_WAITING",
    "REFUSED_HANDSHAKE_BODY",
    "HandshakeTurnstile",
    "with_handshake_turnstile",
]

DEFAULT_MAX_HANDSHAKES = 4
"""New Engine.IO sessions one web process handles at once."""
DEFAULT_MAX_HANDSHAKE_WAITING = 1_000
"""New Engine.IO sessions that may wait for their turn (about 1 s of handshakes)."""
REFUSED_HANDSHAKE_BODY = b"too many connections being opened; retry later"
"""The body of the ``503`` answered past ``max_handshake_waiting``."""

_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]
_ASGIApp = Callable[[_Scope, _Receive, _Send], Awaitable[None]]


class _Relay(Protocol):
    """What the turnstile needs of a relay: to count and rarely log a refusal."""

    def count_refusal(self, who: str, reason: str, what: str) -> None: ...


# The messages after which a handshake is done: the app has answered it.
_ANSWERS = frozenset(
    {
        "websocket.send",
        "websocket.close",
        "websocket.http.response.body",
        "http.response.body",
    }
)
_DENIAL = "websocket.http.response"


class HandshakeTurnstile:
    """The ASGI app :func:`with_handshake_turnstile` returns; :attr:`waiting` is how many
    handshakes wait for their turn now."""

    def __init__(
        self,
        app: _ASGIApp,
        *,
        path: str,
        max_handshakes: int | None,
        max_waiting: int | None,
        relay: _Relay,
    ) -> None:
        self.app = app
        self.path = path if path.endswith("/") else path + "/"
        self.max_handshakes = max_handshakes
        self.max_waiting = max_waiting
        self._relay = relay
        self._busy = 0  # handshakes the app is handling
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Handshakes waiting for their turn now."""
        return len(self._waiting)

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if self.max_handshakes is None or not self._opens_session(scope):
            await self.app(scope, receive, send)
            return
        if not await self._enter(scope, send):
            return
        done = False

        def leave() -> None:
            nonlocal done
            if not done:
                done = True
                self._leave()

        async def answer(message: _Message) -> None:
            await send(message)
            if not done and message.get("type") in _ANSWERS and not message.get("more_body"):
                leave()

        try:
            await self.app(scope, receive, answer)
        finally:
            leave()

    def _opens_session(self, scope: _Scope) -> bool:
        """Whether ``scope`` asks for a new Engine.IO session (no ``sid`` in its query)."""
        if scope.get("type") not in ("http", "websocket"):
            return False
        path = scope.get("path")
        if not isinstance(path, str) or not (path if path.endswith("/") else path + "/").startswith(
            self.path
        ):
            return False
        query = scope.get("query_string", b"")
        if isinstance(query, bytes | bytearray):
            query = bytes(query).decode("latin-1")
        return not parse_qs(str(query)).get("sid")

    async def _enter(self, scope: _Scope, send: _Send) -> bool:
        """Take a slot, waiting for it in turn: ``False`` when refused (answered ``503``)."""
        assert self.max_handshakes is not None
        if self._busy < self.max_handshakes and not self.waiting:
            self._busy += 1
            return True
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            await self._refuse(scope, send)
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter  # _leave hands its slot over: _busy stays as it was
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._leave()  # handed a slot as it was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(waiter)
            raise
        return True

    def _leave(self) -> None:
        """Hand the slot to the first handshake still waiting, else free it."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # not cancelled meanwhile
                waiter.set_result(None)  # it runs on a later turn of the loop
                return
        self._busy -= 1

    async def _refuse(self, scope: _Scope, send: _Send) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if isinstance(client, list | tuple) else "a client"
        self._relay.count_refusal(
            who, HANDSHAKE_LIMIT, "a new connection (too many handshakes waiting)"
        )
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(REFUSED_HANDSHAKE_BODY)).encode()),
            (b"retry-after", b"1"),
        ]
        if scope["type"] == "websocket":
            if _DENIAL not in (scope.get("extensions") or {}):
                await send({"type": "websocket.close", "code": 1013})
                return
            prefix = "websocket."
        else:
            prefix = ""
        await send({"type": prefix + "http.response.start", "status": 503, "headers": headers})
        await send({"type": prefix + "http.response.body", "body": REFUSED_HANDSHAKE_BODY})


def with_handshake_turnstile(
    app: _ASGIApp,
    relay: _Relay,
    *,
    path: str = "/socket.io/",
    max_handshakes: int | None = DEFAULT_MAX_HANDSHAKES,
    max_handshake_waiting: int | None = DEFAULT_MAX_HANDSHAKE_WAITING,
) -> HandshakeTurnstile:
    """``app`` (a ``socketio.ASGIApp``, or an app around one, serving Engine.IO under
    ``path``) behind the handshake turnstile (module docstring): ``max_handshakes`` new
    sessions handled at once, ``max_handshake_waiting`` waiting, one more refused with
    ``503`` and counted by ``relay`` (the :class:`~kernel_ext.relay.ChatRelay` served).

    Raises:
        ConfigError: a bound that is not a positive int.
    """
    bounds = {"max_handshakes": max_handshakes, "max_handshake_waiting": max_handshake_waiting}
    check_positive_ints(**{name: n for name, n in bounds.items() if n is not None})
    return HandshakeTurnstile(
        app,
        path=path,
        max_handshakes=max_handshakes,
        max_waiting=max_handshake_waiting,
        relay=relay,
    )
