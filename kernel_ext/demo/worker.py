"""The demo's worker process: a real pydantic-ai agent (or, with ``--kernel langgraph``, a
LangGraph graph: :mod:`kernel_ext.demo.graph_agent`) whose ``ask_colleague`` tool streams
each colleague's work, live, into that tool call's detail pane.

The model is scripted (no network, no API key): it calls ``ask_colleague`` once per
colleague a message names, all in one response, so the calls run concurrently, then answers
in the message's language. :func:`kernel_ext.enable` wires the stream hub, the span
processor and one :class:`~kernel_ext.emit.LoopbackEmitter`, through which everything
reaches the web process; each call's tool-event snapshot (:class:`ChatEventCapability`)
leaves before any block of the call. User messages arrive as ``kx_user_message`` over a
second internal connection (:mod:`kernel_ext.demo.web`).

Run by ``kernel-ext demo``; on its own::

    KERNEL_EXT_SECRET=… python -m kernel_ext.demo.worker --relay http://127.0.0.1:8000 \\
        --colleague orders=http://127.0.0.1:8801/ --colleague carrier=http://127.0.0.1:8802/ \\
        [--lang en] [--kernel langgraph]

Requires Python ≥ 3.11 (pydantic-ai-slim) and the ``a2a`` extra; ``--kernel langgraph``
langgraph and langchain-core (all in the ``demo`` extra).
Design: docs/contracts.md, "The demo's processes".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import socketio
from opentelemetry.sdk.trace import TracerProvider
from pydantic_ai import Agent, RunContext, Tool
from pydantic_ai.capabilities import AbstractCapability, Instrumentation
from pydantic_ai.capabilities.abstract import (
    CapabilityOrdering,
    ValidatedToolArgs,
    WrapToolExecuteHandler,
)
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings
from pydantic_ai.tools import ToolDefinition

from kernel_ext.demo.agent import (
    MAX_CONVERSATIONS,
    AskContext,
    Colleague,
    ConversationAgent,
    ask,
    message_event,
    scripted_answer,
    with_tool_snapshots,
)
from kernel_ext.demo.script import (
    COLLEAGUES,
    DEFAULT_KERNEL,
    DEFAULT_LANG,
    KERNELS,
    LANGS,
    MAX_MESSAGE_CHARS,
    USER_MESSAGE_TO_AGENT,
    colleagues_for,
    wording,
)
from kernel_ext.integrations.pydantic_ai import KernelExtCapability
from kernel_ext.protocol import NAMESPACE
from kernel_ext.settings import env_name, load_settings
from kernel_ext.stream import StreamHub, get_default_hub
from kernel_ext.worker.wiring import adisable, enable

__all__ = [
    "ChatEventCapability",
    "Colleague",
    "DemoAgent",
    "main",
    "message_event",
    "scripted_model",
    "serve",
]
# Colleague and message_event live in kernel_ext.demo.agent, shared with the LangGraph agent.

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Deps:
    ask: AskContext


# -- the scripted model ------------------------------------------------------------------


ModelFunction = Callable[[list[ModelMessage], AgentInfo], ModelResponse]


def scripted_model(lang: str = DEFAULT_LANG) -> ModelFunction:
    """The demo's model, answering in ``lang``: tool calls for a new user message, an
    answer after tool returns.

    For the latest user prompt it returns one ``ask_colleague`` call per colleague the
    prompt names (several calls in one response run concurrently); once the calls have
    returned, a text answer quoting each colleague and saying which one the user stopped
    (:func:`~kernel_ext.demo.agent.scripted_answer`).
    """
    words = wording(lang)

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        parts = last.parts if isinstance(last, ModelRequest) else []
        returns = [part for part in parts if isinstance(part, ToolReturnPart)]
        if returns:
            asked = _colleagues_asked(messages)
            results = [(asked.get(part.tool_call_id), str(part.content)) for part in returns]
            return ModelResponse(parts=[TextPart(scripted_answer(words, results))])
        prompt = next(
            (part.content for part in reversed(parts) if isinstance(part, UserPromptPart)), ""
        )
        text = prompt if isinstance(prompt, str) else " ".join(str(item) for item in prompt)
        return ModelResponse(
            parts=[
                ToolCallPart("ask_colleague", {"colleague": key, "question": text})
                for key in colleagues_for(text)
            ]
        )

    return model


def _colleagues_asked(messages: list[ModelMessage]) -> dict[str, str]:
    """The colleague each ``ask_colleague`` call of the latest model response asked, by
    the call's ``tool_call_id``."""
    response = next((m for m in reversed(messages) if isinstance(m, ModelResponse)), None)
    asked: dict[str, str] = {}
    for part in response.parts if response is not None else []:
        if isinstance(part, ToolCallPart):
            colleague = part.args_as_dict().get("colleague")
            if isinstance(colleague, str):
                asked[part.tool_call_id] = colleague
    return asked


