"""Every use kernel_ext makes of another library's private names, probed once at import.

Each is probed and documented here, so a release that renames one shows up in one place:

* :data:`SDK_SPAN_FIELDS`: an OpenTelemetry SDK span's attributes, context, parent and
  start time, read directly by the span processor (only where this probe passed);
* :data:`SPAN_CONTEXT_INDEXED`: ``SpanContext`` read as the tuple it is
  (:func:`sampled_trace_id` too);
* :data:`SUPPRESS_KEYS`: the context keys ``suppress_instrumentation()`` sets;
* :func:`publish_result_supported` (probed on first use): the subscriber count
  python-socketio's ``AsyncRedisManager._publish`` returns (read by
  :class:`kernel_ext.redis.publish_result.PublishResult`);
* :func:`publish_pipeline_supported` (probed on first use): a frame's ``PUBLISH`` commands
  as one pipeline on python-socketio's Redis client;
* :func:`spliced_packet_class`: python-socketio's ``Packet`` class (``socketio.packet``)
  and its ``json`` class attribute, the JSON module its ``encode`` writes with;
* :func:`meter_queues` (probed when a relay is mounted): python-engineio's queue of each
  connection's outgoing packets (made by its server's ``create_queue``, read as the socket's
  ``queue``) counted in packets and bytes (:class:`MeteredQueue`), and let go of when the
  connection closes (:func:`release_closed`, :func:`close_connection`); its ``send_packet``;
* :func:`packet_makers`: python-engineio's ``Packet`` of a ``MESSAGE`` and python-socketio's
  ``EVENT`` packet as its server's ``packet_class`` encodes it (what ``AsyncManager.emit``
  queues to each connection);
* :func:`close_failing_socket`: python-engineio's ``AsyncSocket`` whose handler raised,
  closed and dropped from its server's ``sockets``, as the handler would have;
* :func:`namespace_handler`: python-socketio's server's registry of namespace handlers
  (whether a relay is still the one its server dispatches to).

When a probe fails, the code that uses it takes the public path (slower) or reports less,
and says so: the active path is in :data:`ACTIVE` and logged at DEBUG on the
``kernel_ext.compat`` logger. ``tests/integrations/test_compat.py`` holds the contracts.

Design (why each is read): docs/contracts.md, "Other libraries' private names".
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, cast

__all__ = [
    "ACTIVE",
    "SDK_SPAN_FIELDS",
    "SPAN_CONTEXT_INDEXED",
    "SUPPRESS_KEYS",
    "MeteredQueue",
    "catch_up_packet",
    "close_connection",
    "close_failing_socket",
    "connect_redis",
    "connection_queue",
    "end_connection",
    "meter_queues",
    "namespace_handler",
    "packet_makers",
    "publish_pipeline_supported",
    "publish_result_supported",
    "queued",
    "release_closed",
    "sampled_trace_id",
    "send_packet",
    "spliced_packet_class",
]

_log = logging.getLogger("kernel_ext.compat")

ACTIVE: dict[str, str] = {}
"""Which path each private use takes in this process: ``"private"`` (the fast path the
contract tests pin) or ``"public"`` (the fallback), by name."""


def _probe_span_fields() -> bool:
    """Whether an SDK span keeps its attribute dict, context, parent and start time in the
    private fields :data:`SDK_SPAN_FIELDS` names (checked against the public properties of a
    real span)."""
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        span: Any = (
            TracerProvider(sampler=ALWAYS_ON)
            .get_tracer("kernel_ext.compat")
            .start_span("probe", attributes={"probe": "yes"})
        )
        span.end()
        attributes = span._attributes._dict
        return bool(
            attributes.__class__ is dict
            and attributes.get("probe") == "yes"
            and span._context is span.context
            and span._parent is span.parent
            and span._start_time == span.start_time
        )
    except Exception:
        return False


def _probe_span_context_indexed() -> bool:
    """Whether a ``SpanContext``'s trace id, span id and trace flags are items 0, 1 and 3
    of the tuple it is."""
    try:
        from opentelemetry.trace import SpanContext, TraceFlags

        context = SpanContext(1, 2, False, TraceFlags(1))
        return bool(context[0] == 1 and context[1] == 2 and context[3] == 1)
    except Exception:
        return False


def _probe_suppress_keys() -> tuple[str, str] | None:
    """The two context keys ``suppress_instrumentation()`` sets, when they are exactly what
    ``is_instrumentation_enabled()`` reads (checked against both, each key alone)."""
    try:
        from opentelemetry import context
        from opentelemetry.instrumentation import utils

        keys = (context._SUPPRESS_INSTRUMENTATION_KEY, utils._SUPPRESS_INSTRUMENTATION_KEY_PLAIN)
        if not all(isinstance(key, str) for key in keys):
            return None
        with utils.suppress_instrumentation():
            inside = context.get_current()
            agrees = all(inside.get(key) for key in keys) and not utils.is_instrumentation_enabled()
        for key in keys:  # each key alone suppresses
            token = context.attach(context.set_value(key, True))
            try:
                agrees = agrees and not utils.is_instrumentation_enabled()
            finally:
                context.detach(token)
        outside = context.get_current()
        if agrees and not any(outside.get(key) for key in keys):
            return keys[0], keys[1]
    except Exception:
        pass
    return None


@functools.cache
def publish_result_supported() -> bool:
    """Whether python-socketio's ``AsyncRedisManager._publish(data)`` is the coroutine
    method whose return value :class:`~kernel_ext.redis.publish_result.PublishResult`
    reports (probed on first use: only the Redis paths import python-socketio's
    managers)."""
    try:
        import socketio

        publish = socketio.AsyncRedisManager._publish
        supported = inspect.iscoroutinefunction(publish) and list(
            inspect.signature(publish).parameters
        ) == ["self", "data"]
    except Exception:
        supported = False
    ACTIVE["redis_publish_result"] = "private" if supported else "public"
    _log.debug("kernel_ext: python-socketio's Redis publish result: %s", ACTIVE)
    return supported


@functools.cache
def publish_pipeline_supported() -> bool:
    """Whether python-socketio's ``AsyncRedisManager`` keeps its client as
    :class:`~kernel_ext.redis.publish_result.PublishResult` pipelines it (``redis``,
    ``connected``, ``_redis_connect``, ``channel``, ``json``: checked on a write-only
    manager, which connects nothing until used)."""
    try:
        import socketio

        manager = socketio.AsyncRedisManager("redis://127.0.0.1:1/0", write_only=True)
        supported = (
            publish_result_supported()
            and callable(getattr(manager, "_redis_connect", None))
            and manager.connected is False
            and getattr(manager, "redis", "missing") is None
            and isinstance(manager.channel, str)
            and callable(getattr(manager.json, "dumps", None))
        )
    except Exception:
        supported = False
    ACTIVE["redis_publish_pipeline"] = "private" if supported else "public"
    _log.debug("kernel_ext: python-socketio's Redis client pipelined: %s", ACTIVE)
    return supported


def connect_redis(manager: Any) -> None:
    """Connect the publishing Redis client of python-socketio's ``AsyncRedisManager``
    ``manager`` as its own publish does, unless it is connected (its ``_redis_connect``,
    which :func:`publish_pipeline_supported` probes)."""
    if not manager.connected:
        manager._redis_connect()


SDK_SPAN_FIELDS: bool = _probe_span_fields()
"""Whether SDK spans keep ``_attributes._dict``, ``_context``, ``_parent`` and
``_start_time`` as this version does. The span processor reads exactly these fields, inline
(an attribute load each: a helper call here would cost a non-tool span a sixth more), and
only when this is true; else it takes the public properties."""

SPAN_CONTEXT_INDEXED: bool = _probe_span_context_indexed()
"""Whether ``span_context[0]``, ``[1]`` and ``[3]`` are the trace id, span id and flags."""


def _indexed_context_class() -> type:
    """``SpanContext`` when :data:`SPAN_CONTEXT_INDEXED`, else a class no context is."""
    if SPAN_CONTEXT_INDEXED:
        from opentelemetry.trace import SpanContext

        return SpanContext
    return type("_NoContext", (), {})


_SPAN_CONTEXT = _indexed_context_class()


def sampled_trace_id(context: Any) -> int:
    """The trace id of a span's ``context`` (a ``SpanContext``) when the span is sampled —
    exported to the trace backend — else ``0`` (also for no context or a malformed one)."""
    if context.__class__ is _SPAN_CONTEXT:
        fields = cast("tuple[int, int, bool, int]", context)  # the tuple it is (the probe's)
        return fields[0] if fields[3] & 1 else 0
    try:
        if not context.trace_flags.sampled:
            return 0
        trace_id = context.trace_id
    except Exception:
        return 0
    return trace_id if trace_id.__class__ is int and trace_id > 0 else 0


SUPPRESS_KEYS: tuple[str, str] | None = _probe_suppress_keys()
"""The context keys of OpenTelemetry's ``suppress_instrumentation()``, or ``None`` (then the
wrapper calls ``is_instrumentation_enabled()``)."""

ACTIVE.update(
    span_fields="private" if SDK_SPAN_FIELDS else "public",
    span_context="private" if SPAN_CONTEXT_INDEXED else "public",
    suppress_keys="private" if SUPPRESS_KEYS is not None else "public",
)
_log.debug("kernel_ext private-name paths: %s", ACTIVE)


# -- python-socketio: how a packet is written -------------------------------------------------


def spliced_packet_class(marker: type, text_of: Callable[[str], str]) -> type[Any]:
    """python-socketio's ``Packet`` class (a client's ``serializer``) whose JSON module
    writes an event ``[name, data]`` whose data is a ``marker`` (an object holding its JSON
    text as ``.text``) as ``[text_of(name),data.text]``, spliced without encoding it again;
    anything else is written by python-socketio's own JSON module (``Packet.json``)."""
    import socketio

    base: Any = socketio.packet.Packet
    json = base.json

    class SplicedJSON:
        loads = staticmethod(json.loads)

        @staticmethod
        def dumps(data: Any, **kwargs: Any) -> str:
            if data.__class__ is list and len(data) == 2 and data[1].__class__ is marker:
                spliced: Any = data[1]
                return f"[{text_of(data[0])},{spliced.text}]"
            return json.dumps(data, **kwargs)  # type: ignore[no-any-return]

    return type("SplicedPacket", (base,), {"json": SplicedJSON, "__module__": __name__})


