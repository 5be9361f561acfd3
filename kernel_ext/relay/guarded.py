"""Hostile packets cost a count, never a crash, a leaked connection or a log line each.

:class:`GuardedNamespace` is the python-socketio ``AsyncNamespace`` the relay builds on. It
guarantees, for whatever a client writes on the socket:

* an event whose name is not a string (``42/chat,[5]``, ``[{"a":1}]``) is dropped
  (``rejected_bad_event_name``); so is one with more or fewer arguments than its handler
  takes (``rejected_bad_arguments``), an event with no handler and a ``connect`` or
  ``disconnect`` a client sent as an ordinary event (``rejected_unknown_event``); each is
  answered with an empty acknowledgement when it asks for one;
* a ``connect`` handler that raises anything but a refusal refuses the connection
  (``rejected_connect_error``, logged rarely) instead of leaving it half-open in
  python-socketio's manager;
* a packet python-socketio or python-engineio cannot decode or dispatch (an integer of
  more than 100 digits, a long-polling body that is not Engine.IO packets, …) is counted
  (``rejected_bad_packet``), and of the tracebacks the libraries log about such packets
  only the 1st, 2nd, 4th … of each kind pass (the rest are counted
  ``suppressed_log_records``): one :class:`logging.Filter` on the server's python-socketio
  and python-engineio loggers and on ``asyncio``, installed once per logger however many
  relays a process builds, hands exactly those records to the namespace of their server;
  every other record passes untouched;
* a WebSocket frame that is no Engine.IO packet is counted and logged the same way, and
  its connection closed, by :func:`with_packet_guard` around the ASGI app
  (:func:`~kernel_ext.relay.create_app` applies it).

Every refusal is counted ``rejected_<reason>`` in the namespace's counts, on the
``kernel_ext.relay.frames`` metric (``outcome=<reason>``) and logged on its 1st, 2nd, 4th …
occurrence.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import inspect
import json
import logging
import math
import os
import weakref
from collections.abc import Awaitable, Callable, MutableMapping
from types import FrameType, TracebackType
from typing import Any

import engineio
import socketio

from kernel_ext._shared import compat
from kernel_ext.observability._rare_log import RareLog, is_rare, plural
from kernel_ext.observability.count_names import (
    BAD_ARGUMENTS,
    BAD_EVENT_NAME,
    BAD_PACKET,
    CONNECT_ERROR,
    REJECTED_PREFIX,
    SUPPRESSED_LOG_RECORDS,
    UNKNOWN_EVENT,
)
from kernel_ext.protocol import REFUSED_UNAUTHORIZED
from kernel_ext.relay._log import count_frame, logger, rare

__all__ = ["GuardedNamespace", "with_packet_guard"]


class GuardedNamespace(socketio.AsyncNamespace):  # type: ignore[misc, unused-ignore]
    """A namespace that survives hostile packets (module docstring) and counts by outcome.

    Subclasses count with :meth:`_count`, refuse with :meth:`_reject` and may say who a
    connection is (:meth:`_who`) for the log."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self._counts: collections.Counter[str] = collections.Counter()
        self._arities: dict[str, tuple[int, float]] = {}
        self._packet_log = RareLog(logger)

    def _set_server(self, server: Any) -> None:
        # python-socketio calls this from register_namespace, however the relay is mounted.
        super()._set_server(server)
        _watch_library_logs(self, server)

    def _count(self, outcome: str, n: int = 1) -> None:
        self._counts[outcome] += n

    def _reject(self, sid: str, reason: str, what: str, *, exc_info: bool = False) -> None:
        """Count and rarely log ``what`` from ``sid``, dropped for ``reason``."""
        self._count(REJECTED_PREFIX + reason)
        count_frame(reason)
        level = logging.ERROR if exc_info else logging.WARNING
        rare(
            "relay_" + reason,
            "relay: dropped %s from %s (%s)",
            what,
            sid,
            reason,
            level=level,
            exc_info=exc_info,
        )

    def count_refusal(self, who: str, reason: str, what: str) -> None:
        """Count and rarely log ``what`` from ``who`` refused for ``reason`` as the relay's own
        refusals are (``rejected_<reason>``): for the layers around it (the handshake
        turnstile)."""
        self._reject(who, reason, what)

    def _who(self, sid: str) -> str:
        """What the connection ``sid`` is, for the log."""
        return "client"

    async def trigger_event(self, event: str, *args: Any) -> Any:
        """Dispatch; an event with no handler is dropped, logged and counted, and so is a
        ``connect`` or ``disconnect`` that a client sent as an ordinary event, an event whose
        name is not a string (``bad_event_name``) and one with more or fewer arguments than
        its handler takes (``bad_arguments``). A connection whose ``on_connect`` raises
        anything but a refusal is refused (``rejected_connect_error``, logged rarely)."""
        sid = args[0] if args else "?"
        if not isinstance(event, str):  # a client may name an event 5, true or {"a": 1}
            self._reject(
                sid, BAD_EVENT_NAME, f"an event with a non-string name ({type(event).__name__})"
            )
            return None
        if event in ("connect", "disconnect"):
            forged = self._sent_by_client(event, args)
        else:
            forged = not hasattr(self, "on_" + event)
        if forged:
            self._reject(sid, UNKNOWN_EVENT, f"{self._who(sid)} event {event[:64]!r}")
            return None
        if event == "connect":
            return await self._connect(args)
        if event != "disconnect" and not self._takes(event, len(args)):
            self._reject(sid, BAD_ARGUMENTS, f"event {event!r} with {len(args) - 1} arguments")
            return None
        return await super().trigger_event(event, *args)

    async def _connect(self, args: tuple[Any, ...]) -> Any:
        """The server's own ``connect``. python-socketio handles only refusals: any other
        exception would be logged with its traceback and leave the connection half-open in
        its manager for good, so it refuses the connection instead."""
        try:
            return await super().trigger_event("connect", *args)
        except (socketio.exceptions.ConnectionRefusedError, ConnectionRefusedError):
            raise
        except Exception as exc:
            if isinstance(exc, TypeError) and not self._takes("connect", len(args)):
                raise  # python-socketio retries a legacy on_connect(sid, environ)
            sid = args[0] if args else "?"
            self._reject(sid, CONNECT_ERROR, "a connection (on_connect failed)", exc_info=True)
            raise socketio.exceptions.ConnectionRefusedError(REFUSED_UNAUTHORIZED) from None

    def _takes(self, event: str, count: int) -> bool:
        """Whether the handler of ``event`` takes ``count`` positional arguments."""
        bounds = self._arities.get(event)
        if bounds is None:  # one entry per handler name: hasattr was checked
            bounds = self._arities[event] = _positional_bounds(getattr(self, "on_" + event))
        return bounds[0] <= count <= bounds[1]

    def _sent_by_client(self, event: str, args: tuple[Any, ...]) -> bool:
        """Whether a ``connect``/``disconnect`` came from a connected client as an ordinary
        event (python-socketio dispatches those to the same handlers as its own): the
        server's own disconnect runs once the client is no longer connected, its own
        connect with the connection's WSGI/ASGI environ."""
        if not args:
            return True
        sid, server = args[0], self.server
        if event == "disconnect":
            return bool(server.manager.is_connected(sid, self.namespace))
        eio_sid = server.manager.eio_sid_from_sid(sid, self.namespace)
        return len(args) < 2 or args[1] is not server.environ.get(eio_sid)

    def _library_record(self, record: logging.LogRecord) -> bool:
        """Count a library's log record about a malformed packet (``rejected_bad_packet``)
        and say whether to keep it: the 1st, 2nd, 4th … of each kind (exception type), the
        first with its traceback, the later ones in one line; the rest are dropped
        (``suppressed_log_records``)."""
        seen, note = self._bad_packet(record.exc_info[1] if record.exc_info else None)
        if note is None:
            return False
        if seen > 1:
            record.exc_info = None
            record.exc_text = None
        record.msg = f"{record.getMessage()} [{note}]"
        record.args = ()
        return True

    def _bad_packet(self, error: BaseException | None) -> tuple[int, str | None]:
        """Count a packet the libraries refused with ``error`` (``rejected_bad_packet``):
        how many of its kind (exception type) were seen, and what to log about it — ``None``
        but on the 1st, 2nd, 4th … time (the rest count ``suppressed_log_records``)."""
        kind = type(error).__name__
        self._count(REJECTED_PREFIX + BAD_PACKET)
        count_frame(BAD_PACKET)
        seen = self._packet_log.note(kind)
        if not is_rare(seen):
            self._count(SUPPRESSED_LOG_RECORDS)
            return seen, None
        detail = str(error)[:200]
        note = f"a malformed packet from a client: {kind}: {detail}; seen {plural(seen, 'time')}"
        if seen == 1:
            note += "; logged again on the 2nd, 4th, 8th … time, without the traceback"
        return seen, note


