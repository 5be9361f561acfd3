"""``kernel-ext demo``: the scripted agent, the demo relay's browser → worker path, and the
whole demo as a subprocess (``--headless``, ``--redis``, a child that dies, Ctrl-C/SIGTERM).
The agent and the headless demo run on each kernel (``--kernel``: pydantic-ai, langgraph).

The agent needs pydantic-ai (Python ≥ 3.11): those tests skip without it; the relay and
the "needs Python 3.11" message are tested everywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any

import pytest
import socketio
from support.network import RedisServer, free_port, serve_asgi, started
from support.timing import wait_until

from kernel_ext.demo import EXIT_UNAVAILABLE, add_arguments, run
from kernel_ext.demo.script import (
    DEFAULT_BEAT,
    FAST_BEAT,
    KERNELS,
    LANGS,
    MAX_MESSAGE_CHARS,
    colleagues_for,
    is_conversation_id,
    wording,
)
from kernel_ext.web import vendored_client

NS = "/chat"
SECRET = "demo-test-secret"
PY_REASON = "kernel-ext demo needs pydantic-ai, which needs Python >= 3.11"
CALL_HEADER = re.compile(r"^\[([0-9a-f]{8})\] ── ask_colleague ([0-9a-f]{16})$")
CJK = re.compile("[\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef]")
FIRST_QUESTION, SECOND_QUESTION = wording().questions


def _pydantic_ai() -> None:
    pytest.importorskip("pydantic_ai", reason=PY_REASON)


def _kernel(kernel: str) -> None:
    """Skip unless the demo can run with its agent on ``kernel`` here."""
    _pydantic_ai()
    if kernel == "langgraph":
        pytest.importorskip("langgraph", reason="--kernel langgraph needs langgraph")


# -- what runs everywhere -----------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_demo_on_python_3_10_exits_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "version_info", (3, 10, 13, "final", 0))
    err = io.StringIO()
    assert run(_args("--headless"), err=err) == EXIT_UNAVAILABLE
    message = err.getvalue()
    assert "Python 3.11 or newer" in message
    assert "3.10.13" in message


def test_the_kernel_is_pydantic_ai_by_default_or_langgraph_on_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert KERNELS == ("pydantic-ai", "langgraph")
    assert _args().kernel == "pydantic-ai"
    assert _args("--kernel", "langgraph").kernel == "langgraph"
    with pytest.raises(SystemExit):
        _args("--kernel", "crewai")


@pytest.mark.skipif(
    sys.version_info < (3, 11), reason="on 3.10 the demo first says it needs 3.11 (above)"
)
def test_without_langgraph_the_langgraph_kernel_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without langgraph (a fault this environment cannot cause: it is installed) the
    # langgraph kernel says what to install, and the default kernel still runs.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "langgraph" else real(name, *a),
    )
    err = io.StringIO()
    assert run(_args("--headless", "--kernel", "langgraph"), err=err) == EXIT_UNAVAILABLE
    assert "kernel-ext demo needs langgraph: install the demo extra" in err.getvalue()
    from kernel_ext.demo import missing_requirements

    assert missing_requirements() is None


@pytest.mark.parametrize("lang", LANGS)
def test_the_agent_asks_the_colleagues_a_message_names(lang: str) -> None:
    first, second = wording(lang).questions
    assert colleagues_for(first) == ["orders", "carrier"]
    assert colleagues_for(second) == ["orders"]
    assert colleagues_for("what does the carrier say?") == ["carrier"]
    assert colleagues_for("hello") == ["orders"]


@pytest.mark.parametrize(
    ("preferences", "lang"),
    [
        (["zh-CN"], "zh"),
        (["zh"], "zh"),
        (["ZH_tw.UTF-8"], "zh"),
        (["zh-Hant-TW"], "zh"),
        (["en-GB", "zh-CN"], "en"),
        (["fr-FR", "zh-CN", "en"], "zh"),  # the first the demo speaks
        (["fr-FR", "de"], "en"),  # none: the fallback
        (["zhx-CN", "english"], "en"),  # the primary language must match whole
        (["C"], "en"),
        (["", " "], "en"),
        ([], "en"),
    ],
)
def test_the_first_preferred_language_the_demo_speaks_is_chosen_else_english(
    preferences: list[str], lang: str
) -> None:
    from kernel_ext.demo.script import FALLBACK_LANG, pick_lang

    assert FALLBACK_LANG == "en"
    assert pick_lang(preferences) == lang


@pytest.mark.parametrize(
    ("environ", "lang"),
    [
        ({"LANG": "zh_CN.UTF-8"}, "zh"),
        ({"LANG": "en_US.UTF-8"}, "en"),
        ({"LC_MESSAGES": "zh_CN.UTF-8", "LANG": "en_US.UTF-8"}, "zh"),
        ({"LC_ALL": "C", "LC_MESSAGES": "zh_CN.UTF-8", "LANG": "zh_CN.UTF-8"}, "en"),
        ({"LC_ALL": "", "LANG": "zh_CN.UTF-8"}, "zh"),  # empty is unset
        ({"LANG": "POSIX"}, "en"),
        ({"LANGUAGE": "zh_CN"}, "en"),  # not a locale variable the rule reads
        ({}, "en"),
    ],
)
def test_headless_takes_the_language_of_the_locale_that_names_messages(
    environ: dict[str, str], lang: str
) -> None:
    from kernel_ext.demo.script import lang_of_locale

    assert lang_of_locale(environ) == lang


@pytest.mark.parametrize("lang", LANGS)
def test_each_colleague_answers_what_it_was_asked(lang: str) -> None:
    from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK

    first, follow_up = wording(lang).questions
    for script in (ORDERS_DESK[lang], CARRIER[lang]):
        assert script.reply(first) == (script.steps, script.answer)
        steps, answer = script.reply(follow_up)
        assert answer != script.answer  # not the first answer again
        assert ("Tuesday" if lang == "en" else "周二") in answer  # the day it shipped
        beats = sum(step.beats for step in steps)
        assert 10 <= beats * DEFAULT_BEAT <= 15
        assert len(steps) <= 10
        assert script.reply(follow_up.upper()) == (steps, answer)  # any case
        assert script.reply("") == (script.steps, script.answer)


def test_without_lang_the_language_is_chosen_and_lang_fixes_it() -> None:
    assert _args().lang is None  # the browser's (the page), the locale's (--headless)
    assert _args("--lang", "en").lang == "en"
    assert _args("--lang", "zh").lang == "zh"
    assert wording().tag == "zh-CN"
    assert wording("en").tag == "en"
    for words in (wording("zh"), wording("en")):
        assert set(words.page) == set(wording("zh").page)
        assert set(words.titles) == {"orders", "carrier"}
    english = wording("en")
    texts = [*english.questions, *english.titles.values(), *english.page.values()]
    assert [text for text in texts if CJK.search(text)] == []
    with pytest.raises(ValueError, match="the demo speaks zh and en"):
        wording("fr")
    with pytest.raises(SystemExit):
        _args("--lang", "fr")


def test_the_default_pace_is_watchable_and_fast_is_for_tests() -> None:
    from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK

    for scripts in (ORDERS_DESK, CARRIER):
        for script in scripts.values():
            beats = sum(step.beats for step in script.steps)
            assert 10 <= beats * DEFAULT_BEAT <= 15  # a person can watch the pane grow
            assert beats * FAST_BEAT < 1
            assert len(script.steps) <= 10  # within the throttle even at the fast pace
    assert set(ORDERS_DESK) == set(CARRIER) == set(LANGS)
    assert (_args().step_delay, _args().fast) == (None, False)
    assert _args("--fast").fast is True
    assert _args("--step-delay", "0.3").step_delay == 0.3
    with pytest.raises(SystemExit):
        _args("--fast", "--step-delay", "0.3")
    assert _args("--step-delay", "0").step_delay == 0.0


@pytest.mark.parametrize("value", ["-1", "-0.1", "nan", "inf", "soon"])
def test_a_negative_or_non_finite_step_delay_is_refused_with_exit_2(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernel_ext.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["demo", "--step-delay", value])
    assert exited.value.code == 2
    (error,) = capsys.readouterr().err.strip().splitlines()  # one line
    assert f"argument --step-delay: must be a number of seconds, 0 or more, got {value!r}" in error


@pytest.mark.parametrize(
    ("value", "ok"),
    [("demo-abc_1-2", True), ("demo-", False), ("conv-1", False), ("demo-a b", False), (3, False)],
)
def test_browsers_may_join_demo_conversations_only(value: object, ok: bool) -> None:
    assert is_conversation_id(value) is ok


# -- the web process: page and the browser -> worker path ---------------------------------


class _Agent:
    """A stand-in for the worker's control connection: records what it is forwarded."""

    def __init__(self, client: socketio.AsyncClient, answer: dict[str, Any]) -> None:
        self.client = client
        self.messages: list[Any] = []
        self.answer = answer
        client.on("kx_user_message", self._on_message, namespace=NS)

    def _on_message(self, data: Any) -> dict[str, Any]:
        self.messages.append(data)
        return self.answer