# -- python-engineio: what one connection holds ---------------------------------------------


_CATCH_UP_CLASS: Any = None  # python-engineio's Packet, subclassed on first use


def catch_up_packet(text: str) -> Any:
    """An Engine.IO ``MESSAGE`` packet of ``text`` (an encoded Socket.IO packet) marked as a
    catch-up's (its class), to be shared by every catch-up that sends it:
    :class:`MeteredQueue` counts its bytes apart (``catch_up_bytes``)."""
    global _CATCH_UP_CLASS
    from engineio.packet import MESSAGE, Packet

    if _CATCH_UP_CLASS is None:
        _CATCH_UP_CLASS = type("CatchUpPacket", (Packet,), {"__module__": __name__})
    return _CATCH_UP_CLASS(MESSAGE, text)


class MeteredQueue(asyncio.Queue[Any]):
    """python-engineio's queue of one connection's outgoing packets (its server's
    ``create_queue`` makes it once :func:`meter_queues` ran), counting what the connection
    holds: the packets queued plus the batch its writer took last. python-engineio's writer
    (WebSocket or long-polling) takes everything queued at once and writes it before it comes
    back for more, so a batch counts until the writer comes back (:meth:`get`).

    ``packets``/``bytes``: held now (bytes: the length of a packet's text, or of its bytes;
    the writer's ``None`` is not a packet); ``catch_up_bytes``: of them, those of
    :func:`catch_up_packet`, reported to ``on_catch_up(delta)`` as they come and go;
    ``peak_packets``/``peak_bytes``: the most held at once. :meth:`below` waits until the
    connection holds less; :meth:`clear` lets everything go (the connection is gone)."""

    def __init__(self, *args: Any, on_catch_up: Any = None, **kwargs: Any) -> None:
        self.packets = 0
        self.bytes = 0
        self.catch_up_bytes = 0
        self.peak_packets = 0
        self.peak_bytes = 0
        self._on_catch_up = on_catch_up
        # The packets, bytes and catch-up bytes the writer took last.
        self._taken = self._taken_bytes = self._taken_catch_up = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        super().__init__(*args, **kwargs)

    # _put and _get run for every packet to every browser: kept to a few steps.

    def _put(self, item: Any) -> None:
        self._queue.append(item)  # type: ignore[attr-defined]
        if item is None:
            return
        data = item.data
        kind = data.__class__
        size = len(data) if kind is str or kind is bytes else 0
        self.packets = packets = self.packets + 1
        self.bytes = held = self.bytes + size
        if packets > self.peak_packets:
            self.peak_packets = packets
        if held > self.peak_bytes:
            self.peak_bytes = held
        if item.__class__ is _CATCH_UP_CLASS:
            self.catch_up_bytes += size
            if self._on_catch_up is not None:
                self._on_catch_up(size)

    def _get(self) -> Any:
        item = self._queue.popleft()  # type: ignore[attr-defined]
        if item is not None:
            data = item.data
            kind = data.__class__
            size = len(data) if kind is str or kind is bytes else 0
            self._taken += 1
            self._taken_bytes += size
            if item.__class__ is _CATCH_UP_CLASS:
                self._taken_catch_up += size
        return item

    async def get(self) -> Any:
        """The writer comes back: what it took last is written."""
        if self._taken:
            self._written()
        return await super().get()

    def _written(self) -> None:
        packets, size, catch_up = self._taken, self._taken_bytes, self._taken_catch_up
        if not packets:
            return
        self._taken = self._taken_bytes = self._taken_catch_up = 0
        self.packets -= packets
        self.bytes -= size
        if catch_up:
            self.catch_up_bytes -= catch_up
            if self._on_catch_up is not None:
                self._on_catch_up(-catch_up)
        if self._waiters:
            waiting = []
            for level in self._waiters:
                packets_below, bytes_below, waiter = level
                if waiter.done():
                    continue
                if self.packets < packets_below and self.bytes < bytes_below:
                    waiter.set_result(None)
                else:
                    waiting.append(level)
            self._waiters = waiting

    async def below(self, packets: int, nbytes: int) -> None:
        """Return once the connection holds fewer than ``packets`` packets and fewer than
        ``nbytes`` bytes."""
        if self.packets < packets and self.bytes < nbytes:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((packets, nbytes, waiter))
        await waiter

    def clear(self) -> None:
        """Let every packet go (taken out, marked done for ``join``) and count nothing held,
        the writer's last batch included; wakes every :meth:`below`."""
        while True:
            try:
                self.get_nowait()
            except asyncio.QueueEmpty:
                break
            self.task_done()
        self._written()
        if self.packets or self.bytes:  # not expected: counted in a batch already cleared
            self.packets = self.bytes = 0
        for _, _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters = []


