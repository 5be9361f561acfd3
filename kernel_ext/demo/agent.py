"""What the demo's agents share, whichever kernel drives them (``kernel-ext demo --kernel``):
the colleagues they ask, the ``ask_colleague`` tool's work, the kernel's ``chat_event``
snapshots, and the per-conversation turn-taking.

* :func:`ask` is the body of the ``ask_colleague`` tool of every kernel: it asks one
  colleague over A2A (:func:`kernel_ext.a2a.ask_colleague`) in the current tool call's
  conversation and returns the answer (or why there is none) as text.
* :func:`with_tool_snapshots` plays the kernel's part around one tool call: the
  ``chat_event`` snapshot (scene ``tool``, status ``calling``) before the tool's code runs,
  so before any block of the call, and ``finished`` with ``toolReturn`` after.
* :func:`scripted_answer` is what both kernels' scripted models write once their calls
  returned: each colleague's answer, and which colleague the person stopped (a stopped
  call's result begins with :data:`kernel_ext.stop.STOPPED_RESULT_LEAD`).
* :class:`ConversationAgent` answers user messages one conversation at a time; a kernel's
  agent (:class:`kernel_ext.demo.worker.DemoAgent`, pydantic-ai;
  :class:`kernel_ext.demo.graph_agent.GraphAgent`, LangGraph) supplies
  :meth:`~ConversationAgent.run`.

No pydantic-ai or LangGraph import here.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kernel_ext.a2a import ask_colleague as ask_colleague_over_a2a
from kernel_ext.context import current_tool_call
from kernel_ext.demo.script import DEFAULT_LANG, LANG_KEY, MAX_CONVERSATIONS, Wording, wording
from kernel_ext.errors import ColleagueError
from kernel_ext.stop import STOPPED_RESULT_LEAD, stopped_result
from kernel_ext.stream import StreamHub, get_default_hub

__all__ = [
    "MAX_CONVERSATIONS",
    "AskContext",
    "Colleague",
    "ConversationAgent",
    "ask",
    "message_event",
    "scripted_answer",
    "with_tool_snapshots",
]

logger = logging.getLogger(__name__)

_MAX_QUEUED_PER_CONVERSATION = 4

T = TypeVar("T")


@dataclass(frozen=True)
class Colleague:
    """A colleague the agent can ask: its A2A URL and the peer script to request."""

    key: str
    title: str
    url: str
    script: str


@dataclass(frozen=True)
class AskContext:
    """What the ``ask_colleague`` tool needs: whom it can ask, in which conversation, how
    long it waits, in which language."""

    colleagues: Mapping[str, Colleague]
    conversation_id: str
    timeout: float
    words: Wording


async def ask(context: AskContext, colleague: str, question: str) -> str:
    """Ask ``colleague`` (a key of ``context.colleagues``) ``question``; their answer,
    prefixed with their name, or the sentence saying why there is none (no such colleague,
    the colleague failed: its aborted block is out already)."""
    words = context.words
    spec = context.colleagues.get(colleague)
    if spec is None:
        return words.no_such_colleague.format(key=repr(colleague))
    title = words.titles.get(spec.key, spec.title)
    try:
        answer = await ask_colleague_over_a2a(
            spec.url,
            question,
            conversation_id=context.conversation_id,
            metadata={"kx.script": spec.script, LANG_KEY: words.lang},
            timeout=context.timeout,
        )
    except ColleagueError as exc:
        return words.could_not_answer.format(title=title, error=exc)
    return f"{title}{words.colon}{answer}"


def scripted_answer(words: Wording, results: Sequence[tuple[str | None, str]]) -> str:
    """The scripted models' answer in ``words``' language to tool results ``results``:
    pairs of the colleague a call asked (its key; ``None`` when unknown) and what the call
    returned. A result that says the user stopped the call
    (:data:`~kernel_ext.stop.STOPPED_RESULT_LEAD`) is left out of the answer, which says
    instead that that colleague was stopped (:meth:`Wording.answer`)."""
    returns: list[str] = []
    stopped: list[str] = []
    for key, text in results:
        if text.startswith(STOPPED_RESULT_LEAD):
            stopped.append(words.title(key) if key is not None else "?")
        else:
            returns.append(text)
    return words.answer(returns, stopped)


async def with_tool_snapshots(
    hub: StreamHub,
    tool_id: str,
    name: str,
    arguments: Mapping[str, Any],
    run: Callable[[], Awaitable[T]],
) -> T:
    """Run ``run()``, the active tool call's code, between its ``chat_event`` snapshots:
    ``calling`` before, ``finished`` with ``toolReturn`` (the result's ``str``, or
    ``error: …``; for a call the user stopped, the stopped result,
    :func:`kernel_ext.stop.stopped_result`) after. Without an active tool call in a
    conversation (no span), ``run()`` runs without snapshots. Exceptions (and the stop's
    cancellation) propagate unchanged, after the ``finished`` snapshot."""
    active = current_tool_call()
    if active is None or active.conversation_id is None:
        return await run()
    room = active.conversation_id
    event: dict[str, Any] = {
        "eventId": active.call_id,
        "eventScene": "tool",
        "status": "calling",
        "conversationId": room,
        "content": {
            "toolCall": {
                "toolId": tool_id,
                "functionCall": {"name": name, "arguments": dict(arguments)},
            },
        },
    }
    hub.publish_chat_event(event, conversation_id=room)
    try:
        result = await run()
    except asyncio.CancelledError:
        if active.stop_requested:  # the stop's: the kernel's tool result says stopped
            finished = {**event, "status": "finished"}
            returned = stopped_result(active.life.so_far)
            finished["content"] = {**event["content"], "toolReturn": returned}
            hub.publish_chat_event(finished, conversation_id=room)
        raise
    except Exception as exc:
        finished = {**event, "status": "finished"}
        finished["content"] = {**event["content"], "toolReturn": f"error: {exc}"}
        hub.publish_chat_event(finished, conversation_id=room)
        raise
    finished = {**event, "status": "finished"}
    finished["content"] = {**event["content"], "toolReturn": str(result)}
    hub.publish_chat_event(finished, conversation_id=room)
    return result


def message_event(conversation_id: str, role: str, text: str) -> dict[str, Any]:
    """A ``chat_event`` snapshot of a chat message (scene ``message``; ``role`` is ``user``
    or ``assistant``). Renderers of tool panes ignore it; the demo page shows it."""
    return {
        "eventId": f"msg-{uuid.uuid4().hex}",
        "eventScene": "message",
        "status": "finished",
        "conversationId": conversation_id,
        "content": {"role": role, "text": text},
    }


class ConversationAgent(abc.ABC):
    """Answers user messages, one conversation at a time; a kernel's agent implements
    :meth:`run`.

    Args:
        colleagues: who can be asked, by key.
        hub: the stream hub (default: the process-wide one).
        timeout: the overall deadline of one colleague's answer, in seconds.
        lang: the language it answers in and asks its colleagues to speak
            (:data:`~kernel_ext.demo.script.LANGS`) when a message does not say.

    Guarantees: each message is answered in its own language (its ``lang``, else ``lang``);
    messages of one conversation are answered one after the other, in arrival order; at most
    4 wait per conversation (:meth:`submit` says ``busy`` beyond); an error in a run becomes
    an assistant message, never an exception out of :meth:`answer`.
    """

    def __init__(
        self,
        colleagues: Sequence[Colleague],
        *,
        hub: StreamHub | None = None,
        timeout: float = 120.0,
        lang: str = DEFAULT_LANG,
    ) -> None:
        self.hub = hub if hub is not None else get_default_hub()
        self.colleagues = {c.key: c for c in colleagues}
        self.timeout = timeout
        self.lang = wording(lang).lang  # raises for a language the demo does not speak
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiting: dict[str, int] = {}
        self._tasks: set[asyncio.Task[str]] = set()

    def ask_context(self, conversation_id: str, lang: str | None = None) -> AskContext:
        """The ``ask_colleague`` tool's context in ``conversation_id``, in ``lang`` (default:
        the agent's)."""
        return AskContext(
            self.colleagues, conversation_id, self.timeout, wording(lang or self.lang)
        )

    @abc.abstractmethod
    async def run(self, conversation_id: str, text: str, lang: str) -> str:
        """Run the kernel's agent on the user's ``text`` in ``conversation_id`` (with what
        it remembers of the conversation); the answer, in ``lang``."""

    def submit(self, conversation_id: str, text: str, lang: str | None = None) -> str | None:
        """Queue a user message for answering in ``lang`` (default: the agent's); ``None``
        when queued, else the reason it was not (``busy``). Call on the event loop; the
        answer goes out as ``chat_event``s."""
        if self._waiting.get(conversation_id, 0) >= _MAX_QUEUED_PER_CONVERSATION:
            return "busy"
        self._waiting[conversation_id] = self._waiting.get(conversation_id, 0) + 1
        task = asyncio.get_running_loop().create_task(
            self._answer_in_turn(conversation_id, text, lang)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return None

    async def _answer_in_turn(self, conversation_id: str, text: str, lang: str | None) -> str:
        lock = self._locks.setdefault(conversation_id, asyncio.Lock())
        try:
            async with lock:
                return await self.answer(conversation_id, text, lang)
        finally:
            left = self._waiting.get(conversation_id, 1) - 1
            if left > 0:
                self._waiting[conversation_id] = left
            else:
                self._waiting.pop(conversation_id, None)
                self._locks.pop(conversation_id, None)

    async def answer(self, conversation_id: str, text: str, lang: str | None = None) -> str:
        """Show the user's message, run the agent on it, show and return the answer, in
        ``lang`` (default: the agent's; raises ``ValueError`` for one the demo does not
        speak)."""
        words = wording(lang or self.lang)
        hub = self.hub
        hub.publish_chat_event(
            message_event(conversation_id, "user", text), conversation_id=conversation_id
        )
        try:
            answer = await self.run(conversation_id, text, words.lang)
        except Exception as exc:
            logger.exception("demo agent: the run failed")
            answer = words.failed.format(error=f"{type(exc).__name__}: {exc}")
        hub.publish_chat_event(
            message_event(conversation_id, "assistant", answer), conversation_id=conversation_id
        )
        return answer

    async def aclose(self) -> None:
        """Cancel the runs still going (their tool calls get their aborted terminals)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