class _Rig:
    """The demo's web app on a port, and the clients a test connects (closed at the end)."""

    def __init__(self, web: Any, port: int) -> None:
        self.web = web
        self.port = port
        self.clients: list[socketio.AsyncClient] = []

    async def client(self, auth: Any = None, **events: Any) -> socketio.AsyncClient:
        client = socketio.AsyncClient(reconnection=False)
        for event, handler in events.items():
            client.on(event, handler, namespace=NS)
        self.clients.append(client)
        await client.connect(
            f"http://127.0.0.1:{self.port}",
            namespaces=[NS],
            auth=auth,
            transports=["websocket"],
            wait_timeout=5,
        )
        return client

    async def agent(self, answer: dict[str, Any] | None = None, **auth: Any) -> _Agent:
        agent = _Agent(socketio.AsyncClient(reconnection=False), answer or {"ok": True})
        self.clients.append(agent.client)
        await agent.client.connect(
            f"http://127.0.0.1:{self.port}",
            namespaces=[NS],
            auth=auth or {"internal": SECRET, "role": "agent"},
            transports=["websocket"],
            wait_timeout=5,
        )
        return agent


@asynccontextmanager
async def _web() -> AsyncIterator[_Rig]:
    from kernel_ext.demo.web import create_demo_app

    demo = create_demo_app(SECRET)
    async with serve_asgi(demo.app) as port:
        rig = _Rig(demo, port)
        try:
            yield rig
        finally:
            for client in rig.clients:
                await client.disconnect()


