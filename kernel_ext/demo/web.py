"""The demo's web process: the ``/chat`` relay plus the demo page, on one uvicorn port.

Serves the page (``/``, ``/static/…``, and from :mod:`kernel_ext.web` ``/renderer.js``,
``/vendor/socket.io.esm.min.js`` and the CJK subset font ``/fonts/…``), python-socketio
on ``/socket.io/`` with :class:`DemoRelay` on ``/chat`` (``--redis URL``: Redis as its
client manager), ``/demo/config.json``, ``/demo/health`` and the relay's ``/healthz`` and
``/readyz``.

Guarantees:

* Scripts and fonts come from this origin only (Content-Security-Policy); browsers must
  come from the page's own origin.
* A browser may send join/leave and, in a conversation it joined, ``user_message``, which
  :class:`DemoRelay` checks and forwards to the agent's connection as ``kx_user_message``,
  handing back the agent's acknowledgement; every other browser event reaches no one.
* A browser whose join is accepted gets the conversation's ``chat_event`` snapshots before
  the acknowledgement: a reloaded page shows its messages and each pane whole.

Run by ``kernel-ext demo``; on its own: ``KERNEL_EXT_SECRET=… python -m
kernel_ext.demo.web --port 8000 [--lang en]`` (binds 127.0.0.1 unless ``--host`` says
otherwise). Design: docs/contracts.md, "The demo's processes".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import logging
import string
from collections import deque
from collections.abc import AsyncIterator, Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any

import socketio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from kernel_ext._shared.bounded import BoundedMap
from kernel_ext.demo.script import (
    COLLEAGUES,
    FALLBACK_LANG,
    KERNELS,
    LANGS,
    MAX_CONVERSATIONS,
    MAX_MESSAGE_CHARS,
    USER_MESSAGE_TO_AGENT,
    Wording,
    is_conversation_id,
    wording,
)
from kernel_ext.protocol import CHAT_EVENT
from kernel_ext.relay import ChatRelay, RelayRedisManager, frames, with_probes
from kernel_ext.settings import env_name, load_settings
from kernel_ext.web import SOCKET_IO_CLIENT, asset_path
from kernel_ext.web.font import FONT_LICENCE, FONT_PATH

__all__ = [
    "HISTORY_EVENTS",
    "DemoApp",
    "DemoRelay",
    "create_demo_app",
    "main",
    "page_config",
    "render_page",
    "static_root",
]

logger = logging.getLogger(__name__)

_AGENT_ACK_TIMEOUT = 10.0
HISTORY_EVENTS = 256
"""``chat_event`` snapshots a :class:`DemoRelay` keeps per conversation (the oldest give
way): a question with two calls takes six."""

CSP = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "font-src 'self'; style-src 'self' 'unsafe-inline'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
"""The page's policy. ``style-src 'unsafe-inline'`` is for the renderer's one constant
``<style>`` element; no script runs unless it comes from this origin."""


def static_root() -> Path:
    """The directory of the page's files (package data)."""
    return Path(str(files("kernel_ext.demo") / "static"))


def render_page(words: Wording) -> str:
    """``static/index.html`` in ``words``' language: its ``<html lang>`` and its words,
    each HTML-escaped."""
    template = string.Template((static_root() / "index.html").read_text(encoding="utf-8"))
    values = {key: html.escape(value, quote=True) for key, value in words.page.items()}
    return template.substitute(values, tag=html.escape(words.tag, quote=True))


def _join_allowed(identity: Any, conversation_id: str) -> bool:
    """Browsers may join demo conversations (``demo-…`` ids) only."""
    return is_conversation_id(conversation_id)


