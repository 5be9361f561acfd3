"""Export the demo's spans over OTLP to a real trace backend and check them through its API.

The backend is Arize Phoenix (``pip install arize-phoenix``: large, runs offline). The
script

1. starts ``phoenix serve`` bound to 127.0.0.1 on free ports, with its data in a temporary
   directory, telemetry off and no external resources (or uses ``--phoenix-url``);
2. runs the demo's agent (:class:`kernel_ext.demo.worker.DemoAgent`: pydantic-ai with the
   scripted model, :class:`~kernel_ext.integrations.pydantic_ai.KernelExtCapability`) with
   its two scripted A2A colleagues and a ``/chat`` relay, all in this process on 127.0.0.1,
   wired by :func:`kernel_ext.enable` on a tracer provider that exports over OTLP/HTTP; a
   browser-like Socket.IO client joined to the conversation records the blocks;
3. asks the demo's first question (two concurrent ``ask_colleague`` calls), flushes the
   spans, and reads them back from Phoenix's REST API;
4. checks that each tool span arrived with its stream attributes: ``gen_ai.*`` names and
   ids, ``kernel_ext.call_id.path = context``, ``kernel_ext.stream.blocks_admitted`` equal to
   the running and terminal blocks the browser received for that callId (= the span id),
   ``kernel_ext.stream.blocks_dropped = 0``, every one of those blocks carrying the span's
   trace id as ``traceId``; then prints what a user sees in the backend;
5. opens the reference renderer in headless Chromium (Debian's ``chromium`` through
   Playwright), fed those blocks, with Phoenix's span URL template as ``traceUrl``
   (``<phoenix>/redirects/spans/{spanId}``), clicks each pane's link and checks that the tab
   it opens lands on that span in Phoenix's UI: the trace of the span's trace id with the
   span selected (``selectedSpanNodeId``, read back through Phoenix's GraphQL API), and the
   span's name shown (``--no-browser`` skips this step).

Exit status 0 when every check passed, 1 otherwise. Run it with ``tox -e otel-backend``
(not part of the default run), or in an environment with ``kernel-ext[demo]``,
``arize-phoenix`` and ``opentelemetry-exporter-otlp-proto-http``::

    python scripts/otel_backend_check.py [--phoenix-url http://127.0.0.1:6006] [--keep-open S]
        [--no-browser] [--chromium /usr/bin/chromium]

Step 5 needs ``playwright`` (its Python package only: it drives the installed Chromium).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import socketio
import uvicorn
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import kernel_ext
from kernel_ext.demo.script import COLLEAGUES, wording
from kernel_ext.demo.worker import Colleague, DemoAgent
from kernel_ext.relay import create_app
from kernel_ext.testing.a2a_peer import ScriptedPeer
from kernel_ext.testing.browser import CHROMIUM_ARGS, serve_directory
from kernel_ext.web import web_root

SERVICE_NAME = "kernel-ext-demo"
TOOL_SPAN = "execute_tool ask_colleague"
STREAM_ATTRIBUTES = (
    "kernel_ext.stream.blocks_admitted",
    "kernel_ext.stream.blocks_dropped",
    "kernel_ext.stream.streams",
    "kernel_ext.call_id.path",
)
STARTUP_LIMIT = 120.0
INGEST_LIMIT = 60.0
# Phoenix's span redirect (its UI route /redirects/spans/:span_otel_id): the renderer's
# traceUrl template for Phoenix, as docs/detail-pane.md gives it.
PHOENIX_SPAN_URL = "{base}/redirects/spans/{spanId}"
BROWSER_WAIT_MS = 60_000
# The demo's first question: it asks both colleagues at once (two concurrent tool calls).
FIRST_QUESTION = wording("en").questions[0]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def phoenix_command() -> list[str]:
    """How to start Phoenix from this environment."""
    beside = os.path.join(os.path.dirname(sys.executable), "phoenix")
    if os.path.exists(beside):
        return [beside, "serve"]
    found = shutil.which("phoenix")
    if found:
        return [found, "serve"]
    return [sys.executable, "-m", "phoenix.server.main", "serve"]


@contextlib.contextmanager
def phoenix(log_dir: str) -> Iterator[str]:
    """A Phoenix server on 127.0.0.1 for the duration; yields its base URL."""
    port, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": os.path.join(log_dir, "phoenix"),
        "PHOENIX_TELEMETRY_ENABLED": "false",
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    }
    log_path = os.path.join(log_dir, "phoenix.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            phoenix_command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_LIMIT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"phoenix exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(url + "/v1/projects", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"phoenix did not answer within {STARTUP_LIMIT:g} s")
            time.sleep(0.5)  # polling with a deadline while it boots
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[int]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 in this loop; yield its port."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    deadline = asyncio.get_running_loop().time() + 20
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped before it started")
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("uvicorn did not start within 20 s")
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


async def run_demo(otlp_endpoint: str, conversation_id: str) -> dict[str, list[dict[str, Any]]]:
    """Run the demo's first question with spans exported to ``otlp_endpoint``; return the
    blocks a browser received, by callId."""
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    secret = secrets.token_urlsafe(16)
    relay = create_app(secret, authorize_join=lambda identity, room: room == conversation_id)
    peers: list[ScriptedPeer] = []
    received: dict[str, list[dict[str, Any]]] = {}
    try:
        async with contextlib.AsyncExitStack() as stack:
            colleagues = []
            for spec in COLLEAGUES:
                port = free_port()
                peer = ScriptedPeer(f"http://127.0.0.1:{port}/", delay=0.1, name=spec.title)
                peers.append(peer)
                config = uvicorn.Config(
                    peer.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
                )
                server = uvicorn.Server(config)
                task = asyncio.create_task(server.serve())
                stack.push_async_callback(_stop, server, task)
                while not server.started:
                    if task.done():
                        task.result()
                    await asyncio.sleep(0.01)
                colleagues.append(Colleague(spec.key, spec.title, peer.url, spec.script))
            relay_port = await stack.enter_async_context(serve(relay.app))
            relay_url = f"http://127.0.0.1:{relay_port}"

            browser = socketio.AsyncClient()
            browser.on(
                "tool_event_stream",
                lambda block: received.setdefault(block["callId"], []).append(block),
                namespace="/chat",
            )
            await browser.connect(relay_url, namespaces=["/chat"], transports=["websocket"])
            stack.push_async_callback(browser.disconnect)
            ack = await browser.call(
                "join_conversation", {"conversationId": conversation_id}, namespace="/chat"
            )
            if ack != {"ok": True}:
                raise RuntimeError(f"join refused: {ack}")

            wired = kernel_ext.enable(relay_url=relay_url, secret=secret, tracer_provider=provider)
            try:
                agent = DemoAgent(colleagues, provider, hub=wired.hub, timeout=60)
                answer = await agent.answer(conversation_id, FIRST_QUESTION)
                print(f"agent: {answer}")
                if wired.emitter is not None:
                    await wired.emitter.flush(10)
                # Every block sent has been acknowledged by the relay; a round trip on the
                # browser's connection delivers whatever the relay emitted before it.
                await browser.call(
                    "leave_conversation", {"conversationId": "__barrier__"}, namespace="/chat"
                )
            finally:
                closing = kernel_ext.disable()
                if closing is not None:
                    await closing
    finally:
        for peer in peers:
            await peer.aclose()
        provider.force_flush()
        provider.shutdown()
    return received


async def _stop(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    await asyncio.wait_for(task, 20)


def attribute(attributes: dict[str, Any], name: str) -> Any:
    """An attribute from the backend's JSON, flat (``a.b``) or nested (``{a: {b}}``)."""
    if name in attributes:
        return attributes[name]
    node: Any = attributes
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def tool_spans(base_url: str, conversation_id: str) -> list[dict[str, Any]]:
    """The conversation's tool spans as the backend returns them (polls until both are in)."""
    deadline = time.monotonic() + INGEST_LIMIT
    while True:
        response = httpx.get(
            f"{base_url}/v1/projects/default/spans",
            params={"name": TOOL_SPAN, "limit": 1000},
            timeout=10,
        )
        response.raise_for_status()
        spans = [
            span
            for span in response.json()["data"]
            if attribute(span.get("attributes", {}), "gen_ai.conversation.id") == conversation_id
        ]
        if len(spans) >= 2 or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)  # polling with a deadline while the backend ingests