def meter_queues(eio: Any, on_catch_up: Any = None) -> bool:
    """Make python-engineio server ``eio`` give each new connection a :class:`MeteredQueue`
    (its ``create_queue``, which each connection's socket calls once, as ``self.queue``);
    ``on_catch_up(delta)``: as :class:`MeteredQueue`. Returns whether the probe passed (an
    ``asyncio.Queue``-making ``create_queue``, and ``Socket.__init__`` reading it); where it
    did not, connections keep their plain queue and :func:`connection_queue` reports
    packets only."""
    try:
        from engineio import base_socket

        supported = "self.queue = self.server.create_queue()" in inspect.getsource(
            base_socket.BaseSocket.__init__
        ) and isinstance(eio.create_queue(), asyncio.Queue)
    except Exception:
        supported = False
    ACTIVE["engineio_queue"] = "private" if supported else "public"
    if supported:
        eio.create_queue = functools.partial(MeteredQueue, on_catch_up=on_catch_up)
    return supported


def connection_queue(eio: Any, eio_sid: str) -> Any:
    """The outgoing queue of the connection ``eio_sid`` of ``eio`` (a :class:`MeteredQueue`
    where :func:`meter_queues` ran before it connected, else python-engineio's
    ``asyncio.Queue``), or ``None`` when it is gone or closing."""
    socket = eio.sockets.get(eio_sid)
    if socket is None or socket.closing or socket.closed:
        return None
    return socket.queue


