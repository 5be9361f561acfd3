"""Admission caps: how many browsers one web process and one identity may connect, and how
many conversations one browser may hold and how fast it may join them.

:class:`Admission` is one relay's caps on its browsers (internal senders are not capped
here). It guarantees, on this web process:

* a browser connection past ``max_browsers`` browsers, or past ``max_per_identity``
  browsers of its identity, is refused (``socketio.exceptions.ConnectionRefusedError`` with a
  message and the data ``{"reason", "limit"}``, the reason ``browser_limit`` or
  ``identity_limit``);
* a join of one more conversation than ``max_browser_rooms`` is answered
  ``{"ok": false, "error": "room_limit", "limit": n}``; a join past the browser's join rate
  (a token bucket: ``join_burst`` joins at once, ``join_rate`` more per second) is answered
  ``{"ok": false, "error": "join_rate", "retryAfterMs": t}`` (the milliseconds until the next
  join would be admitted);
* every refusal is counted ``rejected_<reason>`` and on ``kernel_ext.relay.frames``, and
  logged on its 1st, 2nd, 4th … occurrence;
* a stop request past the browser's stop rate (a bucket of its own: ``stop_burst`` at
  once, ``stop_rate`` more per second; :meth:`Admission.stop`) is refused by the relay's
  stops (:mod:`kernel_ext.relay.stops`);
* what a browser holds is released when it disconnects; a conversation it leaves frees its
  slot; a new connection starts with full buckets.

A conversation is held from the join that passed these caps until the browser leaves it or
disconnects; a join the ``authorize_join`` hook then refuses gives its slot back (the caps
are checked before the hook, so a flood never reaches it). Joining a held conversation
again takes a join from the bucket, not another slot.

Identity: what the ``authenticate`` hook returned. ``True`` — what every browser of a relay
without the hook is, and what a hook that only says yes returns — is nobody in particular:
such browsers have no per-identity cap (``max_browsers`` bounds them). Any other identity
is keyed by :func:`identity_key`. ``None`` for a cap means no cap. A browser refused by a
cap has its connection closed once the refusal is queued to it (:func:`close_refused`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from kernel_ext._shared import compat as _compat
from kernel_ext.errors import check_positive_ints, check_positive_numbers
from kernel_ext.observability.count_names import (
    BROWSER_IDENTITIES,
    BROWSER_LIMIT,
    BROWSER_ROOMS,
    IDENTITY_LIMIT,
    JOIN_RATE,
    ROOM_LIMIT,
)
from kernel_ext.protocol import JOIN_EVENT

__all__ = [
    "DEFAULT_JOIN_RATE",
    "DEFAULT_MAX_BROWSERS",
    "DEFAULT_MAX_BROWSER_ROOMS",
    "DEFAULT_MAX_PER_IDENTITY",
    "DEFAULT_STOP_BURST",
    "DEFAULT_STOP_RATE",
    "Admission",
    "TokenBuckets",
    "close_refused",
    "identity_key",
]

DEFAULT_MAX_BROWSERS = 10_000
"""Browsers on one web process (about 43 KiB each: 10,000 are about 430 MiB)."""
DEFAULT_MAX_PER_IDENTITY = 64
"""Browsers of one identity on one web process (tabs, windows, devices of one user)."""
DEFAULT_MAX_BROWSER_ROOMS = 100
"""Conversations one browser holds at once (a page of the reference renderer holds one)."""
DEFAULT_JOIN_RATE = 5.0
"""Joins per second of one browser once its bucket (``join_burst``, by default
``max_browser_rooms``) is spent."""

DEFAULT_STOP_RATE = 2.0
"""Stop requests per second of one browser once its burst is spent."""
DEFAULT_STOP_BURST = 5
"""Stop requests one browser may send at once."""

Reject = Callable[[str, str, str], None]
"""``reject(sid, reason, what)``: count and rarely log a refusal (the relay's ``_reject``)."""


@dataclass(frozen=True)
class _Digest:
    """The key of an identity that is not hashable: the SHA-256 of its text."""

    text: str


def identity_key(identity: Any) -> Hashable | None:
    """The key browsers of ``identity`` are counted under: ``None`` for ``True`` (no
    per-identity cap); the identity itself when it is hashable (equal identities share a
    key: ``"alice"``, a frozen dataclass; an object without ``__eq__`` is its own); else the
    digest of its canonical JSON (keys sorted; values JSON cannot hold by their ``repr``),
    so equal dicts and lists share a key — or of its ``repr`` when it has no JSON. Never
    raises."""
    if identity is True:
        return None
    try:
        hash(identity)
    except Exception:
        pass
    else:
        return identity  # type: ignore[no-any-return]
    try:
        text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=repr)
    except Exception:  # mixed key types, a cycle, too deep
        try:
            text = "repr:" + repr(identity)
        except Exception:
            text = f"object:{type(identity).__qualname__}:{id(identity)}"
    return _Digest(hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())