async def _join(client: socketio.AsyncClient, room: str) -> Any:
    return await client.call("join_conversation", {"conversationId": room}, namespace=NS, timeout=5)


async def _say(client: socketio.AsyncClient, room: str, text: Any) -> Any:
    return await client.call(
        "user_message", {"conversationId": room, "text": text}, namespace=NS, timeout=15
    )


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_health_says_whether_the_agent_is_connected_and_on_which_kernel() -> None:
    import httpx

    async with _web() as rig, httpx.AsyncClient(timeout=5) as http:
        health = f"http://127.0.0.1:{rig.port}/demo/health"
        assert (await http.get(health)).json() == {"agent": False}
        unsaid = await rig.agent()
        assert (await http.get(health)).json() == {"agent": True, "kernel": None}
        await rig.agent(internal=SECRET, role="agent", kernel="crewai")  # not a demo kernel
        assert (await http.get(health)).json() == {"agent": True, "kernel": None}
        newest = await rig.agent(internal=SECRET, role="agent", kernel="langgraph")
        assert (await http.get(health)).json() == {"agent": True, "kernel": "langgraph"}
        await newest.client.disconnect()  # the agent before it answers again
        await wait_until(lambda: rig.web.relay.agent_kernel is None, 5, "the agent left")
        assert (await http.get(health)).json() == {"agent": True, "kernel": None}
        await unsaid.client.disconnect()


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_a_joined_browsers_message_reaches_the_agent() -> None:
    async with _web() as rig:
        agent = await rig.agent()
        browser = await rig.client()
        assert await _join(browser, "demo-room") == {"ok": True}
        assert await _say(browser, "demo-room", "  hello agent  ") == {"ok": True}
        assert agent.messages == [{"conversationId": "demo-room", "text": "hello agent"}]
        for lang in LANGS:  # the language the answer should be in travels with the message
            ack = await browser.call(
                "user_message",
                {"conversationId": "demo-room", "text": "hi", "lang": lang},
                namespace=NS,
                timeout=15,
            )
            assert ack == {"ok": True}
            assert agent.messages[-1] == {"conversationId": "demo-room", "text": "hi", "lang": lang}


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_messages_that_may_not_reach_the_agent_are_refused() -> None:
    async with _web() as rig:
        agent = await rig.agent()
        browser = await rig.client()
        internal = await rig.client(auth={"internal": SECRET})
        assert (await _say(browser, "demo-room", "not joined"))["ok"] is False
        assert (await _join(browser, "conv-1"))["ok"] is False  # not a demo conversation
        assert await _join(browser, "demo-room") == {"ok": True}
        assert (await _say(browser, "demo-room", "   "))["ok"] is False
        too_long = "x" * (MAX_MESSAGE_CHARS + 1)
        assert (await _say(browser, "demo-room", too_long))["ok"] is False
        assert (await _say(browser, "demo-room", {"text": "x"}))["ok"] is False
        assert (await _say(internal, "demo-room", "from a sender"))["ok"] is False
        for lang in ("fr", "ZH", "", 1, ["en"]):  # a language the demo does not speak
            ack = await browser.call(
                "user_message",
                {"conversationId": "demo-room", "text": "hi", "lang": lang},
                namespace=NS,
                timeout=15,
            )
            assert ack == {"ok": False, "error": "lang must be one of zh, en"}, lang
        assert agent.messages == []


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_without_an_agent_or_with_a_busy_one_the_browser_is_told() -> None:
    async with _web() as rig:
        browser = await rig.client()
        assert await _join(browser, "demo-room") == {"ok": True}
        ack = await _say(browser, "demo-room", "anyone?")
        assert ack == {"ok": False, "error": "the agent is not connected"}
        await rig.agent(answer={"ok": False, "error": "busy"})
        assert await _say(browser, "demo-room", "now?") == {"ok": False, "error": "busy"}


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_a_browser_cannot_pose_as_the_agent_or_broadcast() -> None:
    async with _web() as rig:
        agent = await rig.agent()
        # A browser claiming the agent's role without the secret is just a browser.
        impostor = await rig.agent(role="agent")
        seen: list[Any] = []
        viewer = await rig.client(tool_event_stream=seen.append, chat_event=seen.append)
        assert await _join(viewer, "demo-room") == {"ok": True}
        assert await _join(impostor.client, "demo-room") == {"ok": True}
        event = {"room": "demo-room", "event": {"eventId": "x"}}
        await impostor.client.emit("kx_chat_event", event, namespace=NS)
        await impostor.client.emit("tool_event_stream", {"v": 1}, namespace=NS)
        frame = {"v": 1, "room": "demo-room", "blocks": []}
        await impostor.client.emit("kx_blocks", frame, namespace=NS)
        assert await _say(viewer, "demo-room", "hello") == {"ok": True}
        assert len(agent.messages) == 1
        assert impostor.messages == []
        rejected = ("rejected_not_internal", "rejected_unknown_event")
        await wait_until(
            lambda: sum(rig.web.relay.stats().get(key, 0) for key in rejected) >= 3,
            5,
            rig.web.relay.stats,
        )
        assert seen == []


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_the_page_and_its_assets_are_served_with_a_strict_policy() -> None:
    import httpx

    async with _web() as rig, httpx.AsyncClient(timeout=5) as http:
        base = f"http://127.0.0.1:{rig.port}"
        page = await http.get(base + "/")
        assert page.status_code == 200
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy
        assert "font-src 'self'" in policy
        assert "default-src 'none'" in policy
        assert '<html lang="en">' in page.text  # without --lang: English until app.js chose
        assert "$" not in page.text  # every placeholder of the page was filled
        for path in ("/renderer.js", "/static/app.js", "/static/app.css"):
            response = await http.get(base + path)
            assert response.status_code == 200, path
        font = await http.get(base + "/static/fonts/noto-sans-sc-demo.woff2")
        assert font.status_code == 200
        assert font.content[:4] == b"wOF2"
        licence = await http.get(base + "/static/fonts/OFL.txt")
        assert "SIL OPEN FONT LICENSE Version 1.1" in licence.text
        client = await http.get(base + "/vendor/socket.io.esm.min.js")
        assert client.status_code == 200
        assert client.headers["content-type"].startswith("text/javascript")
        assert f"Socket.IO v{vendored_client()['version']}" in client.text[:200]
        assert (await http.get(base + "/static/sio.js")).status_code == 404
        config = (await http.get(base + "/demo/config.json")).json()
        assert config["lang"] is None  # the browser's
        assert config["fallback"] == "en"
        assert list(config["langs"]) == list(LANGS)
        for lang, words in config["langs"].items():
            assert words["firstQuestion"] == wording(lang).questions[0]
            assert words["suggestions"] == list(wording(lang).questions[1:])
            assert words["text"] == dict(wording(lang).page)
            assert (words["tag"], words["name"]) == (wording(lang).tag, wording(lang).name)
        assert (await http.get(base + "/demo/health")).json() == {"agent": False}
        for probe in ("/healthz", "/readyz"):  # the relay's probes (kernel_ext.relay.health)
            answer = await http.get(base + probe)
            assert (answer.status_code, answer.json()) == (200, {"status": "ok"}), probe
        app_js = (await http.get(base + "/static/app.js")).text
        assert "innerHTML" not in app_js
        assert 'from "/vendor/socket.io.esm.min.js"' in app_js


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_with_lang_en_the_page_and_its_words_are_english() -> None:
    import httpx

    from kernel_ext.demo.web import create_demo_app

    demo = create_demo_app(SECRET, lang="en")
    async with serve_asgi(demo.app) as port, httpx.AsyncClient(timeout=5) as http:
        base = f"http://127.0.0.1:{port}"
        page = (await http.get(base + "/")).text
        assert '<html lang="en">' in page
        assert CJK.findall(page) == []
        config = (await http.get(base + "/demo/config.json")).json()
        assert config["lang"] == "en"
        english = config["langs"]["en"]
        assert english["firstQuestion"] == wording("en").questions[0]
        titles = [c["title"] for c in english["colleagues"]]
        assert titles == ["Orders desk", "Carrier (third-party)"]
        assert CJK.findall(json.dumps(english, ensure_ascii=False)) == []
    chinese = create_demo_app(SECRET, lang="zh")
    async with serve_asgi(chinese.app) as port, httpx.AsyncClient(timeout=5) as http:
        page = (await http.get(f"http://127.0.0.1:{port}/")).text
        assert '<html lang="zh-CN">' in page
        assert wording("zh").page["send"] in page
        config = (await http.get(f"http://127.0.0.1:{port}/demo/config.json")).json()
        assert config["lang"] == "zh"
    with pytest.raises(ValueError, match="the demo speaks zh and en, not 'fr'"):
        create_demo_app(SECRET, lang="fr")


