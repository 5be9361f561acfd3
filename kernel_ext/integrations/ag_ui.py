"""AG-UI bridge: each tool call's live pane in AG-UI front-ends (extra ``kernel-ext[agui]``).

:class:`AGUIBridge` is a sender (:class:`~kernel_ext.emit.Emitter`): it takes the hub's
blocks — already throttled, ordered and ended once by the hub, as for the Socket.IO path —
and routes each into the AG-UI runs of its conversation (the AG-UI thread). An application
wraps each run's event stream with :meth:`AGUIBridge.stream` after its own authorization of
the run, or serves :func:`ag_ui_endpoint` (pydantic-ai's AG-UI adapter behind the relay's
``authorize_join`` hook). Event types are ``ag_ui.core``'s; encoding is the adapter's.

Guarantees (docs/ag-ui.md):

* A pane is one activity message (``ACTIVITY_SNAPSHOT`` once, then ``ACTIVITY_DELTA``: JSON
  Patches from the content last sent to the new one), activity type
  :data:`ACTIVITY_TYPE`, message id ``kernel_ext:<callId>``. Its content is
  :class:`kernel_ext.viewing.view.Pane`'s JSON plus ``toolCallId``, the model's tool-call id,
  read from the tap (:meth:`kernel_ext.attribution.tap.Tap.llm_call_id`) when the bridge takes the
  pane's first block: known while the call runs and for the tap's ``ended_ttl`` seconds
  (default 60) after its end, so a call that published and returned before the bridge
  had a turn keeps it.
* A stream of an A2A colleague (taskId ≠ callId) is a subagent: ``SUBAGENT_STARTED``
  (``parentToolCallId`` = the tool-call id) before the first activity that shows it, and
  exactly one ``SUBAGENT_FINISHED`` (``done``) or ``SUBAGENT_ERROR`` (``aborted``) after
  the activity that shows its end.
* Blocks of conversation X reach only runs registered for thread X; a block that reaches
  no run is counted ``no_listener``.
* Pane events go between the run's ``RUN_STARTED`` and its closing event; before the
  closing event the bridge waits (up to ``run_end_timeout``) for what the hub holds, and
  a colleague still open then gets ``SUBAGENT_ERROR`` (counted ``run_ended_open``).
* Every event it yields is encodable: a lone surrogate in a block, a snapshot or the run's
  own events is replaced by U+FFFD (:func:`kernel_ext.protocol.well_formed`), counted
  ``surrogates_replaced``.
* Nothing here raises into tool code; bad blocks are dropped by the pane model and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import jsonpatch
from ag_ui.core import (
    ActivityDeltaEvent,
    ActivitySnapshotEvent,
    BaseEvent,
    EventType,
    SubagentErrorEvent,
    SubagentFinishedEvent,
    SubagentStartedEvent,
)

from kernel_ext.attribution.tap import Tap, default_tap
from kernel_ext.emit.base import NO_LISTENER, Emitter, remembers_arguments
from kernel_ext.errors import ConfigError, check_positive_ints, check_positive_numbers
from kernel_ext.observability.count_names import (  # counted in AGUIBridge.counts, re-exported
    NO_TOOL_CALL_ID,
    RUN_ENDED_OPEN,
    RUN_LIMIT,
    SURROGATES_REPLACED,
)
from kernel_ext.protocol import well_formed_json
from kernel_ext.relay.auth import JoinAuth, call_hook
from kernel_ext.stream import Outgoing, OutgoingBlock, OutgoingChatEvent, StreamHub
from kernel_ext.viewing.view import Pane, PaneStore

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

__all__ = [
    "ACTIVITY_TYPE",
    "NO_TOOL_CALL_ID",
    "RUN_ENDED_OPEN",
    "RUN_LIMIT",
    "SURROGATES_REPLACED",
    "AGUIBridge",
    "ag_ui_endpoint",
    "message_id_of",
    "subagent_run_id_of",
]

logger = logging.getLogger("kernel_ext.emit")

ACTIVITY_TYPE = "kernel_ext.pane"
"""The ``activityType`` of a pane's activity messages."""

_RUN_END_MESSAGE = "the run ended before the colleague's stream did"
_CLOSING = frozenset({EventType.RUN_FINISHED, EventType.RUN_ERROR})


def message_id_of(call_id: str) -> str:
    """The activity message id of the pane of ``call_id``."""
    return "kernel_ext:" + call_id