def _positional_bounds(handler: Any) -> tuple[int, float]:
    """How many positional arguments ``handler`` takes, at least and at most."""
    try:
        parameters = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return 0, math.inf
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in parameters if p.kind in kinds]
    required = sum(p.default is inspect.Parameter.empty for p in positional)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return required, math.inf
    return required, len(positional)


# -- the libraries' log records of malformed packets --------------------------------------
#
# For a packet it cannot decode or dispatch (``42/chat,[]``, ``{}``, not JSON, an integer
# of more than 100 digits, nested past the recursion limit, an unknown packet type)
# python-socketio raises, and python-engineio logs the exception with its traceback at
# ERROR, once per packet, on the server's engineio logger ("message async handler error";
# "Unknown receive error" for its own packet types; "post request handler error" for a
# long-polling body it cannot decode: not Engine.IO packets, not UTF-8, too many packets).
# asyncio logs the same when python-socketio's event task fails on an unhashable event name
# (only when the server has decorator handlers for the namespace: the relay drops
# non-string names itself). One filter on those loggers hands exactly these records to the
# relay of their server; every other record passes untouched. A WebSocket frame that is no
# Engine.IO packet makes python-engineio raise out of the ASGI app instead:
# :func:`with_packet_guard` takes those.

_LIBRARY_MESSAGES = frozenset(
    {"message async handler error", "Unknown receive error", "post request handler error"}
)
_TASK_MESSAGE = "Task exception was never retrieved"
_SOCKETIO_DIR = os.path.dirname(socketio.__file__)
_ENGINEIO_DIR = os.path.dirname(engineio.__file__)
_JSON_DIR = os.path.dirname(json.__file__)
_BASE64_DIR, _BASE64_FILE = os.path.split(base64.__file__)
_LIBRARY_DIRS = (
    *(d + os.sep for d in (_SOCKETIO_DIR, _ENGINEIO_DIR, _JSON_DIR)),
    base64.__file__,
)
# Where a malformed packet makes the libraries raise: (directory, file) -> functions, or
# None for any function of the file.
_DECODE_SITES: dict[tuple[str, str], frozenset[str] | None] = {
    (_SOCKETIO_DIR, "packet.py"): None,
    (_SOCKETIO_DIR, "msgpack_packet.py"): None,
    (_SOCKETIO_DIR, "async_server.py"): frozenset({"_handle_eio_message", "_handle_event"}),
    (_SOCKETIO_DIR, "base_server.py"): frozenset({"_get_event_handler"}),
    (_ENGINEIO_DIR, "async_socket.py"): frozenset({"receive", "handle_post_request"}),
    (_ENGINEIO_DIR, "packet.py"): frozenset({"decode"}),
    (_ENGINEIO_DIR, "payload.py"): frozenset({"decode"}),
    (_ENGINEIO_DIR, "json.py"): frozenset({"_safe_int"}),  # an integer of over 100 digits
    (_JSON_DIR, "decoder.py"): None,
    (_JSON_DIR, "__init__.py"): None,
    (_BASE64_DIR, _BASE64_FILE): frozenset({"b64decode"}),  # a binary packet, not base64
}
# A library server (python-socketio's or its python-engineio server) -> its relay.
_RELAY_OF: weakref.WeakKeyDictionary[Any, weakref.ref[GuardedNamespace]] = (
    weakref.WeakKeyDictionary()
)


