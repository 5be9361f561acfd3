"""The detail-pane reducer: the spec's rendering semantics as plain data.

The Python twin of ``kernel_ext/web/renderer.js``; both pass the conformance vectors in
``tests/vectors`` (format: ``tests/vectors/README.md``). It is the one truth for
``kernel-ext tail`` and for tests of the producer side.

Guarantees:

* Panes by ``callId``, and within a pane tasks by ``taskId``, each in order of first
  appearance; a task's items are ordered by ``envelope.seq`` whatever the arrival order (a
  repeated seq: the first wins); blocks may arrive before their snapshot.
* A task's first terminal ends it; every later block of that task is dropped.
* Bad input never raises: it is dropped and counted.
* Nothing here builds markup; every string is kept as the peer sent it.

The semantics in full (final answers, "no process details", orphans, catch-up, the trace
id): docs/contracts.md, "The detail-pane reducer".
"""

from __future__ import annotations

import bisect
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote, urlsplit

__all__ = [
    "DEFAULT_TIMEOUT_MS",
    "DROP_REASONS",
    "LABELS",
    "MAX_JOIN_STREAMS",
    "Applied",
    "Final",
    "Item",
    "Outcome",
    "Pane",
    "PaneMode",
    "PaneStatus",
    "PaneStore",
    "Task",
    "Terminal",
    "final_word",
    "labels_for",
    "missing_text",
    "trace_url",
]

DEFAULT_TIMEOUT_MS = 15_000
"""How long a pane without any block waits before it says "no process details"."""

MAX_JOIN_STREAMS = 1_000
"""A join names at most this many streams: the cursors of ``have`` (the relay reads no
more) and the entries of the acknowledgement's ``replay.missing`` that are read. Same as
``MAX_JOIN_STREAMS`` in ``web/renderer.js``."""

_MAX_COUNT = 2**53 - 1  # counts and cursors every JSON reader holds exactly

PaneMode = Literal["live", "replay"]

PaneStatus = Literal["calling", "streaming", "ended", "no_details"]
Terminal = Literal["done", "aborted", "stopped"]
"""How a stream ended: ``done``, ``aborted`` (failed) or ``stopped`` (the user stopped it)."""
Outcome = Literal[
    "item",
    "terminal",
    "orphan",
    "snapshot",
    "mode",
    "missing",
    "duplicate",
    "afterEnd",
    "invalid",
    "unattributed",
    "ignoredSnapshot",
]
DROP_REASONS: tuple[str, ...] = (
    "invalid",
    "duplicate",
    "afterEnd",
    "unattributed",
    "ignoredSnapshot",
    "ignoredAck",
)
"""The keys of :attr:`PaneStore.dropped`: why an input changed nothing (the vectors'
``dropped``)."""
_STATES = frozenset({"running", "done", "aborted"})
_TOOL_NAME_KEYS = ("name", "tool", "toolName")

LABELS: dict[str, dict[str, str]] = {
    "zh": {
        "calling": "调用中…",
        "streaming": "进行中",
        "ended": "已结束",
        "noDetails": "无过程详情",
        "thinking": "思考中…",
        "toolStart": "开始",
        "final": "最终回复",
        "aborted": "已中止",
        "stopped": "已停止",
        "task": "任务",
        "unknownKind": "未知类型",
        "unattributed": "未关联调用",
        "replay": "同步中…",
        "live": "实时",
        "missing": "{n} 条较早的内容已不可用",
        "missingOne": "1 条较早的内容已不可用",
        "stop": "停止",
        "stopCall": "停止这次调用",
        "stopping": "正在停止…",
        "stopAlreadyEnded": "调用已经结束",
        "stopUnknown": "未知的调用",
        "stopRefused": "你无权停止这次调用",
        "stopUnreachable": "无法联系到执行调用的进程",
        "stopOffline": "未连接：停止请求没有发出",
        "stopFailed": "停止请求没有得到可用的回应",
    },
    "en": {
        "calling": "Calling…",
        "streaming": "Running",
        "ended": "Ended",
        "noDetails": "No process details",
        "thinking": "Thinking…",
        "toolStart": "started",
        "final": "Final answer",
        "aborted": "Aborted",
        "stopped": "Stopped",
        "task": "Task",
        "unknownKind": "Unknown kind",
        "unattributed": "Unattributed call",
        "replay": "Catching up…",
        "live": "Live",
        "missing": "{n} earlier blocks are no longer available",
        "missingOne": "1 earlier block is no longer available",
        "stop": "Stop",
        "stopCall": "Stop this call",
        "stopping": "Stopping…",
        "stopAlreadyEnded": "The call had already ended",
        "stopUnknown": "Unknown call",
        "stopRefused": "You may not stop this call",
        "stopUnreachable": "No worker reachable",
        "stopOffline": "Not connected: the stop was not sent",
        "stopFailed": "No usable answer to the stop request",
    },
}
"""The pane's words; Chinese (the spec's) by default, English available. Same keys and
texts as ``LABELS`` in ``web/renderer.js``."""


