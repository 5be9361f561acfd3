"""One of the demo's A2A colleagues: the scripted a2a-sdk peer (:mod:`kernel_ext.testing.a2a_peer`)
saying what a real colleague would, under its own name, quiet, on 127.0.0.1 unless
``--host`` says otherwise.

The worker picks the peer's script per request (``kx.script``) and its language
(``kx.lang``, :data:`~kernel_ext.demo.script.LANG_KEY`: ``zh`` by default, or ``en``):

* ``work`` — the orders desk: envelopes (it thinks, looks the order up with its own tools,
  writes what it found) and a final answer;
* ``text`` — the third-party carrier: plain text only (the caller turns each update into
  a pseudo-envelope) and a final answer.

Each answers what it is asked: where order 42 is and when it arrives, or — a question of
:data:`SHIPPED_WORDS` — on which day it shipped (:meth:`Script.reply`).

Pacing: each step is followed by a pause of a few *beats*; ``--delay`` is the length of one
beat in seconds. At the default beat (:data:`~kernel_ext.demo.script.DEFAULT_BEAT`, 1.2 s)
a call takes about 12 s, so a person can watch each pane grow; ``kernel-ext demo --fast``
uses :data:`~kernel_ext.demo.script.FAST_BEAT`. Every stream has at most 10 running
blocks, so even the fast pace stays within the throttle (10 per second per stream) and
nothing is dropped. Every other script of the scripted peer (its faults) is unchanged.

``python -m kernel_ext.demo.colleague_server --port 8801 --name "Orders desk" --delay 1.2``
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from a2a.helpers import new_text_part

from kernel_ext.demo.script import DEFAULT_BEAT, DEFAULT_LANG, LANG_KEY
from kernel_ext.testing.a2a_peer import Play, ScriptedColleague, ScriptedPeer

__all__ = [
    "CARRIER",
    "ORDERS_DESK",
    "SHIPPED_WORDS",
    "DemoColleague",
    "Script",
    "Step",
    "Topic",
    "demo_peer",
    "main",
    "serve",
]


@dataclass(frozen=True)
class Step:
    """One ``working`` update and the beats of the pause after it. ``kind`` is the
    envelope's kind, with ``payload``; ``None`` sends ``text`` alone (no envelope)."""

    beats: float
    text: str
    kind: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Topic:
    """What a colleague says to a question containing one of ``words`` (case-insensitive):
    its steps, then its final answer."""

    words: tuple[str, ...]
    steps: tuple[Step, ...]
    answer: str


@dataclass(frozen=True)
class Script:
    """What a colleague says, in order, then its final answer. ``{question}`` in a text
    is the question asked. A question of one of its ``topics`` gets that topic's steps and
    answer instead (the first that matches)."""

    steps: tuple[Step, ...]
    answer: str
    topics: tuple[Topic, ...] = ()

    def reply(self, question: str) -> tuple[tuple[Step, ...], str]:
        """The steps and the final answer for ``question``."""
        lowered = question.lower()
        for topic in self.topics:
            if any(word in lowered for word in topic.words):
                return topic.steps, topic.answer
        return self.steps, self.answer


_SEARCH_ORDERS = {
    lang: Step(
        1.0,
        f"{calling}search_orders",
        "tool_call",
        {"name": "search_orders", "args": {"query": query, "limit": 3}},
    )
    for lang, calling, query in (("en", "Calling ", "order 42"), ("zh", "调用 ", "订单 42"))
}
_FETCH_ORDER = {
    lang: Step(
        1.0,
        f"{calling}fetch_order",
        "tool_call",
        {"name": "fetch_order", "args": {"id": 42, "include": ["shipment"]}},
    )
    for lang, calling in (("en", "Calling "), ("zh", "调用 "))
}

SHIPPED_WORDS: dict[str, tuple[str, ...]] = {
    "en": ("ship", "dispatch", "sent"),
    "zh": ("发货", "发出", "寄出"),
}
"""What asks on which day the order shipped, by language: each colleague's topic for it."""

