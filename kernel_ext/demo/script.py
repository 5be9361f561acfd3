"""What the demo's agent is asked, whom it asks, and the words the demo uses in each of its
languages: shared by the worker, the page and ``--headless`` (no third-party imports, so it
loads on every Python).

The agent's model is scripted (:mod:`kernel_ext.demo.worker`): it asks the colleagues that a
message names (:func:`colleagues_for`), all at once in one model response, and then writes
an answer from what they returned. What the colleagues say is in
:mod:`kernel_ext.demo.colleague_server`; the detail pane's own labels are
:data:`kernel_ext.viewing.view.LABELS` (the page takes them from ``renderer.js``, which holds the
same, checked by a test), never copied here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "COLLEAGUES",
    "DEFAULT_BEAT",
    "DEFAULT_KERNEL",
    "DEFAULT_LANG",
    "FALLBACK_LANG",
    "FAST_BEAT",
    "KERNELS",
    "LANGS",
    "LANG_KEY",
    "MAX_CONVERSATIONS",
    "MAX_MESSAGE_CHARS",
    "USER_MESSAGE",
    "USER_MESSAGE_TO_AGENT",
    "WORDING",
    "ColleagueSpec",
    "Wording",
    "colleagues_for",
    "is_conversation_id",
    "lang_of_locale",
    "pick_lang",
    "wording",
]

LANGS: tuple[str, ...] = ("zh", "en")
"""The demo's languages (``--lang``)."""

DEFAULT_LANG = "zh"
"""The spec's language: what the agent and the colleagues speak when a message does not say
(the page's and ``--headless``'s messages always do), and ``tail``'s default."""

FALLBACK_LANG = "en"
"""The language of a page (or ``--headless`` run) whose browser (or locale) prefers none of
:data:`LANGS`: :func:`pick_lang`."""

KERNELS: tuple[str, ...] = ("pydantic-ai", "langgraph")
"""The agent kernels the demo's worker can run (``--kernel``): a pydantic-ai ``Agent``
(:mod:`kernel_ext.demo.worker`) or a LangGraph graph (:mod:`kernel_ext.demo.graph_agent`)."""

DEFAULT_KERNEL = "pydantic-ai"

DEFAULT_BEAT = 1.2
"""The colleagues' pace by default, in seconds per beat (a step takes 1–2.5 beats): a call
takes about 12 s, so a person can watch each pane grow (:mod:`kernel_ext.demo.colleague_server`)."""

FAST_BEAT = 0.05
"""The pace of ``kernel-ext demo --fast`` (tests, CI): a call takes well under a second."""


@dataclass(frozen=True)
class ColleagueSpec:
    """One A2A colleague of the demo: ``key`` is what the agent's tool call names,
    ``script`` the scripted peer's behaviour (``work``: envelopes with thinking, its own
    tool calls and text; ``text``: a third-party peer that sends plain text only);
    ``title`` its English name (the A2A agent card's), ``words`` what names it in a
    message."""

    key: str
    title: str
    script: str
    words: tuple[str, ...]


COLLEAGUES: tuple[ColleagueSpec, ...] = (
    ColleagueSpec("orders", "Orders desk", "work", ("orders", "order desk", "订单")),
    ColleagueSpec("carrier", "Carrier (third-party)", "text", ("carrier", "shipping", "物流")),
)
"""The two colleagues, each served by its own scripted A2A peer process."""


@dataclass(frozen=True)
class Wording:
    """Everything the demo says in one language, but the pane's labels and the colleagues'
    work.

    ``tag`` is the page's ``<html lang>``, ``name`` the language's own name (the page's
    switch); ``questions`` are sent in order by
    ``--headless`` (the page sends the first by itself and offers the others);
    ``titles`` name the colleagues by key; ``page`` holds the page's own words (served to
    it in ``/demo/config.json``; ``{id}`` and ``{error}`` are filled in by the page).
    """

    lang: str
    tag: str
    name: str
    questions: tuple[str, ...]
    titles: Mapping[str, str]
    colon: str
    answer_one: str
    answer_many: str
    stopped_one: str
    no_such_colleague: str
    could_not_answer: str
    failed: str
    page: Mapping[str, str]

    def title(self, key: str) -> str:
        """The colleague ``key``'s name in this language (the key itself if unknown)."""
        return self.titles.get(key, key)

    def answer(self, returns: Sequence[str], stopped: Sequence[str] = ()) -> str:
        """The scripted model's answer once its tool calls returned ``returns`` and the
        person stopped the calls to the colleagues named ``stopped``: an intro (one
        colleague or several) and each return on its own line (no intro when every call
        was stopped), then a line for each stopped colleague saying the answer goes
        without it."""
        lines: list[str] = []
        if returns or not stopped:
            lines += [self.answer_many if len(returns) > 1 else self.answer_one, *returns]
        lines += [self.stopped_one.format(title=title) for title in stopped]
        return "\n".join(lines)


