"""What the demo's agent is asked and whom it asks: shared by the worker, the page and
``--headless`` (no third-party imports, so it loads on every Python).

The agent's model is scripted (:mod:`kernel_ext.demo.worker`): it asks the colleagues that a
message names (:func:`colleagues_for`), all at once in one model response, and then writes
an answer from what they returned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "COLLEAGUES",
    "FIRST_QUESTION",
    "MAX_MESSAGE_CHARS",
    "QUESTIONS",
    "SECOND_QUESTION",
    "USER_MESSAGE",
    "USER_MESSAGE_TO_AGENT",
    "ColleagueSpec",
    "colleagues_for",
    "is_conversation_id",
]


@dataclass(frozen=True)
class ColleagueSpec:
    """One A2A colleague of the demo: ``key`` is what the agent's tool call names,
    ``script`` the scripted peer's behaviour (``work``: envelopes with thinking, its own
    tool calls and text; ``text``: a third-party peer that sends plain text only)."""

    key: str
    title: str
    script: str
    words: tuple[str, ...]


COLLEAGUES: tuple[ColleagueSpec, ...] = (
    ColleagueSpec("orders", "Orders desk", "work", ("orders", "order desk", "订单")),
    ColleagueSpec("carrier", "Carrier (third-party)", "text", ("carrier", "shipping", "物流")),
)
"""The two colleagues, each served by its own scripted A2A peer process."""

FIRST_QUESTION = "Where is order 42, and when will it arrive? Please ask both colleagues."
"""Sent when the page opens (and first by ``--headless``): two concurrent calls."""

SECOND_QUESTION = "Ask the orders desk once more: on which day did order 42 ship?"
"""Offered on the page (and sent second by ``--headless``): one call."""

QUESTIONS: tuple[str, ...] = (FIRST_QUESTION, SECOND_QUESTION)

USER_MESSAGE = "user_message"
"""Browser → web process: a joined browser's message to the agent."""
USER_MESSAGE_TO_AGENT = "kx_user_message"
"""Web process → the agent's internal connection: that message, forwarded."""
"""The scripted conversation of ``kernel-ext demo --headless``, in order."""

MAX_MESSAGE_CHARS = 2_000
"""The longest message a browser may send to the agent."""

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