ORDERS_DESK: dict[str, Script] = {
    "en": Script(
        steps=(
            Step(
                1.5,
                "Thinking…",
                "thinking",
                {
                    "text": "The customer asks: “{question}” I need order 42 in the order "
                    "system first, then its shipment."
                },
            ),
            _SEARCH_ORDERS["en"],
            Step(
                1.5,
                "Thinking…",
                "thinking",
                {
                    "text": "One match: #42, two items, paid on Monday, status shipped. "
                    "Fetch the shipment details."
                },
            ),
            _FETCH_ORDER["en"],
            Step(
                1.5,
                "Writing",
                "text",
                {
                    "text": "Order 42 (two items) was packed on Monday and left our "
                    "warehouse on Tuesday with the carrier, tracking number 1Z84F29A."
                },
            ),
            Step(
                1.5,
                "Calling track_parcel",
                "tool_call",
                {"name": "track_parcel", "args": {"tracking": "1Z84F29A"}},
            ),
            Step(
                1.5,
                "Thinking…",
                "thinking",
                {
                    "text": "Last carrier scan: Leipzig hub, 07:40 this morning. Their "
                    "estimate is Friday."
                },
            ),
            Step(
                1.0,
                "Writing",
                "text",
                {
                    "text": "The carrier scanned it at its Leipzig hub this morning; "
                    "delivery is expected on Friday."
                },
            ),
        ),
        answer="Order 42 left our warehouse on Tuesday and is with the carrier (tracking "
        "1Z84F29A), last scanned at the Leipzig hub this morning. Expected delivery: Friday.",
        topics=(
            Topic(
                words=SHIPPED_WORDS["en"],
                steps=(
                    Step(
                        2.0,
                        "Thinking…",
                        "thinking",
                        {
                            "text": "The customer asks: “{question}” The shipment record of "
                            "order 42 has the day."
                        },
                    ),
                    _SEARCH_ORDERS["en"],
                    replace(_FETCH_ORDER["en"], beats=2.0),
                    Step(
                        2.5,
                        "Thinking…",
                        "thinking",
                        {
                            "text": "Shipment record: packed Monday 16:20, handed to the "
                            "carrier Tuesday 09:15, tracking number 1Z84F29A."
                        },
                    ),
                    Step(
                        2.0,
                        "Writing",
                        "text",
                        {
                            "text": "Order 42 was packed on Monday afternoon and handed to "
                            "the carrier on Tuesday at 09:15."
                        },
                    ),
                ),
                answer="Order 42 shipped on Tuesday: it left our warehouse at 09:15 that "
                "morning with the carrier, tracking number 1Z84F29A.",
            ),
        ),
    ),
    "zh": Script(
        steps=(
            Step(
                1.5,
                "正在思考…",
                "thinking",
                {"text": "用户问：“{question}” 先在订单系统里找到订单 42，再查它的发货情况。"},
            ),
            _SEARCH_ORDERS["zh"],
            Step(
                1.5,
                "正在思考…",
                "thinking",
                {"text": "找到一条：#42，两件商品，周一付款，状态为已发货。接着查发货详情。"},
            ),
            _FETCH_ORDER["zh"],
            Step(
                1.5,
                "正在撰写",
                "text",
                {
                    "text": "订单 42（两件商品）周一打包，周二从我们的仓库交给承运商，"
                    "运单号 1Z84F29A。"
                },
            ),
            Step(
                1.5,
                "调用 track_parcel",
                "tool_call",
                {"name": "track_parcel", "args": {"tracking": "1Z84F29A"}},
            ),
            Step(
                1.5,
                "正在思考…",
                "thinking",
                {"text": "承运商最后一次扫描：今天早上 07:40，莱比锡转运中心。预计周五送达。"},
            ),
            Step(
                1.0,
                "正在撰写",
                "text",
                {"text": "承运商今天早上在莱比锡转运中心扫描过这个包裹，预计周五送达。"},
            ),
        ),
        answer="订单 42 已于周二从仓库发出，由承运商配送（运单号 1Z84F29A），今天早上最后一次"
        "扫描在莱比锡转运中心。预计周五送达。",
        topics=(
            Topic(
                words=SHIPPED_WORDS["zh"],
                steps=(
                    Step(
                        2.0,
                        "正在思考…",
                        "thinking",
                        {"text": "用户问：“{question}” 订单 42 的发货记录里有日期。"},
                    ),
                    _SEARCH_ORDERS["zh"],
                    replace(_FETCH_ORDER["zh"], beats=2.0),
                    Step(
                        2.5,
                        "正在思考…",
                        "thinking",
                        {
                            "text": "发货记录：周一 16:20 打包，周二 09:15 交给承运商，"
                            "运单号 1Z84F29A。"
                        },
                    ),
                    Step(
                        2.0,
                        "正在撰写",
                        "text",
                        {"text": "订单 42 周一下午打包，周二上午 09:15 交给承运商。"},
                    ),
                ),
                answer="订单 42 是周二发货的：当天上午 09:15 从我们的仓库交给承运商，"
                "运单号 1Z84F29A。",
            ),
        ),
    ),
}
"""The orders desk (script ``work``): envelopes, by language."""