class _Bucket:
    """One connection's bucket: the requests it may make now, as of ``at``."""

    __slots__ = ("at", "tokens")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens = tokens
        self.at = at


class TokenBuckets:
    """A token bucket per connection: ``burst`` requests at once, ``rate`` more per second
    (a new connection starts with a full bucket): a browser's joins and its stop requests.

    Raises:
        ConfigError: a rate that is not a positive number, a burst not a positive int.
    """

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        check_positive_numbers(rate=rate)
        check_positive_ints(burst=burst)
        self.rate = float(rate)
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, sid: str) -> int | None:
        """Take one request from the bucket of ``sid``: ``None`` when there was one, else
        the milliseconds until there is (at least 1)."""
        rate = self.rate
        now = self._clock()
        burst = self.burst
        bucket = self._buckets.get(sid)
        if bucket is None:
            bucket = self._buckets[sid] = _Bucket(float(burst), now)
        tokens = min(float(burst), bucket.tokens + max(0.0, now - bucket.at) * rate)
        bucket.at = now
        if tokens < 1.0:
            bucket.tokens = tokens
            return max(1, math.ceil((1.0 - tokens) / rate * 1000))
        bucket.tokens = tokens - 1.0
        return None

    def forget(self, sid: str) -> None:
        """Drop the bucket of ``sid`` (it disconnected)."""
        self._buckets.pop(sid, None)


