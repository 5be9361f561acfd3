"""The demo's web process (uvicorn on 127.0.0.1): its page and assets under a strict policy,
``/demo/health``, the browser → worker path (who may say what, to an agent that may be
missing or busy), and each conversation's history: the snapshots a reloaded page gets
before its join is acknowledged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import socketio
from support.demo_helpers import CJK
from support.network import serve_asgi
from support.timing import CALL_TIMEOUT, wait_until

from kernel_ext.demo.script import LANGS, MAX_MESSAGE_CHARS, wording
from kernel_ext.web import vendored_client
from kernel_ext.web.font import FONT_FILE, font_dir

NS = "/chat"

SECRET = "demo-test-secret"


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
            wait_timeout=CALL_TIMEOUT,
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
            wait_timeout=CALL_TIMEOUT,
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
    return await client.call(
        "join_conversation", {"conversationId": room}, namespace=NS, timeout=CALL_TIMEOUT
    )


async def _say(client: socketio.AsyncClient, room: str, text: Any) -> Any:
    return await client.call(
        "user_message", {"conversationId": room, "text": text}, namespace=NS, timeout=15
    )


@pytest.mark.network
@pytest.mark.timeout(30)
async def test_health_says_whether_the_agent_is_connected_and_on_which_kernel() -> None:
    import httpx

    async with _web() as rig, httpx.AsyncClient(timeout=CALL_TIMEOUT) as http:
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

    async with _web() as rig, httpx.AsyncClient(timeout=CALL_TIMEOUT) as http:
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
        font = await http.get(base + "/fonts/noto-sans-sc-subset.woff2")  # kernel_ext.web's
        assert font.status_code == 200
        assert font.headers["content-type"] == "font/woff2"
        assert font.content == (font_dir() / FONT_FILE).read_bytes()
        licence = await http.get(base + "/fonts/OFL.txt")
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
    async with serve_asgi(demo.app) as port, httpx.AsyncClient(timeout=CALL_TIMEOUT) as http:
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
    async with serve_asgi(chinese.app) as port, httpx.AsyncClient(timeout=CALL_TIMEOUT) as http:
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
        "kx_chat_event", {"room": room, "event": event}, namespace=NS, timeout=CALL_TIMEOUT
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