class DemoRelay(ChatRelay):
    """The ``/chat`` relay of the demo: :class:`~kernel_ext.relay.ChatRelay` (every rule
    kept) plus the forwarding of a joined browser's ``user_message`` to the agent.

    ``user_message`` is acknowledged ``{"ok": true}`` once the agent queued it, else
    ``{"ok": false, "error"}``: not a browser, not joined to that conversation, text empty
    or over :data:`~kernel_ext.demo.script.MAX_MESSAGE_CHARS`, ``lang`` given but not one of
    :data:`~kernel_ext.demo.script.LANGS`, no agent connected, or the agent's own refusal
    (``busy``) or silence (10 s).

    History (the module docstring says why): every ``chat_event`` it emits to a
    conversation's room is kept — at most :data:`HISTORY_EVENTS` per conversation, for the
    :data:`~kernel_ext.demo.script.MAX_CONVERSATIONS` most recently active conversations, in
    memory only — and a browser whose join is accepted gets them, in order, after its
    catch-up and before the acknowledgement; a refused join gets none. Nothing is lost in
    between and nothing comes out of order: a conversation's snapshots are emitted one at a
    time, never while one of its joins is under way, so each reaches a joining browser once,
    in the history or live after it. (A browser that joins again, or one behind a Redis
    manager — whose emits come back from Redis later — may get one twice: the demo page
    keeps the first of each ``eventId``.)
    """

    def __init__(self, secret: str, **options: Any) -> None:
        options.setdefault("authorize_join", _join_allowed)
        super().__init__(secret, **options)
        # sid -> the kernel it runs on; insertion-ordered: the newest agent answers
        self._agents: dict[str, str | None] = {}
        self._browser_sids: set[str] = set()
        self._history: BoundedMap[str, deque[Any]] = BoundedMap(MAX_CONVERSATIONS)
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}  # room -> (lock, users)

    @contextlib.asynccontextmanager
    async def _turn(self, room: str) -> AsyncIterator[None]:
        """One at a time per conversation: a join (catch-up and history) or a snapshot."""
        lock, users = self._turns.get(room) or (asyncio.Lock(), 0)
        self._turns[room] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._turns[room]
            if users > 1:
                self._turns[room] = (lock, users - 1)
            else:
                del self._turns[room]

    async def emit(
        self,
        event: str,
        data: Any = None,
        to: Any = None,
        room: Any = None,
        skip_sid: Any = None,
        namespace: str | None = None,
        callback: Any = None,
        ignore_queue: bool = False,
    ) -> None:
        """python-socketio's ``emit``; a ``chat_event`` to a conversation's room is kept in
        its history first (class docstring)."""
        kept = event == CHAT_EVENT and isinstance(room, str) and to is None
        async with self._turn(room) if kept else contextlib.nullcontext():
            if kept:
                history = self._history.get(room)
                if history is None:
                    history = deque(maxlen=HISTORY_EVENTS)
                self._history.set(room, history, refresh=True)  # the most recently active
                history.append(data)
            await super().emit(
                event,
                data,
                to=to,
                room=room,
                skip_sid=skip_sid,
                namespace=namespace,
                callback=callback,
                ignore_queue=ignore_queue,
            )

    async def on_join_conversation(self, sid: str, data: Any = None) -> dict[str, Any]:
        """The relay's join (its catch-up included), then the conversation's history."""
        room = frames.room_of(data)
        if room is None:
            return await super().on_join_conversation(sid, data)
        async with self._turn(room):
            ack = await super().on_join_conversation(sid, data)
            history = self._history.get(room) if ack.get("ok") is True else None
            for event in list(history or ()):
                await super().emit(CHAT_EVENT, event, to=sid, ignore_queue=True)
        return ack

    @property
    def agent_connected(self) -> bool:
        """Whether an agent's internal connection is up."""
        return bool(self._agents)

    @property
    def agent_kernel(self) -> str | None:
        """The kernel the answering agent said it runs on (one of
        :data:`~kernel_ext.demo.script.KERNELS`), or ``None``."""
        return next(reversed(self._agents.values())) if self._agents else None

    async def on_connect(self, sid: str, environ: Mapping[str, Any], auth: Any = None) -> bool:
        """The relay's checks (a refused connection raises), then note who connected."""
        accepted = await super().on_connect(sid, environ, auth)
        internal = isinstance(auth, Mapping) and "internal" in auth
        if internal and auth.get("role") == "agent":
            kernel = auth.get("kernel")
            self._agents[sid] = kernel if kernel in KERNELS else None
        elif not internal:
            self._browser_sids.add(sid)
        return accepted

    async def on_disconnect(self, sid: str, reason: Any = None) -> None:
        """Forget the connection (the relay's bookkeeping included)."""
        self._agents.pop(sid, None)
        self._browser_sids.discard(sid)
        await super().on_disconnect(sid, reason)

    async def on_user_message(self, sid: str, data: Any = None) -> dict[str, Any]:
        """Forward a joined browser's message to the agent (class docstring)."""
        if sid not in self._browser_sids:
            self._count("rejected_user_message")
            return {"ok": False, "error": "only browsers send user messages"}
        conversation_id = data.get("conversationId") if isinstance(data, Mapping) else None
        text = data.get("text") if isinstance(data, Mapping) else None
        if not isinstance(conversation_id, str) or conversation_id not in self.rooms(sid):
            self._count("rejected_user_message")
            return {"ok": False, "error": "join the conversation first"}
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_MESSAGE_CHARS:
            self._count("rejected_user_message")
            return {"ok": False, "error": f"text must be 1 to {MAX_MESSAGE_CHARS} characters"}
        lang = data.get("lang")
        if lang is not None and lang not in LANGS:
            self._count("rejected_user_message")
            return {"ok": False, "error": f"lang must be one of {', '.join(LANGS)}"}
        if not self._agents:
            return {"ok": False, "error": "the agent is not connected"}
        agent = next(reversed(self._agents))
        message = {"conversationId": conversation_id, "text": text.strip()}
        if lang is not None:
            message["lang"] = lang
        try:
            ack = await self.call(
                USER_MESSAGE_TO_AGENT,
                message,
                to=agent,
                timeout=_AGENT_ACK_TIMEOUT,
            )
        except Exception as exc:  # TimeoutError, or the agent went away meanwhile
            logger.warning("demo relay: the agent did not take a message: %r", exc)
            return {"ok": False, "error": "the agent did not answer"}
        self._count("user_messages")
        if isinstance(ack, Mapping) and ack.get("ok") is True:
            return {"ok": True}
        error = ack.get("error") if isinstance(ack, Mapping) else None
        return {"ok": False, "error": error if isinstance(error, str) else "refused"}


