"""Every use kernel_ext makes of another library's private names, probed once at import.

kernel_ext reads a few things that other libraries do not expose publicly, each for a
measured reason. They all live here, so a release that renames one shows up in one place:

* **OpenTelemetry SDK spans** (:data:`SPAN_FIELDS`): the span processor reads an SDK span's
  attribute dict and its context, parent and start time directly (``_attributes._dict``,
  ``_context``, ``_parent``, ``_start_time``) instead of through the public properties,
  which build a new ``MappingProxyType`` per access and cost about 1 µs of the processor's
  2 µs budget per tool span (``benchmarks/bench_attribution.py``).
* **``SpanContext`` as a tuple** (:data:`SPAN_CONTEXT_INDEXED`): its span id is item 1 of the
  tuple it is; indexing saves the ``span_id`` property's Python call.
* **python-socketio's Redis publish** (:class:`PublishResult`, probed on first use):
  ``AsyncRedisManager._publish`` returns what Redis's ``PUBLISH`` returned (the number of
  subscribers that received the message), which is how a sender or a relay learns that a
  publish failed or reached no web process; python-socketio itself only logs a failure.
  ``_publish`` receives the pub/sub message as a dict, so an ``emit`` can carry keys of
  kernel_ext's own (a Redis sender's worker id).

Each probe runs once, here, at import. When a probe fails the code that uses it takes the
public path (slower) or reports less, and says so: the active path is in :data:`ACTIVE`
and logged at DEBUG on the ``kernel_ext.compat`` logger. ``tests/test_compat.py`` holds the
contracts: on the versions the test environment pins they FAIL rather than fall back, and
pyproject caps ``opentelemetry-sdk`` and ``python-socketio`` below the next releases until
those contracts have passed on them.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import Any

__all__ = [
    "ACTIVE",
    "SPAN_CONTEXT_INDEXED",
    "SPAN_FIELDS",
    "PublishResult",
    "publish_result_supported",
]

_log = logging.getLogger("kernel_ext.compat")

SpanFields = Callable[[Any], tuple[Any, Any, Any, Any]]

ACTIVE: dict[str, str] = {}
"""Which path each private use takes in this process: ``"private"`` (the fast path the
contract tests pin) or ``"public"`` (the fallback), by name."""


def _probe_span_fields() -> SpanFields | None:
    """``span -> (attribute dict, context, parent, start time)`` when an SDK span keeps them
    where this expects (checked against the public properties of a real span), else
    ``None``."""
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        span: Any = (
            TracerProvider(sampler=ALWAYS_ON)
            .get_tracer("kernel_ext.compat")
            .start_span("probe", attributes={"probe": "yes"})
        )
        span.end()
        read = attrgetter("_attributes._dict", "_context", "_parent", "_start_time")
        attributes, context, parent, start_time = read(span)
        if (
            attributes.__class__ is dict
            and attributes.get("probe") == "yes"
            and context is span.context
            and parent is span.parent
            and start_time == span.start_time
        ):
            return read
    except Exception:
        pass
    return None


def _probe_span_context_indexed() -> bool:
    """Whether a ``SpanContext``'s span id is item 1 of the tuple it is."""
    try:
        from opentelemetry.trace import SpanContext

        return bool(SpanContext(1, 2, False)[1] == 2)
    except Exception:
        return False


@functools.cache
def publish_result_supported() -> bool:
    """Whether python-socketio's ``AsyncRedisManager._publish(data)`` is the coroutine
    method whose return value :class:`PublishResult` reports (probed on first use: only the
    Redis paths import python-socketio's managers)."""
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


class PublishResult:
    """A mixin for python-socketio's ``AsyncRedisManager`` (listed first among the bases):
    after each publish, :attr:`last_receivers` is Redis's receiver count, or ``None`` when
    the publish failed (python-socketio only logs that). Where the probe failed
    (:func:`publish_result_supported` is false), it stays ``None``: callers treat every
    publish as unconfirmed.

    :attr:`emit_tags`, when set, are added to every ``emit`` message it publishes (the
    pub/sub message ``_publish`` receives); python-socketio's managers ignore keys they do
    not know."""

    last_receivers: int | None = None
    emit_tags: Mapping[str, Any] | None = None

    async def _publish(self, data: Any) -> Any:
        tags = self.emit_tags
        if tags and isinstance(data, dict) and data.get("method") == "emit":
            data.update(tags)
        result = await super()._publish(data)  # type: ignore[misc]
        supported = publish_result_supported()
        self.last_receivers = result if supported and isinstance(result, int) else None
        return result


SPAN_FIELDS: SpanFields | None = _probe_span_fields()
"""``span -> (attribute dict, context, parent, start time)`` of an SDK span, one C-level
call; ``None`` when SDK spans are laid out differently (use the public properties)."""

SPAN_CONTEXT_INDEXED: bool = _probe_span_context_indexed()
"""Whether ``span_context[1]`` is the span id."""

ACTIVE.update(
    span_fields="private" if SPAN_FIELDS is not None else "public",
    span_context="private" if SPAN_CONTEXT_INDEXED else "public",
)
_log.debug("kernel_ext private-name paths: %s", ACTIVE)