# -- the kernel's tool-event snapshots ---------------------------------------------------


@dataclass
class ChatEventCapability(AbstractCapability[Any]):
    """Sends the kernel's ``chat_event`` snapshot of each tool call: ``calling`` before the
    tool's code runs (so before any of its blocks), ``finished`` with ``toolReturn`` after.

    It runs inside :class:`KernelExtCapability`, so the active tool call (and with it the
    callId, the ``execute_tool`` span's id) is known. A call without an active tool call (no
    span) runs without snapshots. Exceptions from the tool propagate unchanged, after a
    ``finished`` snapshot whose ``toolReturn`` is the error.
    """

    hub: StreamHub | None = None

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None

    def get_ordering(self) -> CapabilityOrdering:
        return CapabilityOrdering(wrapped_by=[KernelExtCapability])

    # pydantic-ai's capability hook: its signature, as in kernel_ext.integrations.pydantic_ai.
    async def wrap_tool_execute(
        self,
        ctx: RunContext[Any],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: ValidatedToolArgs,
        handler: WrapToolExecuteHandler,
    ) -> Any:
        hub = self.hub if self.hub is not None else get_default_hub()
        return await with_tool_snapshots(
            hub, tool_def.name, call.tool_name, call.args_as_dict(), lambda: handler(args)
        )


# -- the agent ---------------------------------------------------------------------------


async def _ask_colleague(ctx: RunContext[_Deps], colleague: str, question: str) -> str:
    """Ask a colleague (``orders`` or ``carrier``) a question; returns their answer."""
    return await ask(ctx.deps.ask, colleague, question)


class DemoAgent(ConversationAgent):
    """The demo's pydantic-ai agent: one ``Agent``, instrumented, and per-conversation
    message history (the last 64 conversations); turn-taking and errors as
    :class:`~kernel_ext.demo.agent.ConversationAgent`.

    ``tracer_provider`` is where tool spans go; it must carry a
    :class:`~kernel_ext.attribution.processor.ToolSpanProcessor` for the tap
    (:func:`kernel_ext.enable` adds one). The other arguments are
    :class:`~kernel_ext.demo.agent.ConversationAgent`'s.
    """

    def __init__(
        self,
        colleagues: Sequence[Colleague],
        tracer_provider: TracerProvider,
        *,
        hub: StreamHub | None = None,
        timeout: float = 120.0,
        lang: str = DEFAULT_LANG,
    ) -> None:
        super().__init__(colleagues, hub=hub, timeout=timeout, lang=lang)
        self.models = {
            code: FunctionModel(scripted_model(code), model_name="scripted") for code in LANGS
        }
        self.agent: Agent[_Deps, str] = Agent(
            self.models[self.lang],
            deps_type=_Deps,
            output_type=str,
            name="demo-agent",
            tools=[Tool(_ask_colleague, name="ask_colleague")],
            capabilities=[
                Instrumentation(InstrumentationSettings(tracer_provider=tracer_provider)),
                KernelExtCapability(sink=self.hub, tracer_provider=tracer_provider),
                ChatEventCapability(hub=self.hub),
            ],
        )
        self._history: OrderedDict[str, list[ModelMessage]] = OrderedDict()

    async def run(self, conversation_id: str, text: str, lang: str) -> str:
        """One pydantic-ai run on ``text`` with the conversation's message history, its
        model answering in ``lang``."""
        result = await self.agent.run(
            text,
            model=self.models[lang],
            deps=_Deps(self.ask_context(conversation_id, lang)),
            message_history=self._history.get(conversation_id),
            conversation_id=conversation_id,
        )
        self._history[conversation_id] = result.all_messages()
        self._history.move_to_end(conversation_id)
        while len(self._history) > MAX_CONVERSATIONS:
            self._history.popitem(last=False)
        return result.output


# -- the process -------------------------------------------------------------------------


def _valid_message(data: Any) -> tuple[str, str, str | None] | None:
    from kernel_ext.demo.script import is_conversation_id

    if not isinstance(data, Mapping):
        return None
    conversation_id, text, lang = data.get("conversationId"), data.get("text"), data.get("lang")
    if not is_conversation_id(conversation_id) or not isinstance(text, str):
        return None
    if lang is not None and lang not in LANGS:
        return None
    text = text.strip()
    if not text or len(text) > MAX_MESSAGE_CHARS:
        return None
    return conversation_id, text, lang  # type: ignore[return-value]