def labels_for(locale: str = "zh") -> dict[str, str]:
    """The label set for ``locale`` (``"zh"`` or ``"en"``); an unknown locale gets ``"zh"``."""
    return dict(LABELS.get(locale, LABELS["zh"]))


def final_word(labels: Mapping[str, str], source: str) -> str:
    """The label a final answer is shown under, by its ``source``: ``aborted`` (failed) and
    ``stopped`` (stopped by the user) each their own, anything else "final answer". Same as
    ``finalLabel`` in ``web/renderer.js``."""
    if source == "aborted":
        return labels["aborted"]
    if source == "stopped":
        return labels["stopped"]
    return labels["final"]


def missing_text(labels: Mapping[str, str], count: int) -> str:
    """The words of the notice for ``count`` blocks a task will never get."""
    if count == 1:
        return labels["missingOne"]
    return labels["missing"].replace("{n}", str(count))


@dataclass(frozen=True, slots=True)
class Item:
    """One rendered block of a task: ``kind`` is ``thinking``, ``tool_call``, ``text``,
    ``tool_output_append``, ``progress`` or ``other`` (an unknown envelope kind, named in
    ``envelope_kind``). ``text`` is the payload's text (``None`` for ``tool_call``, and for
    ``other`` without a string ``payload.text``; for ``progress`` its ``message``, else its
    ``text``, else ``None``); ``tool`` the tool name of a ``tool_call``; ``progress`` and
    ``total`` a ``progress`` item's numbers (``None`` when not a finite number)."""

    kind: str
    seq: int
    text: str | None = None
    tool: str | None = None
    envelope_kind: str | None = None
    progress: float | None = None
    total: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The item in the vector format."""
        if self.kind == "thinking":
            return {"kind": "thinking", "seq": self.seq, "text": self.text, "folded": True}
        if self.kind == "tool_call":
            return {"kind": "tool_call", "seq": self.seq, "tool": self.tool}
        if self.kind == "progress":
            return {
                "kind": "progress",
                "seq": self.seq,
                "progress": self.progress,
                "total": self.total,
                "text": self.text,
            }
        if self.kind == "other":
            return {
                "kind": "other",
                "envelopeKind": self.envelope_kind,
                "seq": self.seq,
                "text": self.text,
            }
        return {"kind": self.kind, "seq": self.seq, "text": self.text}


@dataclass(frozen=True, slots=True)
class Final:
    """A final answer: ``source`` is ``done``, ``aborted`` (failed), ``stopped`` (an
    ``aborted`` terminal whose ``payload.stopped`` is true: the user stopped the call) or
    ``toolReturn``."""

    source: Literal["done", "aborted", "stopped", "toolReturn"]
    text: str
    task_id: str | None

    def to_json(self) -> dict[str, Any]:
        """The final answer in the vector format."""
        return {"from": self.source, "taskId": self.task_id, "text": self.text}


@dataclass(slots=True)
class Task:
    """One stream of a pane: the blocks of one (callId, taskId), ordered by seq."""

    task_id: str
    items: list[Item] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    outcome: Terminal | None = None
    final_text: str | None = None
    terminal_seq: int | None = None
    missing: int = 0
    """Blocks of this stream the relay could no longer send (the acks' ``replay.missing``)."""

    @property
    def ended(self) -> bool:
        """Whether the task's terminal has arrived."""
        return self.outcome is not None

    @property
    def last_seq(self) -> int:
        """The highest seq this task holds, its items' and its terminal's."""
        last = self.seqs[-1] if self.seqs else -1
        return max(last, -1 if self.terminal_seq is None else self.terminal_seq)

    def insert(self, item: Item) -> bool:
        """Insert ``item`` in seq order; ``False`` (and no change) if its seq is taken."""
        index = bisect.bisect_left(self.seqs, item.seq)
        if index < len(self.seqs) and self.seqs[index] == item.seq:
            return False
        self.seqs.insert(index, item.seq)
        self.items.insert(index, item)
        return True

    def to_json(self) -> dict[str, Any]:
        """The task in the vector format."""
        return {
            "taskId": self.task_id,
            "ended": self.ended,
            "outcome": self.outcome,
            "final": self.final_text,
            "missing": self.missing,
            "items": [item.to_json() for item in self.items],
        }


@dataclass(slots=True)
class Pane:
    """The detail pane of one tool call."""

    call_id: str
    opened_at: float
    tool: str | None = None
    returned: bool = False
    return_text: str | None = None
    timed_out: bool = False
    tasks: dict[str, Task] = field(default_factory=dict)
    last_final: Final | None = None
    mode: PaneMode = "live"
    """``"replay"`` while a join catches up (:meth:`PaneStore.begin_replay`), else ``"live"``."""
    trace_id: str | None = None
    """The call's trace id: that of the first block applied to the pane that carries a valid
    ``traceId`` (32 lower-case hex digits, not all zeros), else ``None``."""

    @property
    def status(self) -> PaneStatus:
        """``streaming`` while a task is open, ``ended`` once every task has its terminal,
        ``no_details`` without tasks after the tool returned or the timeout, else
        ``calling``."""
        if self.tasks:
            if all(task.ended for task in self.tasks.values()):
                return "ended"
            return "streaming"
        if self.returned or self.timed_out:
            return "no_details"
        return "calling"

    @property
    def final(self) -> Final | None:
        """The pinned final answer: the latest terminal's, else the tool's return value's."""
        if self.last_final is not None:
            return self.last_final
        if self.return_text is not None:
            return Final("toolReturn", self.return_text, None)
        return None

    def to_json(self) -> dict[str, Any]:
        """The pane in the vector format."""
        final = self.final
        return {
            "callId": self.call_id,
            "traceId": self.trace_id,
            "mode": self.mode,
            "tool": self.tool,
            "status": self.status,
            "returned": self.returned,
            "final": final.to_json() if final is not None else None,
            "tasks": [task.to_json() for task in self.tasks.values()],
        }


@dataclass(frozen=True, slots=True)
class Applied:
    """What one input did: ``outcome`` says which rule applied; ``item`` is the new item
    (outcome ``item``), ``final`` the new final answer (``terminal``/``orphan``/a snapshot
    carrying the tool's return); ``new_pane``/``new_task`` say whether this input opened
    them. :meth:`PaneStore.end_replay` reports ``mode`` (the pane of ``call_id`` changed
    its mode) and ``missing`` (the task learnt of blocks it will never get)."""

    outcome: Outcome
    call_id: str | None = None
    task_id: str | None = None
    item: Item | None = None
    final: Final | None = None
    new_pane: bool = False
    new_task: bool = False


@dataclass(frozen=True, slots=True)
class _Parsed:
    call_id: str | None
    task_id: str
    state: str
    kind: str
    seq: int
    payload: Mapping[str, Any]
    trace_id: str | None


_SPAN_ID = re.compile(r"[0-9a-f]{16}")
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_NO_TRACE_ID = "0" * 32
_CONTROLS_AND_SPACE = "".join(map(chr, range(0x21)))
_TAB_AND_BREAKS = str.maketrans("", "", "\t\n\r")
# What stays as it is in an address trace_url returns; anything else (spaces, quotes, angle
# brackets, backquotes, braces, non-ASCII) is percent-encoded.
_URL_SAFE = "!#$%&'()*+,-./:;=?@[]_~"


def _trace_id_of(value: object) -> str | None:
    if isinstance(value, str) and _TRACE_ID.fullmatch(value) and value != _NO_TRACE_ID:
        return value
    return None


def trace_url(template: object, trace_id: object, span_id: object) -> str | None:
    """The address of a call's span in a trace backend: ``template`` with ``{traceId}`` and
    ``{spanId}`` replaced by the ids, or ``None`` — when the template is not a string, the
    trace id is not 32 lower-case hex digits (all zeros is none), the span id (the callId)
    not 16, or the result is not an absolute ``http:`` or ``https:`` URL with a host. The
    rule of the browser renderer's ``traceUrl``; characters that do not belong in an
    address (spaces, quotes, angle brackets, …) come back percent-encoded."""
    if not isinstance(template, str) or _trace_id_of(trace_id) is None:
        return None
    if not (isinstance(span_id, str) and _SPAN_ID.fullmatch(span_id)):
        return None
    assert isinstance(trace_id, str)
    url = template.replace("{traceId}", trace_id).replace("{spanId}", span_id)
    # As a browser reads an address: without the controls and spaces around it, and
    # without tabs and line breaks anywhere.
    url = url.strip(_CONTROLS_AND_SPACE).translate(_TAB_AND_BREAKS)
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return None
    if parts.scheme.lower() not in ("http", "https") or not host:
        return None
    return quote(url, safe=_URL_SAFE)


def _seq_of(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _count_of(value: object) -> int | None:
    """A block count of the acknowledgement: an integer 1 .. 2**53 - 1 (an integral float
    too, as JavaScript reads one), else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 < value <= _MAX_COUNT:
        return value
    return None


def _as_mapping(value: object) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


def _parse(block: object) -> _Parsed | None:
    data = _as_mapping(block)
    if data is None:
        return None
    call_id = data.get("callId")
    task_id = data.get("taskId")
    state = data.get("state")
    envelope = _as_mapping(data.get("envelope"))
    if "callId" not in data or not (call_id is None or (isinstance(call_id, str) and call_id)):
        return None
    if not (isinstance(task_id, str) and task_id) or state not in _STATES or envelope is None:
        return None
    kind = envelope.get("kind")
    seq = _seq_of(envelope.get("seq"))
    if not (isinstance(kind, str) and kind) or seq is None:
        return None
    payload = _as_mapping(envelope.get("payload")) or {}
    trace_id = None if call_id is None else _trace_id_of(data.get("traceId"))
    return _Parsed(call_id, task_id, str(state), kind, seq, payload, trace_id)


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _number_or_none(value: object) -> float | None:
    """A finite JSON number as it is, else ``None`` (an integer too large for a double is
    not finite to a JavaScript renderer either)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:
        return None


def _item_of(parsed: _Parsed) -> Item:
    payload = parsed.payload
    kind, seq = parsed.kind, parsed.seq
    if kind in ("thinking", "text", "tool_output_append"):
        return Item(kind, seq, text=_str_or_none(payload.get("text")) or "")
    if kind == "tool_call":
        tool = next(
            (value for key in _TOOL_NAME_KEYS if isinstance(value := payload.get(key), str)),
            None,
        )
        return Item("tool_call", seq, tool=tool)
    if kind == "progress":
        message = _str_or_none(payload.get("message"))
        return Item(
            "progress",
            seq,
            text=message if message is not None else _str_or_none(payload.get("text")),
            progress=_number_or_none(payload.get("progress")),
            total=_number_or_none(payload.get("total")),
        )
    return Item("other", seq, text=_str_or_none(payload.get("text")), envelope_kind=kind)


def _terminal_text(parsed: _Parsed) -> str:
    key = "text" if parsed.state == "done" else "message"
    return _str_or_none(parsed.payload.get(key)) or ""


def _outcome(parsed: _Parsed) -> Terminal:
    """How a terminal ended: ``done``; ``stopped`` for an ``aborted`` block whose
    ``payload.stopped`` is ``true`` (nothing else counts); else ``aborted``. Same as
    ``outcomeOf`` in ``web/renderer.js``."""
    if parsed.state == "done":
        return "done"
    return "stopped" if parsed.payload.get("stopped") is True else "aborted"


def _tool_of(content: Mapping[str, Any]) -> str | None:
    tool_call = _as_mapping(content.get("toolCall"))
    if tool_call is None:
        return None
    function_call = _as_mapping(tool_call.get("functionCall"))
    if function_call is not None and isinstance(function_call.get("name"), str):
        return str(function_call["name"])
    for key in ("toolId", "name"):
        if isinstance(tool_call.get(key), str):
            return str(tool_call[key])
    return None


def _return_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    mapping = _as_mapping(value)
    if mapping is not None:
        for key in ("text", "content"):
            if isinstance(mapping.get(key), str):
                return str(mapping[key])
    return None


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0


class PaneStore:
    """All detail panes of one conversation room, fed with what the socket delivers.

    Feed it ``tool_event_stream`` blocks (:meth:`apply_block`) and ``chat_event``
    snapshots (:meth:`apply_snapshot`) as parsed JSON, in arrival order, and call
    :meth:`tick` now and then so panes without blocks reach "no process details". Around a
    join: :meth:`begin_replay` when it is sent (it returns the ``have`` cursors to send),
    :meth:`end_replay` with its acknowledgement. :meth:`state` returns the vector format.
    No method raises on bad input.

    ``clock`` returns milliseconds on any monotonic scale (default: ``time.monotonic``);
    ``max_panes`` bounds memory for long-running viewers: past it, the oldest pane that is
    ended (or, failing that, the oldest pane) is forgotten.
    """

    def __init__(
        self,
        *,
        timeout_ms: float = DEFAULT_TIMEOUT_MS,
        clock: Callable[[], float] | None = None,
        max_panes: int | None = None,
    ) -> None:
        if timeout_ms < 0:
            raise ValueError(f"timeout_ms must be >= 0, got {timeout_ms!r}")
        if max_panes is not None and max_panes < 1:
            raise ValueError(f"max_panes must be >= 1 or None, got {max_panes!r}")
        self.timeout_ms = timeout_ms
        self.max_panes = max_panes
        self._clock = clock or _monotonic_ms
        self._panes: dict[str, Pane] = {}
        self._orphans: dict[str, Final] = {}
        self._orphan_seqs: dict[str, int] = {}
        self._replaying = False
        self._join_cursors: dict[tuple[str | None, str], int] = {}
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)

    # -- reading -----------------------------------------------------------------------
    @property
    def replaying(self) -> bool:
        """Whether a join is being caught up (between :meth:`begin_replay` and
        :meth:`end_replay`)."""
        return self._replaying

    @property
    def panes(self) -> list[Pane]:
        """The panes in order of first appearance."""
        return list(self._panes.values())

    def pane(self, call_id: str) -> Pane | None:
        """The pane of ``call_id``, or ``None``."""
        return self._panes.get(call_id)

    @property
    def orphans(self) -> list[Final]:
        """Final answers of terminal blocks with ``callId: null``, one per taskId."""
        return list(self._orphans.values())

    def state(self) -> dict[str, Any]:
        """The whole room in the vector format (``tests/vectors/README.md``)."""
        return {
            "panes": [pane.to_json() for pane in self._panes.values()],
            "orphans": [
                {"taskId": final.task_id, "outcome": final.source, "text": final.text}
                for final in self._orphans.values()
            ],
            "dropped": dict(self.dropped),
        }

    # -- feeding -----------------------------------------------------------------------
    def _drop(
        self, reason: Outcome, call_id: str | None = None, task_id: str | None = None
    ) -> Applied:
        self.dropped[reason] += 1
        return Applied(reason, call_id, task_id)

    def _open(self, call_id: str) -> tuple[Pane, bool]:
        pane = self._panes.get(call_id)
        if pane is not None:
            return pane, False
        pane = Pane(call_id=call_id, opened_at=self._clock())
        if self._replaying:
            pane.mode = "replay"
        self._panes[call_id] = pane
        if self.max_panes is not None and len(self._panes) > self.max_panes:
            self._evict(keep=call_id)
        return pane, True

    def _evict(self, keep: str) -> None:
        victims = [key for key, pane in self._panes.items() if key != keep]
        ended = [key for key in victims if self._panes[key].status in ("ended", "no_details")]
        del self._panes[(ended or victims)[0]]

    def apply_block(self, block: object) -> Applied:
        """Apply one ``tool_event_stream`` block (the JSON object as received)."""
        parsed = _parse(block)
        if parsed is None:
            return self._drop("invalid")
        terminal = parsed.state != "running"
        if parsed.call_id is None:
            if not terminal:
                return self._drop("unattributed", None, parsed.task_id)
            if parsed.task_id in self._orphans:
                return self._drop("afterEnd", None, parsed.task_id)
            final = Final(_outcome(parsed), _terminal_text(parsed), parsed.task_id)
            self._orphans[parsed.task_id] = final
            self._orphan_seqs[parsed.task_id] = parsed.seq
            return Applied("orphan", None, parsed.task_id, final=final)
        pane, new_pane = self._open(parsed.call_id)
        task = pane.tasks.get(parsed.task_id)
        new_task = task is None
        if task is None:
            task = pane.tasks[parsed.task_id] = Task(parsed.task_id)
        elif task.ended:
            return self._drop("afterEnd", parsed.call_id, parsed.task_id)
        if terminal:
            if pane.trace_id is None:
                pane.trace_id = parsed.trace_id
            task.outcome = _outcome(parsed)
            task.final_text = _terminal_text(parsed)
            task.terminal_seq = parsed.seq
            pane.last_final = Final(task.outcome, task.final_text, task.task_id)
            return Applied(
                "terminal",
                parsed.call_id,
                parsed.task_id,
                final=pane.last_final,
                new_pane=new_pane,
                new_task=new_task,
            )
        item = _item_of(parsed)
        if not task.insert(item):
            return self._drop("duplicate", parsed.call_id, parsed.task_id)
        if pane.trace_id is None:
            pane.trace_id = parsed.trace_id
        return Applied(
            "item", parsed.call_id, parsed.task_id, item=item, new_pane=new_pane, new_task=new_task
        )

    def apply_snapshot(self, event: object) -> Applied:
        """Apply one ``chat_event`` tool-event snapshot (the JSON object as received).

        Read: ``eventId`` (the callId), ``eventScene`` (must be ``"tool"`` when present),
        ``content.toolCall.functionCall.name`` (else ``toolId``/``name``) as the tool name,
        and ``content.toolReturn`` (a string, or an object with a string ``text`` or
        ``content``) as the tool's return. Other events are dropped as ``ignoredSnapshot``.
        """
        data = _as_mapping(event)
        if data is None:
            return self._drop("ignoredSnapshot")
        call_id = data.get("eventId")
        scene = data.get("eventScene", "tool")
        if not (isinstance(call_id, str) and call_id) or scene != "tool":
            return self._drop("ignoredSnapshot")
        content = _as_mapping(data.get("content")) or {}
        pane, new_pane = self._open(call_id)
        tool = _tool_of(content)
        if tool is not None:
            pane.tool = tool
        final = None
        if content.get("toolReturn") is not None:
            pane.returned = True
            text = _return_text(content["toolReturn"])
            if text is not None:
                pane.return_text = text
                final = pane.final
        return Applied("snapshot", call_id, final=final, new_pane=new_pane)

    def tick(self, now: float | None = None) -> list[str]:
        """Mark panes without blocks whose timeout has passed at ``now`` (default: the
        clock); returns the callIds whose status changed to ``no_details``."""
        now = self._clock() if now is None else now
        changed = []
        for pane in self._panes.values():
            if pane.tasks or pane.timed_out or now - pane.opened_at < self.timeout_ms:
                continue
            before = pane.status
            pane.timed_out = True
            if pane.status != before:
                changed.append(pane.call_id)
        return changed

    # -- catching up -------------------------------------------------------------------
    def have(self) -> list[dict[str, Any]]:
        """The join request's ``have``: per stream this store holds, the highest seq it
        holds (its items' and its terminal's), as ``[{"callId", "taskId", "seq"}]``, with
        ``"ended": True`` when it holds the stream's terminal — open
        streams first (in order of pane and task), then ended ones, then the final answers
        of calls without a callId (``callId`` ``None``); at most :data:`MAX_JOIN_STREAMS`
        entries, and none for a seq above 2**53 - 1."""
        open_: list[dict[str, Any]] = []
        ended: list[dict[str, Any]] = []
        for pane in self._panes.values():
            for task in pane.tasks.values():
                cursor = {"callId": pane.call_id, "taskId": task.task_id, "seq": task.last_seq}
                if task.ended:
                    ended.append({**cursor, "ended": True})
                else:
                    open_.append(cursor)
        orphans = [
            {"callId": None, "taskId": task_id, "seq": seq, "ended": True}
            for task_id, seq in self._orphan_seqs.items()
        ]
        cursors = [c for c in (*open_, *ended, *orphans) if c["seq"] <= _MAX_COUNT]
        return cursors[:MAX_JOIN_STREAMS]

    def begin_replay(self) -> list[dict[str, Any]]:
        """A join is being sent: every pane, and every pane opened until
        :meth:`end_replay`, is in mode ``"replay"``. Returns the cursors to send as the
        join's ``have`` (:meth:`have`)."""
        have = self.have()
        self._join_cursors = {(c["callId"], c["taskId"]): c["seq"] for c in have}
        self._replaying = True
        for pane in self._panes.values():
            pane.mode = "replay"
        return have

    def end_replay(self, ack: object) -> list[Applied]:
        """The join's acknowledgement arrived (``ack`` as received), or the join failed
        (``ack`` ``None``: no answer; ``{"ok": false, …}``: refused): every pane is
        ``"live"`` again. An accepted join's ``replay.missing`` entries (``{"callId",
        "taskId", "blocks"}``) add ``blocks`` to the ``missing`` count of their task (at
        most 2**53 - 1 in all). What cannot be used is counted in ``dropped["ignoredAck"]``,
        never raised: an ack that is not an object with a boolean ``ok``, a ``replay`` or
        ``missing`` of the wrong type, an entry that is not such an object with a non-empty
        string callId and taskId and an integer ``blocks`` of 1 .. 2**53 - 1, an entry for
        a stream this store does not hold, entries past the first
        :data:`MAX_JOIN_STREAMS`. Returns what changed: ``missing`` results, then ``mode``
        results."""
        cursors, self._join_cursors = self._join_cursors, {}
        self._replaying = False
        changed: list[Applied] = []
        data = _as_mapping(ack)
        if data is not None and isinstance(data.get("ok"), bool):
            replay = data.get("replay")
            if data["ok"] and replay is not None:
                changed += self._apply_missing(replay, cursors)
        elif ack is not None:
            self.dropped["ignoredAck"] += 1
        for pane in self._panes.values():
            if pane.mode != "live":
                pane.mode = "live"
                changed.append(Applied("mode", pane.call_id))
        return changed

    def _apply_missing(
        self, replay: object, cursors: Mapping[tuple[str | None, str], int]
    ) -> list[Applied]:
        data = _as_mapping(replay)
        if data is None:
            self.dropped["ignoredAck"] += 1
            return []
        missing = data.get("missing")
        if missing is None:
            return []
        if not isinstance(missing, list):
            self.dropped["ignoredAck"] += 1
            return []
        read = missing[:MAX_JOIN_STREAMS]
        self.dropped["ignoredAck"] += len(missing) - len(read)
        changed: list[Applied] = []
        for raw in read:
            entry = _as_mapping(raw) or {}
            call_id, task_id = entry.get("callId"), entry.get("taskId")
            blocks = _count_of(entry.get("blocks"))
            pane = self._panes.get(call_id) if isinstance(call_id, str) else None
            task = None
            if pane is not None and isinstance(task_id, str):
                task = pane.tasks.get(task_id)
            if blocks is None or task is None:
                self.dropped["ignoredAck"] += 1
                continue
            task.missing = min(task.missing + blocks, _MAX_COUNT)
            changed.append(Applied("missing", call_id, task_id))
        return changed