class Admission:
    """The admission caps of one relay's browsers (module docstring).

    Args:
        max_browsers: browsers on this web process (``None``: no cap).
        max_per_identity: browsers of one identity on this web process (``None``: no cap).
        max_browser_rooms: conversations one browser holds at once (``None``: no cap).
        join_rate: joins per second of one browser once its bucket is spent (``None``: no
            rate).
        join_burst: joins a browser may make at once (default: ``max_browser_rooms``, or
            :data:`DEFAULT_MAX_BROWSER_ROOMS` without that cap): a renderer re-joining
            every conversation it holds after a reconnect is never refused.
        stop_rate, stop_burst: a browser's stop requests per second once ``stop_burst``
            are spent (``None``: no rate).
        reject: counts and rarely logs a refusal: ``reject(sid, reason, what)``.
        clock: seconds, monotonic (tests may pass their own).

    Raises:
        ConfigError: a cap that is not a positive int, a rate that is not a positive number.
    """

    def __init__(
        self,
        *,
        max_browsers: int | None = DEFAULT_MAX_BROWSERS,
        max_per_identity: int | None = DEFAULT_MAX_PER_IDENTITY,
        max_browser_rooms: int | None = DEFAULT_MAX_BROWSER_ROOMS,
        join_rate: float | None = DEFAULT_JOIN_RATE,
        join_burst: int | None = None,
        stop_rate: float | None = DEFAULT_STOP_RATE,
        stop_burst: int = DEFAULT_STOP_BURST,
        reject: Reject,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        caps = {
            "max_browsers": max_browsers,
            "max_per_identity": max_per_identity,
            "max_browser_rooms": max_browser_rooms,
            "join_burst": join_burst,
        }
        check_positive_ints(**{name: cap for name, cap in caps.items() if cap is not None})
        if join_rate is not None:
            check_positive_numbers(join_rate=join_rate)
        self.max_browsers = max_browsers
        self.max_per_identity = max_per_identity
        self.max_browser_rooms = max_browser_rooms
        self.join_rate = float(join_rate) if join_rate is not None else None
        self.join_burst = join_burst or max_browser_rooms or DEFAULT_MAX_BROWSER_ROOMS
        self._reject = reject
        self._clock = clock
        self._key_of: dict[str, Hashable | None] = {}  # browser (sid) -> its identity's key
        self._per_identity: dict[Hashable, int] = {}
        self._rooms: dict[str, set[str]] = {}
        self._held = 0  # conversations held, summed over the browsers
        self._buckets = (
            None if self.join_rate is None else TokenBuckets(self.join_rate, self.join_burst, clock)
        )
        self._stops = None if stop_rate is None else TokenBuckets(stop_rate, stop_burst, clock)

    def connect(self, sid: str, identity: Any) -> None:
        """Admit the browser ``sid`` of ``identity`` (authenticated), or refuse it.

        Raises:
            socketio.exceptions.ConnectionRefusedError: this process or this identity has
                its most browsers already (counted, logged rarely; nothing is held).
        """
        cap = self.max_browsers
        if cap is not None and len(self._key_of) >= cap:
            self._refuse(sid, BROWSER_LIMIT, cap, "too many browsers on this web process")
        key = identity_key(identity)
        held = 0
        if key is not None:
            try:
                held = self._per_identity.get(key, 0)
            except Exception:  # an identity whose __eq__ raises: counted on its own
                key = _Digest(f"sid:{sid}")
        cap = self.max_per_identity
        if key is not None and cap is not None and held >= cap:
            self._refuse(
                sid, IDENTITY_LIMIT, cap, "too many browsers of this identity on this web process"
            )
        self._key_of[sid] = key
        if key is not None:
            self._per_identity[key] = held + 1

    def disconnect(self, sid: str) -> None:
        """Release everything the browser ``sid`` held (nothing when it held nothing)."""
        if sid not in self._key_of:
            return
        key = self._key_of.pop(sid)
        if key is not None:
            try:
                left = self._per_identity.get(key, 0) - 1
                if left > 0:
                    self._per_identity[key] = left
                else:
                    self._per_identity.pop(key, None)
            except Exception:  # an equality that raises against a key added since
                pass
        self._held -= len(self._rooms.pop(sid, ()))
        for buckets in (self._buckets, self._stops):
            if buckets is not None:
                buckets.forget(sid)

    def join(self, sid: str, room: str) -> dict[str, Any] | None:
        """Take a slot for ``room`` and a join from the bucket of the browser ``sid``:
        ``None`` when admitted, else the join's answer (counted, logged rarely). A join the
        rooms cap refuses takes nothing from the bucket; one the rate refuses holds no
        slot."""
        rooms = self._rooms.get(sid)
        new = rooms is None or room not in rooms
        cap = self.max_browser_rooms
        if new and cap is not None and rooms is not None and len(rooms) >= cap:
            self._reject(sid, ROOM_LIMIT, JOIN_EVENT)
            return {"ok": False, "error": ROOM_LIMIT, "limit": cap}
        wait = self._take(sid)
        if wait is not None:
            self._reject(sid, JOIN_RATE, JOIN_EVENT)
            return {"ok": False, "error": JOIN_RATE, "retryAfterMs": wait}
        if new and sid in self._key_of:
            if rooms is None:
                rooms = self._rooms[sid] = set()
            rooms.add(room)
            self._held += 1
        return None

    def leave(self, sid: str, room: str) -> None:
        """Free the slot of ``room`` of the browser ``sid`` (nothing when it held none)."""
        rooms = self._rooms.get(sid)
        if rooms is not None and room in rooms:
            rooms.discard(room)
            self._held -= 1

    def sizes(self) -> dict[str, int]:
        """What the caps hold now: ``browser_identities`` (identities with a browser here,
        ``True`` not among them) and ``browser_rooms`` (conversations held, summed over the
        browsers)."""
        return {BROWSER_IDENTITIES: len(self._per_identity), BROWSER_ROOMS: self._held}

    def _take(self, sid: str) -> int | None:
        """Take one join from the bucket of ``sid``: ``None`` when there was one, else the
        milliseconds until there is (at least 1)."""
        buckets = self._buckets
        if buckets is None or sid not in self._key_of:
            return None  # no rate, or not a browser this relay admitted: nothing to hold
        return buckets.take(sid)

    def stop(self, sid: str) -> int | None:
        """Take one stop request from the stop bucket of the browser ``sid``: ``None`` when
        there was one (or there is no rate), else the milliseconds until there is."""
        buckets = self._stops
        if buckets is None or sid not in self._key_of:
            return None
        return buckets.take(sid)

    def _refuse(self, sid: str, reason: str, cap: int, message: str) -> None:
        # Imported here: kernel-ext reads this module's defaults for its options without
        # loading Socket.IO (kernel_ext.relay's lazy imports).
        from socketio.exceptions import ConnectionRefusedError

        self._reject(sid, reason, "a browser connection")
        raise ConnectionRefusedError(f"{message} (at most {cap})", {"reason": reason, "limit": cap})


def close_refused(server: Any, namespace: str, sid: str) -> asyncio.Task[None] | None:
    """Close the Engine.IO connection of a browser refused by a cap once its refusal is
    queued to it, unless another namespace of the application holds the connection: a
    refused browser would otherwise keep its connection open, and a client that opens
    more and more of them would make this process hold each one's buffers. The task that
    closes it (keep it until it is done), or ``None``."""
    manager = server.manager
    eio_sid = manager.eio_sid_from_sid(sid, namespace)
    if eio_sid is None:
        return None

    async def close() -> None:
        # Runs after the refusal's CONNECT_ERROR was queued (python-socketio queues it
        # with no await that waits, right after the connect handler raised).
        for other in list(manager.get_namespaces()):
            if other != namespace and manager.sid_from_eio_sid(eio_sid, other):
                return
        await _compat.end_connection(server.eio, eio_sid)

    return asyncio.get_running_loop().create_task(close())
