"""OpenTelemetry metrics of kernel_ext (opentelemetry-api only; a no-op without an SDK).

Instruments (names are stable; they are what operators chart):

* ``kernel_ext.blocks`` (counter): blocks by ``outcome`` (``admitted`` | ``delivered`` |
  ``dropped`` | ``degraded``, :mod:`kernel_ext.stream.block_counts`) and, for drops, ``reason``
  (``throttled``, ``closed``, ``duplicate_terminal``, ``unattributed``, ``no_sender``,
  ``disconnected``, ``invalid``, ``too_large``, ``queue_full`` …).
* ``kernel_ext.resolutions`` (counter): callId resolutions by ``path``
  (``context`` | ``near_match`` | ``ambiguous`` | ``none``).
* ``kernel_ext.stops`` (counter): stop requests by ``answer`` (``stopping`` |
  ``already_ended`` | ``unknown`` | ``refused``: :func:`kernel_ext.stop_call`).
* ``kernel_ext.tap.evictions`` (counter): live calls evicted from a full tap.
* ``kernel_ext.relay.frames`` (counter): frames seen by the relay by ``outcome``.
* ``kernel_ext.sender.events`` (counter): what a sender went through, by ``sender``
  (``loopback`` | ``redis``) and ``event`` (``connects``, ``disconnects``,
  ``connect_failures``, ``ack_timeouts``, ``terminal_resends``, ``terminals_degraded``,
  ``outages``, ``heartbeats`` …): the same counts as the sender's ``counts``.

The instruments are module attributes; callers add to them where a failure cannot reach
tool code (the OpenTelemetry API's ``add`` does not raise).
"""

from __future__ import annotations

from opentelemetry import metrics

__all__ = [
    "METER_NAME",
    "blocks",
    "evictions",
    "relay_frames",
    "resolutions",
    "sender_events",
    "stops",
]

METER_NAME = "kernel_ext"

_meter = metrics.get_meter(METER_NAME)

blocks = _meter.create_counter(
    "kernel_ext.blocks",
    unit="{block}",
    description="tool_event_stream blocks by outcome and reason",
)
resolutions = _meter.create_counter(
    "kernel_ext.resolutions", unit="{resolution}", description="callId resolutions by path"
)
stops = _meter.create_counter(
    "kernel_ext.stops",
    unit="{request}",
    description="stop requests for one tool call, by answer (kernel_ext.stop_call)",
)
evictions = _meter.create_counter(
    "kernel_ext.tap.evictions",
    unit="{call}",
    description="live tool calls evicted from a full tap",
)
relay_frames = _meter.create_counter(
    "kernel_ext.relay.frames", unit="{frame}", description="frames seen by the relay by outcome"
)
sender_events = _meter.create_counter(
    "kernel_ext.sender.events",
    unit="{event}",
    description="what the senders went through (disconnects, ack timeouts, re-sends …)",
)