def subagent_run_id_of(call_id: str, task_id: str) -> str:
    """The subagent run id of the colleague stream ``(call_id, task_id)``."""
    return f"kernel_ext:{call_id}:{task_id}"


@dataclass
class _Run:
    """One AG-UI run a bridge feeds: its panes, what it last sent of each, its colleagues."""

    thread_id: str
    max_panes: int
    store: PaneStore = field(init=False)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dirty: dict[str, None] = field(default_factory=dict)
    tool_call_ids: dict[str, str | None] = field(default_factory=dict)
    sent: dict[str, dict[str, Any]] = field(default_factory=dict)
    open_subagents: dict[str, None] = field(default_factory=dict)
    ended_subagents: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.store = PaneStore(max_panes=self.max_panes)

    def content(self, pane: Pane) -> dict[str, Any]:
        content = pane.to_json()
        content["toolCallId"] = self.tool_call_ids.get(pane.call_id)
        return content

    def events(self) -> list[BaseEvent]:
        """What changed since the last call, as AG-UI events in order (see the module)."""
        out: list[BaseEvent] = []
        dirty, self.dirty = self.dirty, {}
        for call_id in dirty:
            pane = self.store.pane(call_id)
            if pane is None:  # evicted past max_panes
                continue
            tool_call_id = self.tool_call_ids.get(call_id)
            colleagues = [t for t in pane.tasks.values() if t.task_id != call_id]
            for task in colleagues:
                run_id = subagent_run_id_of(call_id, task.task_id)
                if run_id not in self.open_subagents and run_id not in self.ended_subagents:
                    self.open_subagents[run_id] = None
                    out.append(
                        SubagentStartedEvent(
                            subagent_run_id=run_id,
                            name="colleague",
                            description=f"A2A task {task.task_id}",
                            parent_tool_call_id=tool_call_id,
                        )
                    )
            content = self.content(pane)
            before = self.sent.get(call_id)
            if before is None:
                out.append(
                    ActivitySnapshotEvent(
                        message_id=message_id_of(call_id),
                        activity_type=ACTIVITY_TYPE,
                        content=content,
                    )
                )
            else:
                patch = jsonpatch.make_patch(before, content).patch
                if patch:
                    out.append(
                        ActivityDeltaEvent(
                            message_id=message_id_of(call_id),
                            activity_type=ACTIVITY_TYPE,
                            patch=cast(Any, patch),  # dicts: validated into operations
                        )
                    )
            self.sent[call_id] = content
            for task in colleagues:
                run_id = subagent_run_id_of(call_id, task.task_id)
                if task.ended and run_id in self.open_subagents:
                    del self.open_subagents[run_id]
                    self.ended_subagents.add(run_id)
                    out.append(_subagent_end(run_id, task.outcome, task.final_text))
        return out

    def close_subagents(self) -> list[BaseEvent]:
        """``SUBAGENT_ERROR`` for every colleague still open (the run is closing)."""
        out: list[BaseEvent] = [
            SubagentErrorEvent(subagent_run_id=run_id, message=_RUN_END_MESSAGE)
            for run_id in self.open_subagents
        ]
        self.ended_subagents.update(self.open_subagents)
        self.open_subagents.clear()
        return out


def _subagent_end(run_id: str, outcome: str | None, text: str | None) -> BaseEvent:
    if outcome == "done":
        return SubagentFinishedEvent(subagent_run_id=run_id, result=text or "")
    return SubagentErrorEvent(subagent_run_id=run_id, message=text or "aborted")