# -- the web process's history: what a reloaded page needs besides the blocks ------------------


def _message(n: int, room: str = "demo-room") -> dict[str, Any]:
    return {
        "eventId": f"m-{n}",
        "eventScene": "message",
        "conversationId": room,
        "content": {"role": "user", "text": f"message {n}"},
    }


async def _snapshot(sender: socketio.AsyncClient, room: str, event: dict[str, Any]) -> None:
    ack = await sender.call(
        "kx_chat_event", {"room": room, "event": event}, namespace=NS, timeout=5
    )
    assert ack == {"ok": True}


async def _joined_history(rig: _Rig, room: str) -> tuple[Any, list[Any]]:
    """A new browser joins ``room``: its acknowledgement and the chat events it had got by
    then (the history comes before the acknowledgement)."""
    got: list[Any] = []
    browser = await rig.client(chat_event=got.append)
    ack = await _join(browser, room)
    return ack, [event["eventId"] for event in got]


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_a_joining_browser_gets_its_conversations_history_before_the_acknowledgement() -> (
    None
):
    async with _web() as rig:
        sender = await rig.client(auth={"internal": SECRET})
        live: list[Any] = []
        first = await rig.client(chat_event=live.append)
        assert await _join(first, "demo-room") == {"ok": True}
        for n in range(3):
            await _snapshot(sender, "demo-room", _message(n))
        await _snapshot(sender, "demo-other", _message(9, "demo-other"))
        await wait_until(lambda: len(live) == 3, 5, "the first browser got them live")
        ack, history = await _joined_history(rig, "demo-room")
        assert ack == {"ok": True}  # the acknowledgement it always was
        assert history == ["m-0", "m-1", "m-2"]  # in order, none of another conversation
        assert (await _joined_history(rig, "demo-quiet"))[1] == []
        # A refused join gets nothing (not a demo conversation, or the same room refused).
        ack, history = await _joined_history(rig, "conv-1")
        assert (ack["ok"], history) == (False, [])


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_a_conversation_keeps_its_last_256_snapshots() -> None:
    from kernel_ext.demo.web import HISTORY_EVENTS

    assert HISTORY_EVENTS == 256
    async with _web() as rig:
        sender = await rig.client(auth={"internal": SECRET})
        for n in range(HISTORY_EVENTS):
            await _snapshot(sender, "demo-room", _message(n))
        history = (await _joined_history(rig, "demo-room"))[1]
        assert history == [f"m-{n}" for n in range(HISTORY_EVENTS)]  # exactly at the bound
        await _snapshot(sender, "demo-room", _message(HISTORY_EVENTS))
        history = (await _joined_history(rig, "demo-room"))[1]
        assert history == [f"m-{n}" for n in range(1, HISTORY_EVENTS + 1)]  # the oldest gave way


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_the_64_most_recently_active_conversations_keep_their_history() -> None:
    from kernel_ext.demo.script import MAX_CONVERSATIONS

    assert MAX_CONVERSATIONS == 64
    async with _web() as rig:
        sender = await rig.client(auth={"internal": SECRET})
        rooms = [f"demo-{n}" for n in range(MAX_CONVERSATIONS + 2)]
        for room in rooms[:MAX_CONVERSATIONS]:
            await _snapshot(sender, room, _message(0, room))
        await _snapshot(sender, rooms[0], _message(1, rooms[0]))  # the first is active again
        await _snapshot(sender, rooms[MAX_CONVERSATIONS], _message(0, rooms[MAX_CONVERSATIONS]))
        assert (await _joined_history(rig, rooms[0]))[1] == ["m-0", "m-1"]
        assert (await _joined_history(rig, rooms[1]))[1] == []  # the least recently active
        assert (await _joined_history(rig, rooms[2]))[1] == ["m-0"]
        assert (await _joined_history(rig, rooms[MAX_CONVERSATIONS]))[1] == ["m-0"]


