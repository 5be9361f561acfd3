"""The A2A stream adapter: the events of one ``client.send_message(...)`` stream → publish calls.

The rules (which event becomes which block) are in :mod:`kernel_ext.a2a`'s docstring and
docs/a2a.md; :class:`A2AStreamAdapter` applies them, :class:`ColleagueReply` is how a stream
ended.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, Union

from kernel_ext.errors import DecodeError
from kernel_ext.observability import otel_metrics
from kernel_ext.protocol import BlockState, Envelope, decode_envelope
from kernel_ext.stop import SO_FAR_MAX

try:
    from a2a.types import Message, StreamResponse, Task, TaskState, TaskStatus
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kernel_ext.a2a needs the 'a2a' extra: pip install 'kernel-ext[a2a]'"
    ) from exc

if TYPE_CHECKING:
    from google.protobuf.struct_pb2 import Value

__all__ = [
    "A2AStreamAdapter",
    "AdapterStats",
    "ColleagueReply",
    "Item",
    "Publisher",
    "ReplyState",
    "integral_floats_to_ints",
]

logger = logging.getLogger("kernel_ext.a2a")

ReplyState = Literal[
    "completed",
    "input_required",
    "failed",
    "canceled",
    "rejected",
    "auth_required",
    "incomplete",
    "error",
    "timeout",
]
"""How a colleague's reply ended: the first four and ``auth_required`` are the
colleague's own A2A state; ``incomplete`` = its stream ended without a terminal state,
``error`` = a transport or protocol error, ``timeout`` = a deadline passed."""

_ANSWERED: frozenset[str] = frozenset({"completed", "input_required"})

Item = Union[Envelope, Mapping[str, Any], str]  # noqa: UP007 - a runtime alias on 3.10


class Publisher(Protocol):
    """The signature of ``kernel_ext.stream.publish`` (docs/contracts.md)."""

    def __call__(
        self,
        item: Item,
        *,
        task_id: str | None = None,
        state: BlockState = "running",
        conversation_id: str | None = None,
        tool_name: str = "ask_colleague",
        provisional: bool = False,
    ) -> None: ...


def _default_publisher() -> Publisher:
    from kernel_ext.stream import publish  # late: only when no publisher was passed

    default: Publisher = publish
    return default


def _value_to_python(value: Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {key: _value_to_python(item) for key, item in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_value_to_python(item) for item in value.list_value.values]
    return None


def integral_floats_to_ints(value: Any) -> Any:
    """``value`` with every integral float turned into an int, recursively (``3.0`` → ``3``).

    Non-integral and non-finite floats, and every other value, are kept as they are;
    containers are copied (dicts and lists), never changed in place.
    """
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {key: integral_floats_to_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [integral_floats_to_ints(item) for item in value]
    return value


def _texts(parts: Any) -> str:
    return "\n".join(part.text for part in parts if part.HasField("text"))


@dataclass
class AdapterStats:
    """What one adapter did, for tests and logs (metrics are recorded separately).

    ``envelopes``: running blocks published with the peer's envelope; ``texts``: running
    blocks published as text (pseudo-envelopes), ``degraded`` of them because the
    envelope was malformed; ``invalid``: malformed envelopes dropped; ``skipped``: text
    updates without an envelope left out because the task's peer sends envelopes;
    ``ignored``: events for a task after its terminal; ``terminals``: terminal blocks
    published.
    """

    envelopes: int = 0
    texts: int = 0
    degraded: int = 0
    invalid: int = 0
    skipped: int = 0
    ignored: int = 0
    terminals: int = 0


@dataclass(frozen=True)
class ColleagueReply:
    """The end of one colleague stream.

    ``text`` is the final answer (``completed``), the colleague's question
    (``input_required``) or the reason it gave none (every other state). ``task_id`` and
    ``context_id`` are the A2A ids to follow up with (``None`` when no task was created);
    ``task_ids`` lists every task seen, in order.
    """

    state: ReplyState
    text: str
    task_id: str | None = None
    context_id: str | None = None
    task_ids: tuple[str, ...] = ()
    stats: AdapterStats = field(default_factory=AdapterStats)

    @property
    def ok(self) -> bool:
        """Whether the colleague answered (``completed`` or ``input_required``)."""
        return self.state in _ANSWERED


_TERMINAL_STATES: dict[int, tuple[BlockState, ReplyState, str]] = {
    TaskState.TASK_STATE_COMPLETED: ("done", "completed", ""),
    TaskState.TASK_STATE_FAILED: ("aborted", "failed", "the colleague failed"),
    TaskState.TASK_STATE_CANCELED: ("aborted", "canceled", "the colleague's task was cancelled"),
    TaskState.TASK_STATE_REJECTED: ("aborted", "rejected", "the colleague rejected the task"),
}
# Interrupted, not terminal: the task waits for the caller. The block is the provisional
# terminal's state (sent only if the tool call ends before the task goes on).
_INTERRUPTED_STATES: dict[int, tuple[BlockState, ReplyState, str]] = {
    TaskState.TASK_STATE_INPUT_REQUIRED: (
        "done",
        "input_required",
        "the colleague needs more input",
    ),
    TaskState.TASK_STATE_AUTH_REQUIRED: (
        "aborted",
        "auth_required",
        "the colleague requires authentication",
    ),
}


class _TaskStream:
    """Bookkeeping of one A2A task: ids, terminal and interrupted flags, artifacts for the
    final answer."""

    __slots__ = (
        "artifacts",
        "context_id",
        "enveloped",
        "interrupted",
        "task_id",
        "terminal",
        "warned",
    )

    def __init__(self, task_id: str, context_id: str | None) -> None:
        self.task_id = task_id
        self.context_id = context_id
        self.terminal = False
        self.interrupted = False
        self.enveloped = False
        self.warned = False
        self.artifacts: dict[str, list[str]] = {}

    def artifact_text(self) -> str:
        return "\n".join("".join(chunks) for chunks in self.artifacts.values() if any(chunks))


class A2AStreamAdapter:
    """Turns the events of one A2A stream into publish calls (rules: module docstring).

    Guarantees: :meth:`feed` and :meth:`close` never raise (a bug or a failing publisher
    is logged, never passed on); each task gets at most one terminal publish; after
    :meth:`close` every task seen has exactly one — or, for a task waiting for input, a
    provisional one that the hub sends if the call ends first — and so does a stream that
    never created a task. Not thread-safe: feed it from one task.
    """

    def __init__(
        self,
        publish: Publisher | None = None,
        *,
        conversation_id: str | None = None,
        tool_name: str = "ask_colleague",
    ) -> None:
        self._publish = publish if publish is not None else _default_publisher()
        self._conversation_id = conversation_id
        self._tool_name = tool_name
        self._tasks: dict[str, _TaskStream] = {}
        self._local_terminal = False
        self._reply: ColleagueReply | None = None
        self._said: list[str] = []
        self._said_chars = 0
        self.stats = AdapterStats()

    # -- state -------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether a terminal (or a provisional one) was published and no task seen is
        still running."""
        if self._reply is None:
            return False
        return all(task.terminal or task.interrupted for task in self._tasks.values())

    @property
    def open_task_ids(self) -> tuple[str, ...]:
        """Ids of the tasks seen that are still running (no terminal, not waiting for
        input)."""
        return tuple(
            tid for tid, task in self._tasks.items() if not (task.terminal or task.interrupted)
        )

    @property
    def said_so_far(self) -> str:
        """What the colleague has said so far: its running updates' texts — plain text, and
        an envelope's ``payload.text`` (thinking, text) — in order, one a line (collected up to
        :data:`kernel_ext.stop.SO_FAR_MAX` characters), then the text of the artifacts of
        its open tasks. What a stopped ``ask_colleague`` returns with."""
        artifacts = [self._tasks[tid].artifact_text() for tid in self.open_task_ids]
        return "\n".join([*self._said, *(text for text in artifacts if text)])

    @property
    def reply(self) -> ColleagueReply | None:
        """The reply so far: set by the latest terminal, ``None`` before any."""
        return self._reply

    # -- input -------------------------------------------------------------------------

    def feed(self, event: StreamResponse) -> None:
        """Translate one stream event into zero or more publish calls."""
        try:
            kind = event.WhichOneof("payload")
            if kind == "status_update":
                update = event.status_update
                self._on_status(self._task(update.task_id, update.context_id), update.status)
            elif kind == "task":
                self._on_task(event.task)
            elif kind == "artifact_update":
                self._on_artifact(event.artifact_update)
            elif kind == "message":
                self._on_message(event.message)
        except Exception:
            logger.exception("a2a adapter: could not translate an event; skipped")

    def close(self, message: str, state: ReplyState = "incomplete") -> ColleagueReply:
        """End the stream: one ``aborted`` block with ``message`` for every open task.

        When no task was seen and nothing terminal was published, one local ``aborted``
        block (``task_id=None``) goes out instead. Returns the reply; idempotent.
        """
        try:
            opened = self.open_task_ids
            for task_id in opened:
                task = self._tasks[task_id]
                self._terminal(task, "aborted", message)
                self._set_reply(state, message, task)
            if not opened and self._reply is None and not self._local_terminal:
                self._local_terminal = True
                self._emit(message, None, "aborted")
                self.stats.terminals += 1
                self._set_reply(state, message, None)
        except Exception:
            logger.exception("a2a adapter: could not close the stream")
        if self._reply is None:  # pragma: no cover - only after an internal error
            self._reply = ColleagueReply(state, message, stats=self.stats)
        return self._reply

    # -- translation -------------------------------------------------------------------

    def _task(self, task_id: str, context_id: str) -> _TaskStream:
        task = self._tasks.get(task_id)
        if task is None:
            task = self._tasks[task_id] = _TaskStream(task_id, context_id or None)
        return task

    def _on_task(self, snapshot: Task) -> None:
        task = self._task(snapshot.id, snapshot.context_id)
        if task.terminal:
            self.stats.ignored += 1
            return
        for artifact in snapshot.artifacts:
            task.artifacts[artifact.artifact_id] = [_texts(artifact.parts)]
        # A snapshot's working message may repeat one already streamed: only act on an end.
        state = snapshot.status.state
        if state in _TERMINAL_STATES or (state in _INTERRUPTED_STATES and not task.interrupted):
            self._on_status(task, snapshot.status)

    def _on_artifact(self, update: Any) -> None:
        task = self._task(update.task_id, update.context_id)
        if task.terminal:
            self.stats.ignored += 1
            return
        artifact = update.artifact
        text = _texts(artifact.parts)
        chunks = task.artifacts.get(artifact.artifact_id)
        if update.append and chunks is not None:
            chunks.append(text)
        else:
            task.artifacts[artifact.artifact_id] = [text]

    def _on_message(self, message: Message) -> None:
        # A direct reply: the whole interaction was one message, and it is the answer.
        if message.task_id:
            task = self._task(message.task_id, message.context_id)
            if task.terminal:
                self.stats.ignored += 1
                return
            self._terminal(task, "done", _texts(message.parts))
            self._set_reply("completed", _texts(message.parts), task)
        elif self._reply is None:
            self._local_terminal = True
            text = _texts(message.parts)
            self._emit(text, None, "done")
            self.stats.terminals += 1
            self._reply = ColleagueReply(
                "completed", text, None, message.context_id or None, (), self.stats
            )
        else:
            self.stats.ignored += 1

    def _on_status(self, task: _TaskStream, status: TaskStatus) -> None:
        if task.terminal:
            self.stats.ignored += 1
            return
        state = status.state
        message = status.message if status.HasField("message") else None
        if state == TaskState.TASK_STATE_WORKING:
            task.interrupted = False
            if message is not None:
                self._on_working(task, message)
            return
        interrupted = _INTERRUPTED_STATES.get(state)
        if interrupted is not None:
            block_state, reply_state, default = interrupted
            if message is not None:
                self._on_working(task, message)  # the question, shown while the call goes on
            text = (_texts(message.parts) if message is not None else "") or default
            task.interrupted = True
            self._emit(text, task.task_id, block_state, provisional=True)
            self._set_reply(reply_state, text, task)
            return
        end = _TERMINAL_STATES.get(state)
        if end is None:  # submitted, unspecified: nothing to show
            return
        block_state, reply_state, default = end
        text = _texts(message.parts) if message is not None else ""
        if reply_state == "completed" and not text:
            text = task.artifact_text()
        text = text or default
        self._terminal(task, block_state, text)
        self._set_reply(reply_state, text, task)

    def _on_working(self, task: _TaskStream, message: Message) -> None:
        envelopes: list[Envelope] = []
        problems: list[str] = []
        for part in message.parts:
            if not part.HasField("data"):
                continue
            data = _value_to_python(part.data)
            if not isinstance(data, dict):
                problems.append(f"data part is a {type(data).__name__}, not an envelope object")
                continue
            try:
                envelopes.append(decode_envelope(data))
            except DecodeError as error:
                problems.append(str(error))
        for envelope in envelopes:
            self._emit(envelope, task.task_id, "running")
            self.stats.envelopes += 1
        if envelopes:
            task.enveloped = True
        text = _texts(message.parts)
        if not envelopes and text:
            if task.enveloped:
                # The peer speaks envelopes and owns this stream's seq numbers: a text
                # block would take a seq from the hub's counter that collides with the
                # peer's, and renderers keep only the first block of a seq.
                self.stats.skipped += 1
                if problems:
                    self.stats.invalid += len(problems)
                    self._count_dropped(len(problems))
                    self._warn(task, problems, "dropped")
                return
            self._emit(text, task.task_id, "running")
            self.stats.texts += 1
            if problems:
                self.stats.degraded += len(problems)
                self._warn(task, problems, "degraded to its text")
            return
        if problems:
            self.stats.invalid += len(problems)
            self._count_dropped(len(problems))
            self._warn(task, problems, "dropped")

    # -- output ------------------------------------------------------------------------

    def _terminal(self, task: _TaskStream, state: BlockState, text: str) -> None:
        task.terminal = True
        task.interrupted = False
        self._emit(text, task.task_id, state)
        self.stats.terminals += 1

    def _set_reply(self, state: ReplyState, text: str, task: _TaskStream | None) -> None:
        self._reply = ColleagueReply(
            state=state,
            text=text,
            task_id=task.task_id if task is not None else None,
            context_id=task.context_id if task is not None else None,
            task_ids=tuple(self._tasks),
            stats=self.stats,
        )

    def _emit(
        self, item: Item, task_id: str | None, state: BlockState, *, provisional: bool = False
    ) -> None:
        if state == "running" and self._said_chars < SO_FAR_MAX:
            said = item.payload.get("text") if isinstance(item, Envelope) else item
            if isinstance(said, str):
                self._said.append(said)
                self._said_chars += len(said)
        # The keyword only when set: a publisher written before it still works otherwise.
        extra: dict[str, Any] = {"provisional": True} if provisional else {}
        try:
            self._publish(
                item,
                task_id=task_id,
                state=state,
                conversation_id=self._conversation_id,
                tool_name=self._tool_name,
                **extra,
            )
        except Exception:  # publish never raises by contract; never let it reach the tool
            logger.exception("a2a adapter: publish raised; block lost")

    def _warn(self, task: _TaskStream, problems: list[str], outcome: str) -> None:
        level = logging.DEBUG if task.warned else logging.WARNING
        task.warned = True
        logger.log(
            level,
            "a2a adapter: malformed envelope from task %s %s: %s",
            task.task_id,
            outcome,
            "; ".join(problems),
        )

    @staticmethod
    def _count_dropped(count: int) -> None:
        try:
            otel_metrics.blocks.add(count, {"outcome": "dropped", "reason": "invalid_envelope"})
        except Exception:  # pragma: no cover - the OTel API does not raise
            logger.debug("a2a adapter: metric not recorded", exc_info=True)