class AGUIBridge(Emitter):
    """The sender that feeds AG-UI runs (module docstring). Hand it to
    :func:`kernel_ext.enable` (``enable(emitter=AGUIBridge())``); it is the hub's one
    sender, so blocks go to AG-UI runs only, not to a relay as well.

    Args:
        hub: the hub to consume (default: the process-wide one, as every sender).
        tap: where the model's tool-call id of a call is read (:meth:`Tap.llm_call_id`:
            of a live call, or of one ended less than the tap's ``ended_ttl`` seconds ago)
            when its pane's first block is taken (default: the tap of the enabled plugin's
            span processor, else the process-wide tap).
        max_runs: runs fed at once; a run registered beyond gets no panes (``run_limit``).
        max_panes: panes kept per run (the oldest ended pane is forgotten beyond).
        run_end_timeout: seconds a closing run waits for the hub's queue to be sent.
        batch_max: blocks taken from the hub at once.

    Raises:
        ConfigError: a bound is not a positive number.
    """

    sender = "ag_ui"

    @remembers_arguments
    def __init__(
        self,
        *,
        hub: StreamHub | None = None,
        tap: Tap | None = None,
        max_runs: int = 1_000,
        max_panes: int = 256,
        run_end_timeout: float = 2.0,
        batch_max: int = 256,
    ) -> None:
        super().__init__(hub=hub, batch_max=batch_max)
        check_positive_ints(max_runs=max_runs, max_panes=max_panes)
        check_positive_numbers(run_end_timeout=run_end_timeout)
        self._tap = tap
        self.max_runs = max_runs
        self.max_panes = max_panes
        self.run_end_timeout = float(run_end_timeout)
        self._runs: dict[str, list[_Run]] = {}
        self._run_count = 0

    @property
    def runs(self) -> int:
        """The runs being fed now."""
        return self._run_count

    def _the_tap(self) -> Tap:
        if self._tap is None:
            from kernel_ext.worker.wiring import enabled

            state = enabled()
            self._tap = state.processor.tap if state is not None else default_tap()
        return self._tap

    async def _send(self, items: list[Outgoing]) -> None:
        delivered = 0
        for item in items:
            runs = self._runs.get(item.room)
            if isinstance(item, OutgoingChatEvent):
                if runs:
                    event = self._well_formed(item.event)
                    for run in runs:
                        applied = run.store.apply_snapshot(event)
                        if applied.call_id is not None and applied.outcome == "snapshot":
                            self._touch(run, applied.call_id)
                continue
            if not isinstance(item, OutgoingBlock):
                continue
            if not runs:
                self.port.dropped(NO_LISTENER, 1, item.call_id)
                continue
            delivered += 1
            block = self._well_formed(item.block)
            for run in runs:
                applied = run.store.apply_block(block)
                if applied.call_id is not None and applied.outcome in ("item", "terminal"):
                    self._touch(run, applied.call_id)
        if delivered:
            self.port.delivered(delivered)

    def _well_formed(self, value: dict[str, Any]) -> dict[str, Any]:
        """``value`` with its lone surrogates replaced (counted), for AG-UI's encoder."""
        fixed: dict[str, Any] = well_formed_json(value)
        if fixed is not value:
            self._count(SURROGATES_REPLACED)
        return fixed

    def _well_formed_event(self, event: BaseEvent) -> BaseEvent:
        """A run's own ``event`` with its lone surrogates replaced (counted)."""
        try:
            dumped = event.model_dump(by_alias=True)
            fixed = well_formed_json(dumped)
            if fixed is dumped:
                return event
            replaced = type(event).model_validate(fixed)
        except Exception:  # not ours to judge: the event goes on as it came
            logger.warning(
                "ag_ui bridge: could not check a %s event for lone surrogates", event.type
            )
            return event
        self._count(SURROGATES_REPLACED)
        return replaced

    def _touch(self, run: _Run, call_id: str) -> None:
        """Mark ``call_id``'s pane changed in ``run``; on its first change, read its
        tool-call id from the tap (the call may have ended since)."""
        if call_id not in run.tool_call_ids:
            tool_call_id = self._the_tap().llm_call_id(call_id)
            if tool_call_id is None:
                self._count(NO_TOOL_CALL_ID)
            run.tool_call_ids[call_id] = tool_call_id
            if len(run.tool_call_ids) > 4 * run.max_panes:  # forget evicted panes' ids
                for old in [c for c in run.tool_call_ids if run.store.pane(c) is None]:
                    del run.tool_call_ids[old]
                    run.sent.pop(old, None)
        run.dirty[call_id] = None
        run.wake.set()

    def _register(self, thread_id: str) -> _Run | None:
        if self._run_count >= self.max_runs:
            self._count(RUN_LIMIT)
            logger.warning("ag_ui bridge: %d runs already fed; a run gets no panes", self.max_runs)
            return None
        run = _Run(thread_id, self.max_panes)
        self._runs.setdefault(thread_id, []).append(run)
        self._run_count += 1
        return run

    def _unregister(self, run: _Run) -> None:
        runs = self._runs.get(run.thread_id)
        if runs is not None and run in runs:
            runs.remove(run)
            self._run_count -= 1
            if not runs:
                del self._runs[run.thread_id]

    async def stream(
        self, thread_id: str, events: AsyncIterator[BaseEvent]
    ) -> AsyncIterator[BaseEvent]:
        """``events`` (one AG-UI run's, e.g. pydantic-ai's ``adapter.run_stream()``) with
        the panes of conversation ``thread_id`` merged in (module docstring).

        Call it only for a run whose client may see conversation ``thread_id``: this is
        where the application's authorization of the run decides. ``events`` is consumed
        in one task of its own; closing this iterator stops it.

        Raises:
            ConfigError: ``thread_id`` is not a non-empty string.
        """
        if not isinstance(thread_id, str) or not thread_id:
            raise ConfigError(
                f"thread_id must be a non-empty string, got {type(thread_id).__name__}"
            )
        run = self._register(thread_id)
        wake = run.wake if run is not None else asyncio.Event()
        queue: asyncio.Queue[BaseEvent] = asyncio.Queue(maxsize=16)
        finished: list[BaseException | None] = []

        async def pump() -> None:
            error: BaseException | None = None
            try:
                async for event in events:
                    await queue.put(self._well_formed_event(event))
                    wake.set()
            except Exception as exc:  # re-raised in the caller's task
                error = exc
            finally:
                finished.append(error)
                wake.set()

        pumping = asyncio.get_running_loop().create_task(pump())
        started = False
        try:
            while True:
                await wake.wait()
                wake.clear()
                while not queue.empty():
                    event = queue.get_nowait()
                    if run is not None and started and event.type in _CLOSING:
                        await self._settle()
                        for pane_event in run.events():
                            yield pane_event
                        for pane_event in run.close_subagents():
                            self._count(RUN_ENDED_OPEN)
                            yield pane_event
                        self._unregister(run)
                        run = None
                    yield event
                    if event.type == EventType.RUN_STARTED:
                        started = True
                if run is not None and started:
                    for pane_event in run.events():
                        yield pane_event
                if finished and queue.empty():
                    if finished[0] is not None:
                        raise finished[0]
                    return
        finally:
            if run is not None:
                self._unregister(run)
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pumping

    async def _settle(self) -> None:
        """Wait (up to ``run_end_timeout``) until what the hub holds now has been taken."""
        if self.running:
            await self.flush(self.run_end_timeout)