@pytest.mark.network
@pytest.mark.timeout(60)
async def test_snapshots_flowing_while_browsers_join_reach_each_exactly_once_in_order() -> None:
    """An internal sender sends 200 snapshots without waiting while browsers join one after
    the other: each joiner gets every snapshot once, in order — the earlier ones in the
    history, the later ones live."""
    total = 200
    async with _web() as rig:
        sender = await rig.client(auth={"internal": SECRET})
        seen: list[Any] = []
        watcher = await rig.client(chat_event=seen.append)
        assert await _join(watcher, "demo-room") == {"ok": True}
        joiners: list[list[Any]] = [[] for _ in range(8)]
        clients = [await rig.client(chat_event=got.append) for got in joiners]

        async def flood() -> None:
            for n in range(total):
                await sender.emit(
                    "kx_chat_event", {"room": "demo-room", "event": _message(n)}, namespace=NS
                )

        flooding = asyncio.get_running_loop().create_task(flood())
        for n, client in enumerate(clients, start=1):
            await wait_until(lambda n=n: len(seen) >= n * total // 10, 20, "the flood goes on")
            assert await _join(client, "demo-room") == {"ok": True}
        await flooding
        for got in joiners:
            await wait_until(lambda got=got: len(got) >= total, 20, "every snapshot arrived")
        for client in clients:  # a round trip on each: nothing more is on its way
            assert await _join(client, "demo-barrier") == {"ok": True}
        for got in joiners:
            assert [event["eventId"] for event in got] == [f"m-{n}" for n in range(total)]


# -- the worker's agent, in process --------------------------------------------------------


@pytest.mark.network
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kernel", KERNELS)
async def test_the_agent_announces_each_call_before_its_blocks_and_attributes_both(
    kernel: str,
) -> None:
    _kernel(kernel)
    from opentelemetry.sdk.trace import TracerProvider

    from kernel_ext.demo.agent import ConversationAgent
    from kernel_ext.demo.colleague_server import CARRIER, ORDERS_DESK, demo_peer
    from kernel_ext.demo.script import COLLEAGUES
    from kernel_ext.demo.worker import Colleague, DemoAgent
    from kernel_ext.plugin import adisable, enable
    from kernel_ext.testing import MemoryEmitter

    ports = [free_port() for _ in COLLEAGUES]
    peers = [
        demo_peer(f"http://127.0.0.1:{p}/", name=spec.title, beat=0.02)
        for spec, p in zip(COLLEAGUES, ports, strict=True)
    ]
    colleagues = [
        Colleague(spec.key, spec.title, f"http://127.0.0.1:{p}/", spec.script)
        for spec, p in zip(COLLEAGUES, ports, strict=True)
    ]
    provider = TracerProvider()
    emitter = MemoryEmitter()
    agent: ConversationAgent
    if kernel == "langgraph":
        from kernel_ext.demo.graph_agent import GraphAgent
        from kernel_ext.integrations.langchain import langchain_targets

        wired = enable(emitter=emitter, tracer_provider=provider, targets=langchain_targets())
        agent = GraphAgent(colleagues, hub=wired.hub, timeout=30)
    else:
        wired = enable(emitter=emitter, tracer_provider=provider)
        agent = DemoAgent(colleagues, provider, hub=wired.hub, timeout=30)
    try:
        async with serve_asgi(peers[0].app, ports[0]), serve_asgi(peers[1].app, ports[1]):
            await emitter.start()
            answer = await agent.answer("demo-room", FIRST_QUESTION)
            assert await emitter.flush(5)
    finally:
        await adisable()
        for peer in peers:
            await peer.aclose()
        provider.shutdown()

    assert answer.startswith("两位同事的答复：\n")
    assert f"订单组：{ORDERS_DESK['zh'].answer}" in answer
    assert f"承运商（第三方）：{CARRIER['zh'].answer}" in answer
    order = emitter.order
    assert all(room == "demo-room" for _, room, _ in order)
    tools = [e for kind, _, e in order if kind == "chat_event" and e["eventScene"] == "tool"]
    calling = {e["eventId"]: e for e in tools if e["status"] == "calling"}
    finished = {e["eventId"]: e for e in tools if e["status"] == "finished"}
    assert len(calling) == 2
    assert set(finished) == set(calling)
    by_colleague = {
        e["content"]["toolCall"]["functionCall"]["arguments"]["colleague"]: call_id
        for call_id, e in calling.items()
    }
    assert set(by_colleague) == {"orders", "carrier"}

    def index(predicate: Any) -> int:
        return next(i for i, item in enumerate(order) if predicate(item))

    for call_id in calling:
        blocks = [
            b for kind, _, b in order if kind == "tool_event_stream" and b["callId"] == call_id
        ]
        terminals = [b for b in blocks if b["state"] != "running"]
        assert [b["state"] for b in terminals] == ["done"]
        snapshot_at = index(lambda it, c=call_id: it[2].get("eventId") == c)
        first_block_at = index(lambda it, c=call_id: it[2].get("callId") == c)
        assert snapshot_at < first_block_at
        done_at = index(lambda it, c=call_id: it[2].get("callId") == c and it[2]["state"] == "done")
        returned_at = index(
            lambda it, c=call_id: it[2].get("eventId") == c and it[2]["status"] == "finished"
        )
        assert done_at < returned_at
        assert finished[call_id]["content"]["toolReturn"].endswith(
            terminals[0]["envelope"]["payload"]["text"]
        )
    orders_kinds = {
        b["envelope"]["kind"] for b in emitter.blocks() if b["callId"] == by_colleague["orders"]
    }
    carrier_kinds = {
        b["envelope"]["kind"] for b in emitter.blocks() if b["callId"] == by_colleague["carrier"]
    }
    assert {"thinking", "tool_call", "text"} <= orders_kinds
    assert carrier_kinds == {"text"}
    # The calls ran at the same time: both were under way before either one ended.
    last_start = max(index(lambda it, c=c: it[2].get("eventId") == c) for c in calling)
    first_end = min(
        index(lambda it, c=c: it[2].get("callId") == c and it[2]["state"] == "done")
        for c in calling
    )
    assert last_start < first_end


@pytest.mark.parametrize("kernel", KERNELS)
async def test_each_message_is_answered_in_its_own_language(kernel: str) -> None:
    """Without colleagues every call returns "no such colleague": no network needed."""
    _kernel(kernel)
    from kernel_ext.demo.agent import ConversationAgent
    from kernel_ext.stream import StreamHub

    agent: ConversationAgent
    if kernel == "langgraph":
        from kernel_ext.demo.graph_agent import GraphAgent

        agent = GraphAgent([], hub=StreamHub(), lang="zh")
    else:
        from opentelemetry.sdk.trace import TracerProvider

        from kernel_ext.demo.worker import DemoAgent

        agent = DemoAgent([], TracerProvider(), hub=StreamHub(), lang="zh")

    def expected(lang: str) -> str:
        words = wording(lang)
        return f"{words.answer_one}\n{words.no_such_colleague.format(key=repr('orders'))}"

    assert await agent.answer("demo-0", "hello", "en") == expected("en")
    assert await agent.answer("demo-0", "hello again") == expected("zh")  # the agent's own
    assert await agent.answer("demo-0", "and once more", "en") == expected("en")
    assert await agent.answer("demo-1", "你好", "zh") == expected("zh")
    with pytest.raises(ValueError, match="the demo speaks zh and en"):
        await agent.answer("demo-0", "bonjour", "fr")


@pytest.mark.parametrize("kernel", KERNELS)
async def test_the_agent_remembers_the_last_64_conversations(kernel: str) -> None:
    """Without colleagues every call returns "no such colleague": no network needed."""
    _kernel(kernel)
    from kernel_ext.demo.agent import MAX_CONVERSATIONS, ConversationAgent
    from kernel_ext.stream import StreamHub

    agent: ConversationAgent
    remembered: Any
    if kernel == "langgraph":
        from kernel_ext.demo.graph_agent import GraphAgent

        graph = agent = GraphAgent([], hub=StreamHub(), lang="en")

        def remembered(room: str) -> int:  # the user's messages in the thread's checkpoint
            saved = graph.checkpointer.get_tuple({"configurable": {"thread_id": room}})
            if saved is None:
                return 0
            messages = saved.checkpoint["channel_values"]["messages"]
            return sum(1 for m in messages if m.type == "human")

    else:
        from opentelemetry.sdk.trace import TracerProvider

        from kernel_ext.demo.worker import DemoAgent

        typed = agent = DemoAgent([], TracerProvider(), hub=StreamHub(), lang="en")

        def remembered(room: str) -> int:
            return sum(
                1
                for m in typed._history.get(room, [])
                for p in m.parts
                if p.part_kind == "user-prompt"
            )

    words = wording("en")
    expected = f"{words.answer_one}\n{words.no_such_colleague.format(key=repr('orders'))}"
    assert await agent.answer("demo-0", "hello") == expected
    assert await agent.answer("demo-0", "hello again") == expected
    assert remembered("demo-0") == 2
    for n in range(1, MAX_CONVERSATIONS):
        await agent.answer(f"demo-{n}", "hello")
    assert remembered("demo-0") == 2  # 64 conversations: all kept
    await agent.answer(f"demo-{MAX_CONVERSATIONS}", "hello")
    assert remembered("demo-0") == 0  # the 65th: the least recently answered is forgotten
    assert remembered("demo-1") == 1
    assert remembered(f"demo-{MAX_CONVERSATIONS}") == 1


# -- the whole demo as a subprocess --------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class Demo:
    """``kernel-ext demo`` in a subprocess, its output read by threads; its locale is
    ``locale`` (``LANG``; ``LC_ALL`` and ``LC_MESSAGES`` unset)."""

    def __init__(self, *argv: str, locale: str = "C.UTF-8") -> None:
        started("network")  # its colleagues and web process listen on 127.0.0.1
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("LC_ALL", "LC_MESSAGES")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kernel_ext.cli", "demo", "--port", str(self.port), *argv],
            env={**env, "LANG": locale, "LC_CTYPE": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out, "out")),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err, "err")),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def _read(self, stream: Any, into: list[str], name: str) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))
            self._lines.put((name, line))

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        """Wait until a line containing ``needle`` was printed (either stream)."""
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in self.out + self.err):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.proc.poll() is not None and self._lines.empty()):
                raise AssertionError(f"no {needle!r} in time:\n" + "\n".join(self.err))
            with suppress(queue.Empty):
                self._lines.get(timeout=min(remaining, 1.0))

    def finish(self, timeout: float = 90) -> int:
        code = self.proc.wait(timeout=timeout)
        for thread in self._threads:
            thread.join(timeout=10)
        return code

    @property
    def child_pids(self) -> list[int]:
        return [int(m.group(1)) for line in self.err if (m := re.search(r"\(pid (\d+)\)", line))]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pid in self.child_pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@contextmanager
