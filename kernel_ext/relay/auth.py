"""Who a connection is: an internal sender (the shared secret, its worker id) or a browser
(the application's two hooks: who it is, ``authenticate``, and which conversations it may
watch, ``authorize_join``; either may be sync or async)."""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from kernel_ext.relay.workers import is_worker_id
from kernel_ext.settings import check_secret

__all__ = ["BrowserAuth", "InternalSecret", "JoinAuth", "allow_all", "call_hook", "worker_of"]


class InternalSecret:
    """The internal senders' shared secret.

    Raises:
        ConfigError: a secret that is not a string of at least
            :data:`~kernel_ext.settings.MIN_SECRET_BYTES` bytes in UTF-8
            (:func:`~kernel_ext.settings.check_secret`).
    """

    __slots__ = ("_secret",)

    def __init__(self, secret: str) -> None:
        self._secret = check_secret(secret).encode("utf-8")

    def matches(self, given: Any) -> bool:
        """Whether ``given`` is the secret, compared in constant time as bytes; any string
        (lone surrogates too) is compared, anything else does not match."""
        if not isinstance(given, str):
            return False
        return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), self._secret)


def worker_of(sid: str, auth: Mapping[str, Any]) -> str | None:
    """The worker an internal connection belongs to: its ``worker`` auth field (a string
    matching ``protocol.WORKER_ID_PATTERN``), ``sid/<sid>`` without one (never resumed:
    sids change on reconnect), ``None`` for anything else."""
    given = auth.get("worker")
    if given is None:
        return "sid/" + sid
    return given if is_worker_id(given) else None


BrowserAuth = Callable[[Any, Mapping[str, Any]], Any]
"""``authenticate(auth, environ) -> identity``: ``None``/``False`` refuses the browser;
anything else is its identity, handed to ``authorize_join``. May be async; may raise
``socketio.exceptions.ConnectionRefusedError`` for a custom message."""

JoinAuth = Callable[[Any, str], Any]
"""``authorize_join(identity, conversation_id) -> bool`` (may be async)."""


def allow_all(*args: object) -> bool:
    """A hook that accepts everything (demos and tests)."""
    return True


async def call_hook(hook: Callable[..., Any], *args: Any) -> Any:
    """``hook(*args)``, awaited when it returns an awaitable."""
    result = hook(*args)
    if inspect.isawaitable(result):
        result = await result
    return result
