"""The process-wide hub and the module-level publishing functions tool code calls."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kernel_ext.stream.hub import PublishItem, PublishState, StreamHub

__all__ = ["get_default_hub", "publish", "publish_chat_event", "set_default_hub"]

_default_hub: StreamHub | None = None
_default_lock = threading.Lock()


def get_default_hub() -> StreamHub:
    """The process-wide hub (made on first use with the defaults)."""
    global _default_hub
    hub = _default_hub
    if hub is None:
        with _default_lock:
            if _default_hub is None:
                _default_hub = StreamHub()
            hub = _default_hub
    return hub


def set_default_hub(hub: StreamHub | None) -> StreamHub | None:
    """Install ``hub`` as the process-wide hub (``None``: a fresh default on next use);
    returns the previous one."""
    global _default_hub
    with _default_lock:
        previous, _default_hub = _default_hub, hub
    return previous


# The same parameters as StreamHub.publish, written out on purpose: tool authors read this
# signature, and a forwarding *args/**kwargs would cost the hot path.
def publish(
    item: PublishItem,
    *,
    task_id: str | None = None,
    state: PublishState = "running",
    conversation_id: str | None = None,
    tool_name: str = "ask_colleague",
    provisional: bool = False,
) -> None:
    """Publish one block through the default hub (:meth:`StreamHub.publish`).

    ``item``: an :class:`~kernel_ext.protocol.Envelope` or envelope mapping (passed
    through; a mapping is validated off the hot path, invalid → dropped, counted
    ``invalid``), or a ``str`` (running → pseudo-envelope text, done → ``payload.text``,
    aborted → ``payload.message``), or a :class:`~kernel_ext.stream.Progress` (running
    only: a ``progress`` envelope with the stream's seq). ``task_id`` ``None`` → the
    callId. ``provisional`` (``done``/``aborted`` only): the stream's terminal if its call
    ends before anything else ends the stream. Never raises, never blocks.
    """
    hub = _default_hub
    if hub is None:
        hub = get_default_hub()
    # Positionally: a keyword call costs this path more per event.
    hub.publish(item, task_id, state, conversation_id, tool_name, provisional)


def publish_chat_event(event: Mapping[str, Any], *, conversation_id: str | None = None) -> None:
    """Queue the kernel's ``chat_event`` snapshot through the default hub
    (:meth:`StreamHub.publish_chat_event`). Never raises."""
    hub = _default_hub
    if hub is None:
        hub = get_default_hub()
    hub.publish_chat_event(event, conversation_id=conversation_id)