async def serve(
    relay_url: str,
    secret: str,
    colleagues: Sequence[Colleague],
    *,
    stop: asyncio.Event | None = None,
    timeout: float = 120.0,
    lang: str = DEFAULT_LANG,
    kernel: str = DEFAULT_KERNEL,
) -> None:
    """Run the worker until ``stop`` is set (or the task is cancelled): connect the loopback
    emitter and the agent's control connection to the relay at ``relay_url``, answer every
    ``kx_user_message``. The pipeline is wired by :func:`kernel_ext.enable` (stream hub,
    span processor on a private ``TracerProvider``, loopback emitter) and undone by
    :func:`kernel_ext.disable`. Cleans up in ``finally``: runs cancelled (their streams end
    with an aborted terminal), queued blocks flushed for up to 5 s, connections closed."""
    stop = stop if stop is not None else asyncio.Event()
    provider = TracerProvider()  # private: spans give callIds here and are exported nowhere
    agent: ConversationAgent
    if kernel == "langgraph":
        from kernel_ext.demo.graph_agent import GraphAgent
        from kernel_ext.integrations.langchain import langchain_targets

        wired = enable(
            relay_url=relay_url,
            secret=secret,
            tracer_provider=provider,
            targets=langchain_targets(),
        )
        agent = GraphAgent(colleagues, hub=wired.hub, timeout=timeout, lang=lang)
    elif kernel == "pydantic-ai":
        wired = enable(relay_url=relay_url, secret=secret, tracer_provider=provider)
        agent = DemoAgent(colleagues, provider, hub=wired.hub, timeout=timeout, lang=lang)
    else:
        raise ValueError(f"the demo's kernels are {', '.join(KERNELS)}, not {kernel!r}")
    control = socketio.AsyncClient(reconnection=True, reconnection_delay_max=2, handle_sigint=False)

    async def on_user_message(data: Any = None) -> dict[str, Any]:
        message = _valid_message(data)
        if message is None:
            return {"ok": False, "error": "a message is {conversationId, text, lang?}"}
        problem = agent.submit(*message)
        return {"ok": True} if problem is None else {"ok": False, "error": problem}

    control.on(USER_MESSAGE_TO_AGENT, on_user_message, namespace=NAMESPACE)
    try:
        await control.connect(
            relay_url,
            auth={"internal": secret, "role": "agent", "kernel": kernel},
            namespaces=[NAMESPACE],
            transports=["websocket"],
            wait_timeout=10,
            retry=True,
        )
        logger.info("demo worker: connected to %s", relay_url)
        await stop.wait()
    finally:
        await agent.aclose()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(control.disconnect(), 5)
        await adisable(5)
        provider.shutdown()


def _colleague_arg(value: str) -> tuple[str, str]:
    key, sep, url = value.partition("=")
    if not sep or not key or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected KEY=URL, got {value!r}")
    return key, url


def main(argv: list[str] | None = None) -> int:
    """``python -m kernel_ext.demo.worker --relay URL --colleague KEY=URL ...``."""
    parser = argparse.ArgumentParser(prog="python -m kernel_ext.demo.worker")
    parser.add_argument("--relay", required=True, help="the web process, http://127.0.0.1:8000")
    parser.add_argument(
        "--colleague",
        action="append",
        type=_colleague_arg,
        default=[],
        help="KEY=URL of a colleague (keys: " + ", ".join(s.key for s in COLLEAGUES) + ")",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="per colleague answer (s)")
    parser.add_argument(
        "--lang",
        choices=LANGS,
        default=DEFAULT_LANG,
        help="the agent's language for a message that does not say its own",
    )
    parser.add_argument(
        "--kernel", choices=KERNELS, default=DEFAULT_KERNEL, help="the agent's kernel"
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="worker %(levelname)s %(message)s")
    secret = load_settings().secret_value()
    if not secret:
        parser.error(f"set {env_name('secret')} to the relay's internal secret")
    urls = dict(args.colleague)
    words = wording(args.lang)
    colleagues = [
        Colleague(spec.key, words.title(spec.key), urls[spec.key], spec.script)
        for spec in COLLEAGUES
        if spec.key in urls
    ]

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await serve(
            args.relay,
            secret,
            colleagues,
            stop=stop,
            timeout=args.timeout,
            lang=args.lang,
            kernel=args.kernel,
        )

    asyncio.run(run())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