Authenticate = Callable[["Request"], Any]
"""``authenticate(request) -> identity``: ``None``/``False`` refuses the request (401); may
be async."""


def ag_ui_endpoint(
    agent: Any,
    bridge: AGUIBridge,
    *,
    authenticate: Authenticate,
    authorize_join: JoinAuth,
    **adapter_options: Any,
) -> Callable[[Request], Any]:
    """A Starlette endpoint that serves ``agent`` over AG-UI with pydantic-ai's adapter
    (``pydantic_ai.ui.ag_ui.AGUIAdapter``, Python ≥ 3.11) and the bridge's panes.

    For each request: ``authenticate(request)`` gives the identity (falsy: 401, nothing
    runs); ``authorize_join(identity, thread_id)`` — the relay's hook, same signature —
    decides whether it may see the run's thread (falsy or raising: 403, nothing runs);
    then the agent runs with ``conversation_id`` = the thread id and its events are
    merged with the thread's panes (:meth:`AGUIBridge.stream`). ``adapter_options`` go to
    ``AGUIAdapter.from_request``.
    """
    from pydantic import ValidationError
    from pydantic_ai.ui.ag_ui import AGUIAdapter
    from starlette.responses import JSONResponse

    async def endpoint(request: Request) -> Response:
        try:
            identity = await call_hook(authenticate, request)
        except Exception:
            logger.exception("ag_ui endpoint: authenticate hook failed")
            identity = None
        if identity is None or identity is False:
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        try:
            adapter = await AGUIAdapter.from_request(request, agent=agent, **adapter_options)
        except ValidationError:
            return JSONResponse({"error": "invalid run input"}, status_code=422)
        thread_id = adapter.run_input.thread_id
        try:
            allowed = await call_hook(authorize_join, identity, thread_id)
        except Exception:
            logger.exception("ag_ui endpoint: authorize_join hook failed")
            allowed = False
        if not allowed or not isinstance(thread_id, str) or not thread_id:
            return JSONResponse({"error": "forbidden"}, status_code=403)
        events = adapter.run_stream()
        return adapter.streaming_response(bridge.stream(thread_id, events))

    return endpoint