def demo(*argv: str, locale: str = "C.UTF-8") -> Iterator[Demo]:
    running = Demo(*argv, locale=locale)
    try:
        yield running
    finally:
        running.close()


def _calls(lines: list[str]) -> dict[str, list[str]]:
    """The transcript's lines per callId (from each call's header line on)."""
    calls: dict[str, str] = {}
    per_call: dict[str, list[str]] = {}
    for line in lines:
        header = CALL_HEADER.match(line)
        if header:
            calls[header.group(1)] = header.group(2)
            per_call[header.group(2)] = []
            continue
        tag = line[1:9] if line.startswith("[") else None
        if tag in calls:
            per_call[calls[tag]].append(line[11:])
    return per_call


def _assert_no_child_left(running: Demo) -> None:
    pids = running.child_pids
    assert len(pids) == 4, running.err
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernel", KERNELS)
def test_headless_demo_streams_every_call_to_its_terminal_and_exits_0(kernel: str) -> None:
    """In Chinese: the locale's language (``LANG=zh_CN.UTF-8``, no ``--lang``)."""
    _kernel(kernel)
    from kernel_ext.demo.colleague_server import ORDERS_DESK

    argv = ("--headless", "--fast", "--kernel", kernel, "--time-limit", "60")
    with demo(*argv, locale="zh_CN.UTF-8") as running:
        code = running.finish()
        assert code == 0, "\n".join(running.out + running.err)
        calls = _calls(running.out)
        assert len(calls) == 3  # two concurrent calls, then one
        for call_id, lines in calls.items():
            assert any(line.startswith("最终回复：") for line in lines), (call_id, lines)
            assert lines[-1] == "── 已结束 ──", (call_id, lines)
        first, second, third = calls
        assert len({first[:8], second[:8], third[:8]}) == 3
        carrier_line = "正在查询运单 1Z84F29A"
        orders = [c for c, lines in calls.items() if "▶ search_orders 开始" in lines]
        carrier = [c for c, lines in calls.items() if carrier_line in lines]
        assert len(orders) == 2
        assert len(carrier) == 1
        # Attribution: the envelope colleague's work never shows in the text colleague's
        # pane, and the other way round.
        assert carrier_line not in calls[orders[0]]
        assert "▶ search_orders 开始" not in calls[carrier[0]]
        assert "思考中…" in calls[orders[0]]
        assert running.out[0] == f"» {FIRST_QUESTION}"
        assert f"» {SECOND_QUESTION}" in running.out
        assert running.out.count("« 两位同事的答复：") == 1
        assert running.out.count("« 同事的答复：") == 1
        # The follow-up gets an answer to what it asked: the day order 42 shipped.
        answers = [line for line in running.out if line.startswith("« 订单组：")]
        assert answers == [
            f"« 订单组：{ORDERS_DESK['zh'].answer}",
            f"« 订单组：{ORDERS_DESK['zh'].reply(SECOND_QUESTION)[1]}",
        ]
        assert "周二发货" in answers[1]
        _assert_no_child_left(running)


