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
* a packet python-socketio cannot decode or dispatch is counted (``rejected_bad_packet``),
  and of the tracebacks the libraries log about such packets only the 1st, 2nd, 4th … of
  each kind pass (the rest are counted ``suppressed_log_records``): one
  :class:`logging.Filter` on the server's python-socketio and python-engineio loggers and
  on ``asyncio``, installed once per logger however many relays a process builds, hands
  exactly those records to the namespace of their server; every other record passes
  untouched.

Every refusal is counted ``rejected_<reason>`` in the namespace's counts, on the
``kernel_ext.relay.frames`` metric (``outcome=<reason>``) and logged on its 1st, 2nd, 4th …
occurrence.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import logging
import math
import os
import weakref
from types import FrameType
from typing import Any

import engineio
import socketio

from kernel_ext._telemetry import RareLog, is_rare, plural
from kernel_ext.ledger import (
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

__all__ = ["GuardedNamespace"]


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
        error = record.exc_info[1] if record.exc_info else None
        kind = type(error).__name__
        self._count(REJECTED_PREFIX + BAD_PACKET)
        count_frame(BAD_PACKET)
        seen = self._packet_log.note(kind)
        if not is_rare(seen):
            self._count(SUPPRESSED_LOG_RECORDS)
            return False
        detail = str(error)[:200]
        note = f"a malformed packet from a client: {kind}: {detail}; seen {plural(seen, 'time')}"
        if seen == 1:
            note += "; logged again on the 2nd, 4th, 8th … time, without the traceback"
        else:
            record.exc_info = None
            record.exc_text = None
        record.msg = f"{record.getMessage()} [{note}]"
        record.args = ()
        return True


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
# For a packet it cannot decode or dispatch (``42/chat,[]``, ``{}``, not JSON, nested past
# the recursion limit, an unknown packet type) python-socketio raises, and python-engineio
# logs the exception with its traceback at ERROR, once per packet, on the server's
# engineio logger ("message async handler error"; "Unknown receive error" for its own
# packet types). asyncio logs the same when python-socketio's event task fails on an
# unhashable event name (only when the server has decorator handlers for the namespace:
# the relay drops non-string names itself). One filter on those loggers hands exactly these
# records to the relay of their server; every other record passes untouched.

_LIBRARY_MESSAGES = frozenset({"message async handler error", "Unknown receive error"})
_TASK_MESSAGE = "Task exception was never retrieved"
_SOCKETIO_DIR = os.path.dirname(socketio.__file__)
_ENGINEIO_DIR = os.path.dirname(engineio.__file__)
_JSON_DIR = os.path.dirname(json.__file__)
_LIBRARY_DIRS = tuple(d + os.sep for d in (_SOCKETIO_DIR, _ENGINEIO_DIR, _JSON_DIR))
# Where a malformed packet makes the libraries raise: (directory, file) -> functions, or
# None for any function of the file.
_DECODE_SITES: dict[tuple[str, str], frozenset[str] | None] = {
    (_SOCKETIO_DIR, "packet.py"): None,
    (_SOCKETIO_DIR, "msgpack_packet.py"): None,
    (_SOCKETIO_DIR, "async_server.py"): frozenset({"_handle_eio_message", "_handle_event"}),
    (_SOCKETIO_DIR, "base_server.py"): frozenset({"_get_event_handler"}),
    (_ENGINEIO_DIR, "async_socket.py"): frozenset({"receive"}),
    (_JSON_DIR, "decoder.py"): None,
    (_JSON_DIR, "__init__.py"): None,
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
    frames: list[FrameType] = []
    tb = record.exc_info[2]
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
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