class DemoApp:
    """The web process's ASGI ``app``, its ``sio`` server and its ``relay``."""

    def __init__(self, app: Any, sio: socketio.AsyncServer, relay: DemoRelay) -> None:
        self.app = app
        self.sio = sio
        self.relay = relay


def page_config(lang: str | None = None) -> dict[str, Any]:
    """``/demo/config.json``: ``lang`` (the page's language when given, else ``null``: the
    browser's), ``fallback`` (:data:`~kernel_ext.demo.script.FALLBACK_LANG`), ``langs``
    (each language's ``tag``, ``name``, ``firstQuestion``, ``suggestions``, ``colleagues``
    and page ``text``) and ``maxMessageChars``."""
    langs: dict[str, Any] = {}
    for code in LANGS:
        words = wording(code)
        langs[code] = {
            "tag": words.tag,
            "name": words.name,
            "firstQuestion": words.questions[0],
            "suggestions": list(words.questions[1:]),
            "colleagues": [{"key": c.key, "title": words.title(c.key)} for c in COLLEAGUES],
            "text": dict(words.page),
        }
    return {
        "lang": wording(lang).lang if lang is not None else None,
        "fallback": FALLBACK_LANG,
        "langs": langs,
        "maxMessageChars": MAX_MESSAGE_CHARS,
    }


def create_demo_app(
    secret: str, *, redis_url: str | None = None, lang: str | None = None
) -> DemoApp:
    """The demo's web app: page, renderer, Socket.IO client, font, config and health routes,
    and the ``/chat`` :class:`DemoRelay` on an ``AsyncServer`` (same-origin browsers only;
    Redis client manager when ``redis_url`` is given). ``lang`` fixes the page's starting
    language; without it the page takes the browser's. Raises ``ValueError`` for a
    language the demo does not speak."""
    settings = page_config(lang)
    page_html = render_page(wording(lang or FALLBACK_LANG))
    manager = RelayRedisManager(redis_url) if redis_url else None
    sio = socketio.AsyncServer(
        async_mode="asgi",
        client_manager=manager,
        cors_allowed_origins=None,  # python-engineio: same origin only
        max_http_buffer_size=4 * 1024 * 1024,
    )
    relay = DemoRelay(secret)
    sio.register_namespace(relay)
    root = static_root()

    def page(request: Request) -> Response:
        response = HTMLResponse(page_html)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["Cache-Control"] = "no-store"
        return response

    def asset(name: str, media_type: str = "text/javascript; charset=utf-8") -> Any:
        def serve(request: Request) -> Response:
            return FileResponse(asset_path(name), media_type=media_type)

        return serve

    def config(request: Request) -> Response:
        return JSONResponse(settings)

    def health(request: Request) -> Response:
        health: dict[str, Any] = {"agent": relay.agent_connected}
        if relay.agent_connected:
            health["kernel"] = relay.agent_kernel
        return JSONResponse(health)

    starlette = Starlette(
        routes=[
            Route("/", page),
            Route("/renderer.js", asset("renderer.js")),
            Route("/" + SOCKET_IO_CLIENT, asset(SOCKET_IO_CLIENT)),
            Route("/" + FONT_PATH, asset(FONT_PATH, "font/woff2")),
            Route("/" + FONT_LICENCE, asset(FONT_LICENCE, "text/plain; charset=utf-8")),
            Route("/demo/config.json", config),
            Route("/demo/health", health),
            Mount("/static", StaticFiles(directory=root), name="static"),
        ]
    )
    return DemoApp(with_probes(socketio.ASGIApp(sio, other_asgi_app=starlette), relay), sio, relay)


def main(argv: list[str] | None = None) -> int:
    """``python -m kernel_ext.demo.web [--host H] [--port P] [--redis URL] [--lang L]``."""
    parser = argparse.ArgumentParser(prog="python -m kernel_ext.demo.web")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--redis", default=None, help="redis:// URL for the client manager")
    parser.add_argument(
        "--lang",
        choices=LANGS,
        default=None,
        help="the page's starting language (default: the browser's)",
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    secret = load_settings().secret_value()
    if not secret:
        parser.error(f"set {env_name('secret')} to the internal senders' secret")
    logging.basicConfig(level=args.log_level.upper(), format="web %(levelname)s %(message)s")
    import uvicorn

    demo = create_demo_app(secret, redis_url=args.redis, lang=args.lang)
    uvicorn.run(
        demo.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