_CARRIER_OPENS: dict[str, tuple[Step, ...]] = {
    "en": (
        Step(2.0, "Tracking request received for order 42"),
        Step(2.5, "Looking up parcel 1Z84F29A"),
    ),
    "zh": (
        Step(2.0, "已收到订单 42 的查询请求"),
        Step(2.5, "正在查询运单 1Z84F29A"),
    ),
}

CARRIER: dict[str, Script] = {
    "en": Script(
        steps=(
            *_CARRIER_OPENS["en"],
            Step(2.5, "Last scan: Leipzig hub, 07:40, sorted onto the delivery route"),
            Step(2.5, "Checking the delivery schedule for the destination postcode"),
        ),
        answer="Parcel 1Z84F29A (order 42) is at our Leipzig hub and scheduled for delivery "
        "on Friday between 10:00 and 14:00. No signature is needed.",
        topics=(
            Topic(
                words=SHIPPED_WORDS["en"],
                steps=(
                    *_CARRIER_OPENS["en"],
                    Step(2.5, "First scan: picked up from the sender, Tuesday 09:15"),
                    Step(2.5, "Checking the pickup record"),
                ),
                answer="We picked up parcel 1Z84F29A (order 42) from the sender on Tuesday "
                "at 09:15.",
            ),
        ),
    ),
    "zh": Script(
        steps=(
            *_CARRIER_OPENS["zh"],
            Step(2.5, "最后扫描：莱比锡转运中心 07:40，已分拣到派送线路"),
            Step(2.5, "正在查询收件地邮编的派送安排"),
        ),
        answer="运单 1Z84F29A（订单 42）目前在莱比锡转运中心，预计周五 10:00–14:00 派送，"
        "无需签收。",
        topics=(
            Topic(
                words=SHIPPED_WORDS["zh"],
                steps=(
                    *_CARRIER_OPENS["zh"],
                    Step(2.5, "首次扫描：周二 09:15 从寄件方揽收"),
                    Step(2.5, "正在核对揽收记录"),
                ),
                answer="运单 1Z84F29A（订单 42）于周二 09:15 从寄件方揽收。",
            ),
        ),
    ),
}
"""The third-party carrier (script ``text``): plain text, by language."""


def _lang_of(meta: Mapping[str, Any]) -> str:
    lang = meta.get(LANG_KEY)
    return lang if isinstance(lang, str) and lang in ORDERS_DESK else DEFAULT_LANG


class DemoColleague(ScriptedColleague):
    """The demo's colleague: :data:`ORDERS_DESK` for ``work``, :data:`CARRIER` for
    ``text``, in the language the request asks for, ``delay`` seconds per beat."""

    async def _work(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await self._play(play, ORDERS_DESK[_lang_of(meta)], question)

    async def _text(self, play: Play, question: str, meta: Mapping[str, Any]) -> None:
        await self._play(play, CARRIER[_lang_of(meta)], question)

    @staticmethod
    async def _play(play: Play, script: Script, question: str) -> None:
        beat = play.delay
        steps, answer = script.reply(question)
        for step in steps:
            play.delay = beat * step.beats
            if step.kind is None:
                await play.working([new_text_part(step.text)])
                await play.pause()
                continue
            payload = dict(step.payload)
            if isinstance(payload.get("text"), str):
                payload["text"] = payload["text"].replace("{question}", question)
            await play.step(step.kind, payload, step.text)
        await play.updater.complete(play.text_message(answer))


def demo_peer(url: str, *, name: str, beat: float = DEFAULT_BEAT) -> ScriptedPeer:
    """The A2A server of one demo colleague (:class:`DemoColleague`) at ``url``."""
    return ScriptedPeer(url, name=name, colleague=DemoColleague(delay=beat))


async def serve(host: str, port: int, name: str, delay: float, log_level: str) -> None:
    """Serve one scripted colleague until uvicorn is told to stop (SIGINT/SIGTERM); every
    execution still running is ended on the way out."""
    import uvicorn

    peer = demo_peer(f"http://{host}:{port}/", name=name, beat=delay)
    config = uvicorn.Config(
        peer.app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        await peer.aclose()


def main(argv: list[str] | None = None) -> int:
    """``python -m kernel_ext.demo.colleague_server --port P [--name N] [--delay S]``."""
    parser = argparse.ArgumentParser(prog="python -m kernel_ext.demo.colleague_server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="Scripted colleague")
    parser.add_argument(
        "--delay", type=float, default=DEFAULT_BEAT, help=f"seconds per beat ({DEFAULT_BEAT})"
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="colleague %(levelname)s %(message)s")
    asyncio.run(serve(args.host, args.port, args.name, args.delay, args.log_level))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