@pytest.mark.network
@pytest.mark.timeout(120)
def test_headless_demo_with_lang_en_prints_no_chinese() -> None:
    """``--lang en`` wins over a Chinese locale."""
    _pydantic_ai()
    argv = ("--headless", "--fast", "--lang", "en", "--time-limit", "60")
    with demo(*argv, locale="zh_CN.UTF-8") as running:
        code = running.finish()
        assert code == 0, "\n".join(running.out + running.err)
        calls = _calls(running.out)
        assert len(calls) == 3
        for call_id, lines in calls.items():
            assert any(line.startswith("Final answer: ") for line in lines), (call_id, lines)
            assert lines[-1] == "── Ended ──", (call_id, lines)
        assert "▶ search_orders started" in next(iter(calls.values()))
        assert running.out[0] == f"» {wording('en').questions[0]}"
        assert running.out.count("« Here is what my colleagues said:") == 1
        assert "« Orders desk: Order 42 shipped on Tuesday" in "\n".join(running.out)
        assert [line for line in running.out + running.err if CJK.search(line)] == []
        _assert_no_child_left(running)


@pytest.mark.network
@pytest.mark.timeout(120)
def test_headless_demo_without_lang_speaks_the_locales_language_else_english() -> None:
    _pydantic_ai()
    with demo("--headless", "--fast", "--time-limit", "60", locale="C.UTF-8") as running:
        assert running.finish() == 0, "\n".join(running.out + running.err)
        assert running.out[0] == f"» {wording('en').questions[0]}"
        assert [line for line in running.out + running.err if CJK.search(line)] == []