def queued(eio: Any, eio_sid: str) -> tuple[int, int]:
    """Packets and bytes the connection ``eio_sid`` holds, not yet written (bytes ``0``
    where its queue is not metered; ``(0, 0)`` when it is gone)."""
    queue = connection_queue(eio, eio_sid)
    if queue is None:
        return 0, 0
    if isinstance(queue, MeteredQueue):
        return queue.packets, queue.bytes
    return queue.qsize(), 0


def release_closed(eio: Any, eio_sid: str) -> bool:
    """When python-engineio is closing the connection ``eio_sid`` (its socket's
    ``closing``/``closed``), let go of the packets queued for it: a socket whose writer is
    stuck on a peer that never reads keeps its queue as long as the socket lives. Returns
    whether it did."""
    socket = eio.sockets.get(eio_sid)
    if socket is None or not (socket.closing or socket.closed):
        return False
    queue = socket.queue
    if isinstance(queue, MeteredQueue):
        queue.clear()
    else:
        while True:
            try:
                queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            queue.task_done()
    return True


async def close_connection(eio: Any, eio_sid: str) -> None:
    """Close the connection ``eio_sid`` of ``eio`` from the server's side without waiting
    for its queue to be written (python-engineio's ``disconnect`` waits for that, forever
    for a peer that never reads): its disconnect handlers run now, then a ``CLOSE`` packet
    is queued for it."""
    socket = eio.sockets.get(eio_sid)
    if socket is not None:
        await socket.close(wait=False, abort=False, reason=eio.reason.SERVER_DISCONNECT)


