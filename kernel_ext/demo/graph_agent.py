"""The demo's agent on LangGraph (``kernel-ext demo --kernel langgraph``): the same
conversation as the pydantic-ai agent of :mod:`kernel_ext.demo.worker`, driven by a
LangGraph graph and instrumented through
:func:`kernel_ext.integrations.langchain.langchain_targets`.

* The graph is the classic tool loop: a model node, LangGraph's ``ToolNode`` with the
  ``ask_colleague`` tool, ``tools_condition`` between them, an ``InMemorySaver``
  checkpointer. The conversation is LangGraph's ``thread_id``: the checkpointer keeps each
  conversation's messages (the last 64 conversations), and the integration takes the tool
  call's conversation id from it.
* The model is :class:`ScriptedChatModel` (no network, no API key), the pydantic-ai
  model's twin: for a user message, one ``ask_colleague`` tool call per colleague the
  message names (:func:`kernel_ext.demo.script.colleagues_for`), all in one ``AIMessage``,
  so ``ToolNode`` runs them concurrently; once they returned, the answer
  (:func:`kernel_ext.demo.agent.scripted_answer`: a stopped call's colleague is named as
  stopped).
* The worker enables kernel_ext with ``targets=langchain_targets()``: each tool call gets its
  ``execute_tool`` span (callId = its id) and the active tool call while the tool runs; the
  tool sends the kernel's ``chat_event`` snapshots around its work
  (:func:`kernel_ext.demo.agent.with_tool_snapshots`, as the pydantic-ai agent's capability
  does) and asks the colleague (:func:`kernel_ext.demo.agent.ask`).

Requires langgraph ≥ 1.0 and langchain-core ≥ 1.0 (the ``demo`` extra).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from kernel_ext.demo.agent import (
    MAX_CONVERSATIONS,
    Colleague,
    ConversationAgent,
    ask,
    scripted_answer,
    with_tool_snapshots,
)
from kernel_ext.demo.script import DEFAULT_LANG, LANGS, colleagues_for, wording
from kernel_ext.integrations.langchain import thread_id
from kernel_ext.stream import StreamHub

__all__ = ["GraphAgent", "ScriptedChatModel"]

TOOL_NAME = "ask_colleague"
_LANG = "kx_lang"  # the run's language, in its configurable


def _colleagues_asked(messages: Sequence[BaseMessage]) -> dict[str, str]:
    """The colleague each tool call of the latest ``AIMessage`` asked, by the call's id."""
    request = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
    asked: dict[str, str] = {}
    for call in request.tool_calls if request is not None else []:
        colleague = call["args"].get("colleague")
        if isinstance(colleague, str) and call["id"]:
            asked[call["id"]] = colleague
    return asked


class ScriptedChatModel(BaseChatModel):
    """The demo's chat model, answering in ``lang``: ``ask_colleague`` tool calls for a
    new user message, an answer after tool results (the messages end with
    ``ToolMessage``\\ s)."""

    lang: str = DEFAULT_LANG

    @property
    def _llm_type(self) -> str:
        return "kernel-ext-demo-scripted"

    def _reply(self, messages: Sequence[BaseMessage]) -> AIMessage:
        returns: list[ToolMessage] = []
        for message in reversed(messages):
            if not isinstance(message, ToolMessage):
                break
            returns.insert(0, message)
        if returns:
            asked = _colleagues_asked(messages)
            results = [(asked.get(m.tool_call_id), m.text) for m in returns]
            return AIMessage(content=scripted_answer(wording(self.lang), results))
        prompt = next((m.text for m in reversed(messages) if isinstance(m, HumanMessage)), "")
        return AIMessage(
            content="",
            tool_calls=[
                {
                    "name": TOOL_NAME,
                    "args": {"colleague": key, "question": prompt},
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "tool_call",
                }
                for key in colleagues_for(prompt)
            ],
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self._reply(messages))])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._generate(messages, stop)


class GraphAgent(ConversationAgent):
    """The demo's LangGraph agent (module docstring); turn-taking and errors as
    :class:`~kernel_ext.demo.agent.ConversationAgent`, whose arguments it takes.

    Its tool calls stream only where kernel_ext instruments LangChain tools
    (``kernel_ext.enable(targets=langchain_targets())``); elsewhere the tool still answers,
    without snapshots or blocks.
    """

    def __init__(
        self,
        colleagues: Sequence[Colleague],
        *,
        hub: StreamHub | None = None,
        timeout: float = 120.0,
        lang: str = DEFAULT_LANG,
    ) -> None:
        super().__init__(colleagues, hub=hub, timeout=timeout, lang=lang)
        self.models = {code: ScriptedChatModel(lang=code) for code in LANGS}
        self.checkpointer = InMemorySaver()
        builder = StateGraph(MessagesState)
        builder.add_node("agent", self._call_model)
        builder.add_node("tools", ToolNode([self._tool()]))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        self.graph = builder.compile(checkpointer=self.checkpointer, name="demo-agent")
        self._threads: OrderedDict[str, None] = OrderedDict()

    def _lang(self, config: RunnableConfig) -> str:
        lang = (config.get("configurable") or {}).get(_LANG)
        return lang if isinstance(lang, str) and lang in self.models else self.lang

    async def _call_model(
        self, state: MessagesState, config: RunnableConfig
    ) -> dict[str, list[BaseMessage]]:
        model = self.models[self._lang(config)]
        return {"messages": [await model.ainvoke(state["messages"])]}

    def _tool(self) -> BaseTool:
        async def ask_colleague(colleague: str, question: str, config: RunnableConfig) -> str:
            """Ask a colleague (``orders`` or ``carrier``) a question; returns their answer."""
            context = self.ask_context(thread_id(config) or "", self._lang(config))
            return await with_tool_snapshots(
                self.hub,
                TOOL_NAME,
                TOOL_NAME,
                {"colleague": colleague, "question": question},
                lambda: ask(context, colleague, question),
            )

        return StructuredTool.from_function(coroutine=ask_colleague, name=TOOL_NAME)

    async def run(self, conversation_id: str, text: str, lang: str) -> str:
        """One graph run on ``text`` in the thread ``conversation_id`` (the checkpointer
        holds the conversation so far), its model answering in ``lang`` (the run's
        configurable ``kx_lang``)."""
        result = await self.graph.ainvoke(
            {"messages": [HumanMessage(content=text)]},
            config={"configurable": {"thread_id": conversation_id, _LANG: lang}},
        )
        self._threads[conversation_id] = None
        self._threads.move_to_end(conversation_id)
        while len(self._threads) > MAX_CONVERSATIONS:
            forgotten, _ = self._threads.popitem(last=False)
            self.checkpointer.delete_thread(forgotten)
        answer = result["messages"][-1]
        return answer.text if isinstance(answer, BaseMessage) else str(answer)