@pytest.mark.network
@pytest.mark.redis
@pytest.mark.timeout(120)
def test_headless_demo_through_redis(redis_server: RedisServer) -> None:
    _pydantic_ai()
    with demo("--headless", "--redis", redis_server.url, "--fast", "--time-limit", "60") as running:
        code = running.finish()
        assert code == 0, "\n".join(running.out + running.err)
        assert len(_calls(running.out)) == 3
        _assert_no_child_left(running)


@pytest.mark.network
@pytest.mark.timeout(120)
def test_when_a_child_dies_the_demo_stops_the_others_and_fails() -> None:
    _pydantic_ai()
    with demo("--time-limit", "90") as running:
        running.wait_for("Open http://")
        worker = next(line for line in running.err if "worker started" in line)
        os.kill(int(re.search(r"pid (\d+)", worker).group(1)), signal.SIGKILL)  # type: ignore[union-attr]
        assert running.finish() == 1
        assert any("the worker process exited" in line for line in running.err), running.err
        _assert_no_child_left(running)


@pytest.mark.network
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_process(signum: int) -> None:
    _pydantic_ai()
    with demo("--time-limit", "90") as running:
        running.wait_for("Open http://")
        assert f"http://127.0.0.1:{running.port}/" in "\n".join(running.out)
        running.proc.send_signal(signum)
        assert running.finish() == {signal.SIGINT: 130, signal.SIGTERM: 143}[signum]
        _assert_no_child_left(running)