async def end_connection(eio: Any, eio_sid: str) -> None:
    """Close the connection ``eio_sid`` as :func:`close_connection` does, then end its
    writer once the ``CLOSE`` packet is written, which closes the WebSocket (python-engineio
    otherwise keeps it open until the peer closes it or sends again, or for
    ``ping_interval + ping_timeout``, 45 s by default)."""
    socket = eio.sockets.get(eio_sid)
    if socket is not None:
        await close_connection(eio, eio_sid)
        socket.queue.put_nowait(None)  # as python-engineio ends its writer


async def send_packet(eio: Any, eio_sid: str, packet: Any) -> None:
    """Queue an Engine.IO ``packet`` (already encoded) to the connection ``eio_sid``
    (python-engineio's ``send_packet``; a connection gone meanwhile is skipped)."""
    await eio.send_packet(eio_sid, packet)


def namespace_handler(server: Any, namespace: str) -> Any:
    """The handler python-socketio's ``server`` dispatches ``namespace``'s events to (its
    ``namespace_handlers`` registry, which it offers no getter for), or ``None`` (no such
    handler, or no server)."""
    handlers = getattr(server, "namespace_handlers", None) or {}
    return handlers.get(namespace)


def packet_makers() -> tuple[
    Callable[[str | bytes], Any], Callable[[Any, str, list[Any]], str | list[Any]]
]:
    """What ``AsyncManager.emit`` queues to each connection, as two makers (taken once, at
    import, by the relay's sends): python-engineio's ``MESSAGE`` packet of a text (an
    encoded Socket.IO packet, or one of its binary attachments), and python-socketio's
    ``EVENT`` packet of ``data`` (``[event, *args]``) in a namespace, encoded by a server's
    packet class (a str, or a list: the text, then binary attachments)."""
    from engineio.packet import MESSAGE, Packet
    from socketio.packet import EVENT

    def encode_event(server: Any, namespace: str, data: list[Any]) -> str | list[Any]:
        encoded: str | list[Any] = server.packet_class(
            EVENT, namespace=namespace, data=data
        ).encode()
        return encoded

    return functools.partial(Packet, MESSAGE), encode_event


async def close_failing_socket(frames: Sequence[FrameType]) -> None:
    """Close python-engineio's socket whose handler raised (as that handler would have,
    had it caught the error), found as ``self`` in one of ``frames`` (the traceback's): its
    connection's disconnect runs now, not at its ping timeout."""
    import contextlib

    from engineio.async_socket import AsyncSocket

    for frame in frames:
        socket = frame.f_locals.get("self")
        if isinstance(socket, AsyncSocket):
            with contextlib.suppress(Exception):
                await socket.queue.put(None)  # the writer task, if any, ends
                await socket.close(
                    wait=False, abort=True, reason=socket.server.reason.TRANSPORT_ERROR
                )
            if socket.server.sockets.get(socket.sid) is socket:
                del socket.server.sockets[socket.sid]
            return