WORDING: dict[str, Wording] = {
    "zh": Wording(
        lang="zh",
        tag="zh-CN",
        name="中文",
        questions=(
            "订单 42 现在在哪里？什么时候能到？请问一下两位同事。",
            "再问一下订单组：订单 42 是哪天发货的？",
        ),
        titles={"orders": "订单组", "carrier": "承运商（第三方）"},
        colon="：",
        answer_one="同事的答复：",
        answer_many="两位同事的答复：",
        stopped_one="你在{title}回答之前停止了它，所以这个答复没有它的信息。",
        no_such_colleague="没有名为 {key} 的同事。",
        could_not_answer="{title}无法回答：{error}",
        failed="抱歉，智能体出错了：{error}",
        page={
            "title": "kernel_ext 演示 · ask_colleague 实时过程",
            "brandSub": "演示",
            "taglineBefore": "每次",
            "taglineAfter": "调用是聊天流中的一个节点；展开它，实时查看同事的工作过程。",
            "connecting": "连接中…",
            "connected": "已连接",
            "reconnecting": "正在重新连接…",
            "refused": "连接被拒绝",
            "closedByServer": "服务器已断开连接",
            "placeholder": "给智能体发消息…",
            "send": "发送",
            "you": "你",
            "agent": "智能体",
            "follow": "在终端里跟随：",
            "joinFailed": "无法加入 {id}：{error}",
            "notTaken": "智能体没有接收这条消息：{error}",
            "notSent": "消息没有发出：{error}",
            "noAnswer": "没有应答",
        },
    ),
    "en": Wording(
        lang="en",
        tag="en",
        name="English",
        questions=(
            "Where is order 42, and when will it arrive? Please ask both colleagues.",
            "Ask the orders desk once more: on which day did order 42 ship?",
        ),
        titles={"orders": "Orders desk", "carrier": "Carrier (third-party)"},
        colon=": ",
        answer_one="Here is what my colleague said:",
        answer_many="Here is what my colleagues said:",
        stopped_one="You stopped {title} before it answered, so this answer goes without it.",
        no_such_colleague="There is no colleague called {key}.",
        could_not_answer="{title} could not answer: {error}",
        failed="Sorry, the agent failed: {error}",
        page={
            "title": "kernel_ext demo · ask_colleague, live",
            "brandSub": "demo",
            "taglineBefore": "Each",
            "taglineAfter": "call is one node; open it to watch the colleague work, live.",
            "connecting": "connecting…",
            "connected": "connected",
            "reconnecting": "reconnecting…",
            "refused": "refused",
            "closedByServer": "disconnected by the server",
            "placeholder": "Message the agent…",
            "send": "Send",
            "you": "you",
            "agent": "agent",
            "follow": "Follow it in a terminal:",
            "joinFailed": "Could not join {id}: {error}",
            "notTaken": "The agent did not take the message: {error}",
            "notSent": "The message was not sent: {error}",
            "noAnswer": "no answer",
        },
    ),
}
"""The demo's words by language (:data:`LANGS`)."""


def wording(lang: str = DEFAULT_LANG) -> Wording:
    """The :class:`Wording` of ``lang``; raises ``ValueError`` for a language the demo
    does not speak."""
    try:
        return WORDING[lang]
    except KeyError:
        raise ValueError(f"the demo speaks {' and '.join(LANGS)}, not {lang!r}") from None


def pick_lang(preferences: Iterable[str]) -> str:
    """The first of ``preferences`` (language tags or locale names, most preferred first:
    ``zh-CN``, ``en_GB.UTF-8``) whose primary language (before ``-``, ``_`` or ``.``, any
    case) is one of :data:`LANGS`; else :data:`FALLBACK_LANG`. The page's ``app.js`` applies
    the same rule to ``navigator.languages``."""
    for preference in preferences:
        primary = re.split(r"[-_.@]", preference.strip(), maxsplit=1)[0].lower()
        if primary in LANGS:
            return primary
    return FALLBACK_LANG


def lang_of_locale(environ: Mapping[str, str]) -> str:
    """The language of ``kernel-ext demo --headless`` without ``--lang``: :func:`pick_lang`
    of the locale that names messages (the first set of ``LC_ALL``, ``LC_MESSAGES``,
    ``LANG``); :data:`FALLBACK_LANG` when none is set or it is ``C``/``POSIX``."""
    for name in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = environ.get(name, "")
        if value:
            return pick_lang([value])
    return FALLBACK_LANG


USER_MESSAGE = "user_message"
"""Browser → web process: a joined browser's message to the agent, ``{conversationId, text,
lang}`` (``lang``, optional, one of :data:`LANGS`: the language of the answer)."""
USER_MESSAGE_TO_AGENT = "kx_user_message"
"""Web process → the agent's internal connection: that message, forwarded."""

LANG_KEY = "kx.lang"
"""The A2A message metadata key by which the worker tells a colleague the language."""

MAX_MESSAGE_CHARS = 2_000
"""The longest message a browser may send to the agent."""

MAX_CONVERSATIONS = 64
"""How many conversations the demo remembers — the agent their messages, the web process
their page history — the least recently active one forgotten first."""

_CONVERSATION_ID = re.compile(r"demo-[A-Za-z0-9_-]{1,64}")
_BOTH = ("both", "all", "everyone", "两位", "都")


def is_conversation_id(value: object) -> bool:
    """Whether ``value`` is a demo conversation id (``demo-`` and 1–64 of ``[A-Za-z0-9_-]``);
    browsers may join only these."""
    return isinstance(value, str) and _CONVERSATION_ID.fullmatch(value) is not None


def colleagues_for(text: str) -> list[str]:
    """The keys of the colleagues a message asks for, in :data:`COLLEAGUES` order: every
    colleague when it says "both"/"all" or names several, the one it names, else the
    orders desk (the colleague whose work shows the most)."""
    lowered = text.lower()
    if any(word in lowered for word in _BOTH):
        return [spec.key for spec in COLLEAGUES]
    named = [spec.key for spec in COLLEAGUES if any(word in lowered for word in spec.words)]
    return named or [COLLEAGUES[0].key]