def check(spans: list[dict[str, Any]], received: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every problem found (empty: all good)."""
    problems = []
    if len(spans) != 2:
        problems.append(f"expected 2 '{TOOL_SPAN}' spans in the backend, found {len(spans)}")
    for span in spans:
        call_id = span["context"]["span_id"]
        attributes = span.get("attributes", {})
        blocks = received.get(call_id, [])
        expected = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "ask_colleague",
            "kernel_ext.call_id.path": "context",
            "kernel_ext.stream.blocks_admitted": len(blocks),
            "kernel_ext.stream.blocks_dropped": 0,
        }
        for name, want in expected.items():
            got = attribute(attributes, name)
            if got != want:
                problems.append(f"span {call_id}: {name} = {got!r}, expected {want!r}")
        terminals = [b for b in blocks if b["state"] != "running"]
        if len(terminals) != 1 or terminals[0]["state"] != "done":
            problems.append(f"span {call_id}: the browser got terminals {terminals!r}")
        trace_ids = {b.get("traceId") for b in blocks}
        if trace_ids != {span["context"]["trace_id"]}:
            problems.append(
                f"span {call_id} of trace {span['context']['trace_id']}: "
                f"its blocks carry traceId {sorted(map(str, trace_ids))}"
            )
    unknown = set(received) - {span["context"]["span_id"] for span in spans}
    if unknown:
        problems.append(f"blocks with callIds that match no tool span: {sorted(map(str, unknown))}")
    return problems


def trace_tree(base_url: str, trace_id: str) -> list[str]:
    """The span names of one trace, indented under their parents, in start order."""
    response = httpx.get(
        f"{base_url}/v1/projects/default/spans",
        params={"trace_id": trace_id, "limit": 1000, "sort": "start_time", "order": "asc"},
        timeout=10,
    )
    response.raise_for_status()
    spans = response.json()["data"]
    children: dict[str | None, list[dict[str, Any]]] = {}
    ids = {span["context"]["span_id"] for span in spans}
    for span in spans:
        parent = span.get("parent_id")
        children.setdefault(parent if parent in ids else None, []).append(span)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in children.get(parent, []):
            lines.append(f"{'  ' * depth}{span['name']}  [{span['span_kind']}]")
            walk(span["context"]["span_id"], depth + 1)

    walk(None, 0)
    return lines


def show(spans: list[dict[str, Any]], base_url: str) -> None:
    """Print the trace and the tool spans the way the backend shows them."""
    if spans:
        print(f"\nthe trace in Phoenix ({base_url}), project 'default':")
        for line in trace_tree(base_url, spans[0]["context"]["trace_id"]):
            print(f"  {line}")
    print(f"\n{len(spans)} tool span(s):")
    for span in spans:
        attributes = span.get("attributes", {})
        print(f"\n  {span['name']}  [{span['span_kind']}, status {span['status_code']}]")
        print(f"    span_id {span['context']['span_id']}  parent {span.get('parent_id')}")
        for name in (
            "gen_ai.operation.name",
            "gen_ai.tool.name",
            "gen_ai.tool.call.id",
            "gen_ai.conversation.id",
            *STREAM_ATTRIBUTES,
        ):
            print(f"    {name} = {attribute(attributes, name)!r}")


MOUNT_AND_FEED = """async ([template, blocks]) => {
  const { mountRoom } = await import("./renderer.js");
  const node = document.createElement("div");
  node.id = "traced";
  document.body.prepend(node);
  mountRoom(node, window.kx.store, { locale: "en", traceUrl: template });
  for (const block of blocks) window.kx.store.applyBlock(block);
}"""


def span_node(base_url: str, node_id: str) -> dict[str, Any]:
    """What Phoenix's GraphQL API says of the span node ``node_id`` (its UI's selection)."""
    query = "query ($id: ID!) { node(id: $id) { ... on Span { name spanId trace { traceId } } } }"
    response = httpx.post(
        f"{base_url}/graphql", json={"query": query, "variables": {"id": node_id}}, timeout=10
    )
    response.raise_for_status()
    node: dict[str, Any] = response.json()["data"]["node"] or {}
    return node


def open_links(
    base_url: str,
    spans: list[dict[str, Any]],
    received: dict[str, list[dict[str, Any]]],
    chromium: str,
    template: str,
) -> list[str]:
    """Click each tool span's pane link (``template`` as the renderer's ``traceUrl``) in
    Chromium; every problem found (empty: all good)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    blocks = [block for call_blocks in received.values() for block in call_blocks]
    with serve_directory(web_root()) as files, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.set_default_timeout(BROWSER_WAIT_MS)
            page.goto(f"{files}/example.html?play=0&lang=en")
            page.wait_for_selector("body[data-ready='1']")
            page.evaluate(MOUNT_AND_FEED, [template, blocks])
            for span in spans:
                call_id = span["context"]["span_id"]
                trace_id = span["context"]["trace_id"]
                link = page.locator(f"#traced section[data-call-id='{call_id}'] a.kx-trace")
                href = link.get_attribute("href")
                want = template.replace("{spanId}", call_id).replace("{traceId}", trace_id)
                if href != want:
                    problems.append(f"span {call_id}: the pane links to {href!r}")
                    continue
                with page.context.expect_page() as opened:
                    link.click()
                tab = opened.value
                tab.set_default_timeout(BROWSER_WAIT_MS)
                landed = re.compile(rf"/projects/[^/]+/spans/{trace_id}\?(.*&)?selectedSpanNodeId=")
                try:
                    tab.wait_for_url(landed)
                    tab.get_by_text(TOOL_SPAN).first.wait_for()
                except PlaywrightTimeout:
                    problems.append(f"span {call_id}: the link opened {tab.url}, not the span")
                    tab.close()
                    continue
                node_id = httpx.URL(tab.url).params.get("selectedSpanNodeId", "")
                node = span_node(base_url, node_id)
                shown = {
                    "spanId": node.get("spanId"),
                    "traceId": (node.get("trace") or {}).get("traceId"),
                    "name": node.get("name"),
                }
                wanted = {"spanId": call_id, "traceId": trace_id, "name": TOOL_SPAN}
                if shown != wanted:
                    problems.append(f"span {call_id}: the link opened {tab.url}, showing {shown}")
                else:
                    decoded = base64.b64decode(node_id + "==").decode(errors="replace")
                    print(f"  pane {call_id} -> {tab.url}  (span node {decoded}: {shown['name']})")
                tab.close()
        finally:
            browser.close()
    return problems


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--phoenix-url", help="use this running Phoenix instead of starting one (its base URL)"
    )
    parser.add_argument(
        "--keep-open",
        type=float,
        default=0.0,
        metavar="S",
        help="keep the started Phoenix up S seconds after the check, to look at its UI",
    )
    parser.add_argument(
        "--no-browser", action="store_true", help="skip step 5 (the pane's link in Chromium)"
    )
    parser.add_argument(
        "--chromium", default="/usr/bin/chromium", help="the Chromium Playwright drives"
    )
    parser.add_argument(
        "--span-url",
        default=PHOENIX_SPAN_URL,
        metavar="TEMPLATE",
        help="the pane's traceUrl; {base} is Phoenix's base URL (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    conversation_id = f"otel-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="kx-otel-") as tmp, contextlib.ExitStack() as stack:
        base_url = args.phoenix_url or stack.enter_context(phoenix(tmp))
        base_url = base_url.rstrip("/")
        print(f"phoenix: {base_url}")
        received = asyncio.run(run_demo(base_url + "/v1/traces", conversation_id))
        spans = tool_spans(base_url, conversation_id)
        show(spans, base_url)
        problems = check(spans, received)
        if not args.no_browser and spans:
            print("\nthe panes' links to their spans, clicked in Chromium:")
            template = args.span_url.replace("{base}", base_url)
            problems += open_links(base_url, spans, received, args.chromium, template)
        if args.keep_open > 0 and not args.phoenix_url:
            print(f"\nPhoenix stays up for {args.keep_open:g} s: {base_url}")
            time.sleep(args.keep_open)
    if problems:
        print("\nFAILED:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("\nOK: every tool span arrived with its stream attributes and trace id", end="")
    print("" if args.no_browser else "; each pane's link opened its span in Phoenix")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
