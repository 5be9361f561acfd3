"""What internal senders and browsers send the relay, parsed and checked: no I/O.

A ``kx_blocks`` frame is ``{"v": 1, "room", "blocks": [...]}`` (one room) or ``{"v": 1,
"rooms": [{"room", "blocks": [...]}, ...]}`` (several, in order); each block is checked by
the protocol's one rule and size measure (:func:`kernel_ext.protocol.check_block`); a
``kx_chat_event`` is ``{room, event}``; a join or a leave names a ``conversationId``; a
``kx_hello`` may announce the sender's open streams (:func:`announced`). Each function
returns what is wrong as text, or the parsed value: the namespace counts and answers
(:class:`~kernel_ext.relay.namespace.ChatRelay`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from kernel_ext.errors import BlockTooLargeError, DecodeError
from kernel_ext.protocol import (
    CALL_ID_PATTERN,
    MAX_CONVERSATION_ID_CHARS,
    MAX_TASK_ID_CHARS,
    check_block,
    is_well_formed,
)
from kernel_ext.relay.replay import MAX_SEQ

__all__ = [
    "ROOM_MAX",
    "Announced",
    "Sections",
    "ValidSections",
    "announced",
    "block_json",
    "chat_event_of",
    "checked_sections",
    "room_and_call",
    "room_of",
    "sections",
]

ROOM_MAX = 512
"""Characters a room (a conversation id) has at most."""

Sections = list[tuple[str, list[Any]]]
"""A frame's (room, blocks) sections, in order."""
ValidSections = list[tuple[str, list[tuple[Any, bytes]]]]
"""A frame's sections with only their valid blocks, each with its compact JSON."""
Announced = tuple[str, str, str, int]
"""An open stream a sender announced: ``(room, callId, taskId, seq)``."""

_CALL_ID = re.compile(CALL_ID_PATTERN)


def sections(data: Any, max_frame_blocks: int) -> Sections | str:
    """A frame's (room, blocks) sections in order, or what is wrong with it."""
    if not isinstance(data, Mapping) or data.get("v") != 1:
        return "a frame is {v: 1, room, blocks} or {v: 1, rooms: [{room, blocks}, ...]}"
    if "rooms" in data:
        entries = data.get("rooms")
        if not isinstance(entries, list) or not entries:
            return "rooms must be a non-empty list of {room, blocks}"
        if len(entries) > max_frame_blocks:
            return f"more than {max_frame_blocks} rooms in a frame"
    else:
        entries = [data]
    found: Sections = []
    for entry in entries:
        room = entry.get("room") if isinstance(entry, Mapping) else None
        if not isinstance(room, str) or not room or len(room) > ROOM_MAX:
            return "room must be a non-empty string"
        blocks = entry.get("blocks")
        if not isinstance(blocks, list):
            return "blocks must be a list"
        found.append((room, blocks))
    return found


def block_json(raw: Any, max_block_bytes: int) -> str | bytes:
    """The block's compact JSON when ``raw`` is a valid block within the size bound (the
    protocol's one measure, :func:`kernel_ext.protocol.block_size`; the catch-up memory
    holds that JSON, encoded once here), else the reason it is refused."""
    if not isinstance(raw, Mapping):
        return "invalid"
    try:
        return check_block(raw, max_bytes=max_block_bytes)
    except BlockTooLargeError:
        return "too_large"
    except (DecodeError, TypeError, ValueError, RecursionError):
        return "invalid"


def checked_sections(
    found: Sections, check: Callable[[Any], str | bytes | None]
) -> tuple[ValidSections, list[dict[str, Any]]]:
    """A frame's sections with only their valid blocks, each with its compact JSON
    (``check``: :func:`block_json` or a relay's own); and the refused ones (``index`` over
    the whole frame, and the reason), in frame order."""
    valid: ValidSections = []
    refused: list[dict[str, Any]] = []
    index = 0
    for room, blocks in found:
        kept: list[tuple[Any, bytes]] = []
        for raw in blocks:
            checked = check(raw)
            if isinstance(checked, bytes):
                kept.append((raw, checked))
            else:
                refused.append({"index": index, "reason": checked})
            index += 1
        valid.append((room, kept))
    return valid, refused


def chat_event_of(data: Any) -> tuple[str, dict[str, Any]] | None:
    """A ``kx_chat_event`` frame's room and event, or ``None`` when it is not
    ``{room, event}``."""
    room = data.get("room") if isinstance(data, Mapping) else None
    event = data.get("event") if isinstance(data, Mapping) else None
    if not isinstance(room, str) or not room or not isinstance(event, Mapping):
        return None
    return room, dict(event)


def room_of(data: Any) -> str | None:
    """The room a join or a leave names (its ``conversationId``), or ``None``."""
    if not isinstance(data, Mapping):
        return None
    room = data.get("conversationId")
    if not isinstance(room, str) or not room or len(room) > ROOM_MAX:
        return None
    return room


def room_and_call(room: Any, call_id: Any) -> tuple[str, str] | None:
    """``(room, call_id)`` when ``room`` is a conversation id a relay takes (a non-empty
    string of at most :data:`~kernel_ext.protocol.MAX_CONVERSATION_ID_CHARS` characters
    that UTF-8 can encode: no lone surrogate) and ``call_id`` a callId (16 lower-case hex
    digits), else ``None``."""
    if not isinstance(room, str) or not room or len(room) > MAX_CONVERSATION_ID_CHARS:
        return None
    if not isinstance(call_id, str) or len(call_id) != 16 or not _CALL_ID.fullmatch(call_id):
        return None
    return (room, call_id) if is_well_formed(room) else None


def announced(data: Mapping[str, Any], max_entries: int) -> tuple[list[Announced], int]:
    """The open streams a ``kx_hello`` announces (``open``: a list of ``{room, callId,
    taskId, seq}``, newest first) in that order, and how many entries are ignored: one
    that is not such a mapping (a room and a callId as :func:`room_and_call` takes them,
    a ``taskId`` of 1 to :data:`~kernel_ext.protocol.MAX_TASK_ID_CHARS` characters that
    UTF-8 can encode, a ``seq`` an integer from 0 to
    :data:`~kernel_ext.relay.replay.MAX_SEQ`, not a bool), each entry
    past the first ``max_entries``, and ``open`` itself when it is there but not a list.
    No ``open``: nothing announced (a sender older than the announcement)."""
    entries = data.get("open")
    if entries is None:
        return [], 0
    if not isinstance(entries, list):
        return [], 1
    found: list[Announced] = []
    for entry in entries[:max_entries]:
        if not isinstance(entry, Mapping):
            continue
        pair = room_and_call(entry.get("room"), entry.get("callId"))
        task_id, seq = entry.get("taskId"), entry.get("seq")
        if (
            pair is None
            or not isinstance(task_id, str)
            or not 0 < len(task_id) <= MAX_TASK_ID_CHARS
            or not is_well_formed(task_id)
            or seq.__class__ is not int
            or not 0 <= seq <= MAX_SEQ
        ):
            continue
        found.append((*pair, task_id, seq))
    return found, len(entries) - len(found)