class _MalformedPacketFilter(logging.Filter):
    """Hands a library record about a malformed packet to its server's relay (which keeps
    the 1st, 2nd, 4th … of each kind); every other record passes untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        relay = _relay_of_record(record)
        return True if relay is None else relay._library_record(record)


_PACKET_FILTER = _MalformedPacketFilter()


def _watch_library_logs(relay: GuardedNamespace, server: Any) -> None:
    """Route ``server``'s records about malformed packets to ``relay`` (the first relay
    registered on a server keeps them). The one filter goes once onto each logger."""
    eio = getattr(server, "eio", None)
    for owner in (server, eio):
        with contextlib.suppress(TypeError):  # not weak-referenceable: nothing to route
            known = _RELAY_OF.get(owner)
            if known is None or known() is None:
                _RELAY_OF[owner] = weakref.ref(relay)
    for log in (getattr(server, "logger", None), getattr(eio, "logger", None)):
        if isinstance(log, logging.LoggerAdapter):
            log = log.logger
        if isinstance(log, logging.Logger):
            log.addFilter(_PACKET_FILTER)  # a no-op when it is there already
    logging.getLogger("asyncio").addFilter(_PACKET_FILTER)


def _relay_of_record(record: logging.LogRecord) -> GuardedNamespace | None:
    """The relay whose server logged ``record`` about a malformed packet, else ``None``."""
    message = record.msg
    if not record.exc_info or not isinstance(message, str):
        return None
    if message not in _LIBRARY_MESSAGES and not message.startswith(_TASK_MESSAGE):
        return None
    return _relay_of_frames(_frames(record.exc_info[2]))


def _frames(tb: TracebackType | None) -> list[FrameType]:
    frames: list[FrameType] = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _relay_of_frames(frames: list[FrameType]) -> GuardedNamespace | None:
    """The relay whose server raised through ``frames`` (a traceback's, outermost first) at
    a site where a malformed packet makes the libraries raise, else ``None``."""
    if not frames or not all(f.f_code.co_filename.startswith(_LIBRARY_DIRS) for f in frames):
        return None  # an application's or the relay's own code raised: a real error
    code = frames[-1].f_code
    site = (os.path.dirname(code.co_filename), os.path.basename(code.co_filename))
    if site not in _DECODE_SITES:
        return None
    functions = _DECODE_SITES[site]
    if functions is not None and code.co_name not in functions:
        return None
    for frame in frames:
        owner = frame.f_locals.get("self")
        for candidate in (owner, getattr(owner, "server", None)):
            try:
                ref = _RELAY_OF.get(candidate)
            except TypeError:
                continue
            relay = ref() if ref is not None else None
            if relay is not None:
                return relay
    return None


# -- WebSocket frames python-engineio cannot decode ------------------------------------------

_Scope = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_ASGIApp = Callable[[_Scope, _Receive, _Send], Awaitable[None]]


class _PacketGuard:
    """The ASGI app :func:`with_packet_guard` returns."""

    def __init__(self, app: _ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            frames = _frames(exc.__traceback__)
            # From python-engineio's ASGI app on, only library code: the guard's own frame
            # and any wrapping app's come before it.
            inside = _ENGINEIO_DIR + os.sep
            start = next(
                (i for i, f in enumerate(frames) if f.f_code.co_filename.startswith(inside)),
                len(frames),
            )
            relay = _relay_of_frames(frames[start:])
            if relay is None:
                raise
            seen, note = relay._bad_packet(exc)
            if note is not None:
                logger.error(
                    "relay: python-engineio could not decode a WebSocket frame; its connection "
                    "is closed [%s]",
                    note,
                    exc_info=exc if seen == 1 else None,
                )
            await compat.close_failing_socket(frames)


def with_packet_guard(app: _ASGIApp) -> _ASGIApp:
    """``app`` (a ``socketio.ASGIApp`` serving a relay's server, or an app around one) with
    the WebSocket frames python-engineio cannot decode (not an Engine.IO packet: ``x``, an
    empty frame, bad base64) counted ``rejected_bad_packet`` by the relay of their server
    and logged on the 1st, 2nd, 4th … time of each kind, their connection closed — instead
    of an exception out of the app, which the ASGI server logs with its traceback each time
    and whose connection python-engineio holds until its ping timeout. Every other
    exception passes unchanged. :func:`~kernel_ext.relay.create_app` applies it."""
    return _PacketGuard(app)
