"""kernel_ext.enable()/disable(): the whole worker pipeline wired in one call."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from typing import Any

import pytest
from opentelemetry.instrumentation.distro import DefaultDistro
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import ROOT
from support.network import free_port, serve_asgi
from support.relay_helpers import SECRET, Browser, barrier, terminals

import kernel_ext
from kernel_ext.attribution.tap import Tap
from kernel_ext.context import ToolCall, current_tool_call, use_tool_call
from kernel_ext.emit import LoopbackEmitter, RedisEmitter
from kernel_ext.errors import ConfigError
from kernel_ext.instrument import ToolDescription, ToolRuntimeInstrumentor
from kernel_ext.relay import allow_all, create_app
from kernel_ext.stream import get_default_hub, publish
from kernel_ext.testing import MemoryEmitter
from kernel_ext.worker import wiring
from kernel_ext.worker.auto import AutoInstrumentor

CONV = "conv-plugin"
TARGET_ASYNC = f"{__name__}:ask_colleague"
TARGET_SYNC = f"{__name__}:sync_tool"


async def ask_colleague(question: str, **kwargs: Any) -> str | None:
    """A tool: streams progress, answers unless asked to fail."""
    publish(f"thinking about {question}")
    publish("step 2")
    if question == "fail":
        return None  # no terminal: the span's end aborts the stream
    publish("the answer", state="done")
    return "the answer"


def sync_tool(question: str, **kwargs: Any) -> str:
    """A sync tool run in a worker thread."""
    publish(f"sync thinking about {question}")
    publish("sync answer", state="done")
    return "sync answer"


@pytest.fixture(autouse=True)
def _always_disable() -> Iterator[None]:
    yield
    wiring.disable(timeout=2)


@pytest.fixture
def tracing() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


async def test_enable_wires_instrumentor_processor_hub_and_emitter(
    tracing: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = tracing
    mem = MemoryEmitter()
    state = kernel_ext.enable(
        emitter=mem, tracer_provider=provider, targets=[TARGET_ASYNC], tap=Tap()
    )
    assert get_default_hub() is state.hub
    assert await ask_colleague("q", conversation_id=CONV, tool_name="ask_colleague") == (
        "the answer"
    )
    await ask_colleague("fail", conversation_id=CONV, tool_name="ask_colleague")
    await mem.wait_for(lambda records: len(records) >= 6)
    spans = [s for s in exporter.get_finished_spans() if s.name == "execute_tool ask_colleague"]
    assert len(spans) == 2
    ok_id, failed_id = (f"{s.context.span_id:016x}" for s in spans)
    ok_blocks = [b for b in mem.blocks(CONV) if b["callId"] == ok_id]
    failed_blocks = [b for b in mem.blocks(CONV) if b["callId"] == failed_id]
    assert [b["state"] for b in ok_blocks] == ["running", "running", "done"]
    assert [b["state"] for b in failed_blocks] == ["running", "running", "aborted"]
    attributes = spans[0].attributes or {}
    assert attributes["kernel_ext.stream.blocks_admitted"] == 3
    assert attributes["kernel_ext.call_id.path"] == "context"
    assert state.hub.stats().calls == 0  # released when the spans ended

    await kernel_ext.adisable()
    assert wiring.enabled() is None
    assert get_default_hub() is not state.hub
    assert not hasattr(globals()["ask_colleague"], "__wrapped__")  # uninstrumented


@pytest.mark.network
async def test_enable_without_a_loop_runs_the_sender_on_its_own_thread() -> None:
    ready = create_app(SECRET, authorize_join=allow_all)
    async with serve_asgi(ready.app) as port:
        browser = Browser()
        try:
            await browser.connect(port)
            assert await browser.join(CONV) == {"ok": True}
            state = await asyncio.to_thread(
                kernel_ext.enable,
                relay_url=f"http://127.0.0.1:{port}",
                secret=SECRET,
                targets=[TARGET_SYNC],
                tap=Tap(),
            )
            assert isinstance(state.emitter, LoopbackEmitter)
            assert state.loop is not asyncio.get_running_loop()
            answer = await asyncio.to_thread(
                sync_tool, "q", conversation_id=CONV, tool_name="sync_tool"
            )
            assert answer == "sync answer"
            await browser.wait_for(lambda blocks: len(terminals(blocks)) == 1)
            await asyncio.to_thread(kernel_ext.disable, 5)
            await barrier(browser, port)
            assert [b["state"] for b in browser.blocks] == ["running", "done"]
            assert not hasattr(globals()["sync_tool"], "__wrapped__")
        finally:
            await browser.close()


def test_environment_configures_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNEL_EXT_RELAY_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("KERNEL_EXT_SECRET", SECRET)
    monkeypatch.setenv("KERNEL_EXT_MAX_RUNNING_PER_SECOND", "3")
    monkeypatch.setenv("KERNEL_EXT_MAX_STREAMS", "50")
    state = kernel_ext.enable(tap=Tap())
    try:
        assert isinstance(state.emitter, LoopbackEmitter)
        assert state.hub.max_running_per_second == 3.0
        assert state.hub.max_streams == 50
        assert kernel_ext.enable() is state  # idempotent
    finally:
        kernel_ext.disable(timeout=1)
    kernel_ext.disable()  # idempotent too


def test_redis_url_selects_the_redis_emitter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNEL_EXT_RELAY_URL", raising=False)
    monkeypatch.setenv("KERNEL_EXT_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    state = kernel_ext.enable(tap=Tap(), emitter_options={"health_interval": 60})
    try:
        assert isinstance(state.emitter, RedisEmitter)
    finally:
        kernel_ext.disable(timeout=1)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KERNEL_EXT_MAX_RUNNING_PER_SECOND": "fast"}, "KERNEL_EXT_MAX_RUNNING_PER_SECOND"),
        ({"KERNEL_EXT_MAX_RUNNING_PER_SECOND": "-1"}, "max_running_per_second"),
        ({"KERNEL_EXT_RELAY_URL": "http://127.0.0.1:1"}, "KERNEL_EXT_SECRET"),
    ],
)
def test_bad_configuration_raises_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    monkeypatch.delenv("KERNEL_EXT_SECRET", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = get_default_hub()
    with pytest.raises(ConfigError, match=message):
        kernel_ext.enable(tap=Tap())
    assert wiring.enabled() is None
    assert get_default_hub() is before


def test_without_a_sender_blocks_are_counted_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("KERNEL_EXT_RELAY_URL", "KERNEL_EXT_REDIS_URL", "KERNEL_EXT_TARGETS"):
        monkeypatch.delenv(key, raising=False)
    state = kernel_ext.enable(tap=Tap())
    with use_tool_call(ToolCall("00f067aa0ba902b7", "ask_colleague", CONV)):
        publish("nobody listens")
    assert state.hub.stats()["no_sender"] == 1
    assert state.hub.stats().queue == 0


# -- the opentelemetry_instrumentor entry point (opentelemetry-instrument) ----------------

PYPROJECT = ROOT / "pyproject.toml"
SENDER_VARIABLES = ("KERNEL_EXT_RELAY_URL", "KERNEL_EXT_REDIS_URL")


def declared_entry_point() -> EntryPoint:
    """The ``opentelemetry_instrumentor`` entry point pyproject.toml declares (read from the
    source: an installed copy's metadata may be older)."""
    text = PYPROJECT.read_text(encoding="utf-8")
    section = re.search(
        r"^\[project\.entry-points\.opentelemetry_instrumentor\]\n(.*?)(?=^\[|\Z)",
        text,
        re.S | re.M,
    )
    assert section is not None
    [(name, value)] = re.findall(r'^(\w+) = "([^"]+)"$', section.group(1), re.M)
    return EntryPoint(name, value, "opentelemetry_instrumentor")


def recording_tool(question: str, **kwargs: Any) -> ToolCall | None:
    """A tool for the entry point's targets: publishes, returns the active call."""
    publish(f"thinking about {question}")
    return current_tool_call()


def describe_recording_tool(
    instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ToolDescription:
    return ToolDescription("from_env", kwargs.get("conversation_id"))


@pytest.fixture
def auto() -> Iterator[AutoInstrumentor]:
    instrumentor = AutoInstrumentor()
    yield instrumentor
    instrumentor.uninstrument()


def test_the_entry_point_enables_the_pipeline_on_the_environments_targets(
    monkeypatch: pytest.MonkeyPatch, auto: AutoInstrumentor
) -> None:
    for key in SENDER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("KERNEL_EXT_TARGETS", f" {__name__}:recording_tool , ")
    monkeypatch.setenv("KERNEL_EXT_DESCRIBE", f"{__name__}:describe_recording_tool")
    monkeypatch.setenv("KERNEL_EXT_MAX_QUEUE", "7")
    entry_point = declared_entry_point()
    assert entry_point.name == "kernel_ext"
    # What opentelemetry-instrument does with each opentelemetry_instrumentor entry point.
    DefaultDistro().load_instrumentor(entry_point, skip_dep_check=True)
    state = wiring.enabled()
    assert state is not None
    assert state.hub.max_queue == 7
    instrumentor = ToolRuntimeInstrumentor()
    assert instrumentor.targets == (f"{__name__}:recording_tool",)
    assert instrumentor.sink is state.hub
    call = globals()["recording_tool"]("q", conversation_id=CONV)
    assert call is not None
    assert (call.tool_name, call.conversation_id, len(call.call_id)) == ("from_env", CONV, 16)
    assert state.hub.stats()["no_sender"] == 1  # the enabled hub took the block
    auto.uninstrument()
    assert wiring.enabled() is None
    assert instrumentor.targets == ()
    assert not hasattr(globals()["recording_tool"], "__wrapped__")


def test_the_entry_point_does_nothing_without_targets(
    monkeypatch: pytest.MonkeyPatch, auto: AutoInstrumentor
) -> None:
    monkeypatch.delenv("KERNEL_EXT_TARGETS", raising=False)
    monkeypatch.setenv("KERNEL_EXT_RELAY_URL", "http://127.0.0.1:1")  # would need a secret
    auto.instrument()
    assert wiring.enabled() is None
    assert ToolRuntimeInstrumentor().targets == ()


def test_the_entry_point_leaves_a_plugin_enabled_elsewhere_alone(
    monkeypatch: pytest.MonkeyPatch, auto: AutoInstrumentor
) -> None:
    for key in SENDER_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    mine = kernel_ext.enable(tap=Tap())
    monkeypatch.setenv("KERNEL_EXT_TARGETS", f"{__name__}:recording_tool")
    auto.instrument()
    assert wiring.enabled() is mine
    auto.uninstrument()
    assert wiring.enabled() is mine


def test_a_bad_environment_value_fails_the_entry_point_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, auto: AutoInstrumentor
) -> None:
    monkeypatch.setenv("KERNEL_EXT_TARGETS", f"{__name__}:recording_tool")
    monkeypatch.setenv("KERNEL_EXT_DESCRIBE", f"{__name__}:nothing_here")
    before = get_default_hub()
    with pytest.raises(ConfigError, match="KERNEL_EXT_DESCRIBE"):
        auto.instrument()
    assert wiring.enabled() is None
    assert get_default_hub() is before
    assert ToolRuntimeInstrumentor().targets == ()
