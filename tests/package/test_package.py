"""The root package: what it exports, what importing it costs."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

import kernel_ext

HEAVY = (
    "socketio",
    "engineio",
    "aiohttp",
    "wrapt",
    "opentelemetry.sdk",
    "redis",
    "uvicorn",
    "mcp",
    "agents",  # the OpenAI Agents SDK: kernel_ext.integrations.openai_agents
    "openai",
)


def imported_after(statement: str) -> list[str]:
    """Top-level modules a fresh interpreter has imported after running ``statement``."""
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return list(json.loads(out.stdout))


@pytest.mark.parametrize(
    "statement",
    [
        "import kernel_ext",
        "import kernel_ext.context",
        "from kernel_ext import current_call_id, use_tool_call, ToolCall, KernelExtError",
        "from kernel_ext import publish",
        "from kernel_ext import stop_call, StopAnswer",
    ],
)
def test_importing_what_tool_authors_use_loads_no_transport_or_sdk(statement: str) -> None:
    loaded = imported_after(statement)
    heavy = [m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == []


def test_the_root_exports_what_integrators_and_tool_authors_use() -> None:
    assert set(kernel_ext.__all__) == {
        "publish",
        "publish_chat_event",
        "current_call_id",
        "current_tool_call",
        "use_tool_call",
        "set_tool_call",
        "reset_tool_call",
        "ToolCall",
        "ToolDescription",
        "stop_call",
        "StopAnswer",
        "enable",
        "enabled",
        "disable",
        "adisable",
        "KernelExtError",
        "ConfigError",
        "DecodeError",
        "BlockTooLargeError",
        "ColleagueError",
        "__version__",
    }
    for name in kernel_ext.__all__:
        assert getattr(kernel_ext, name) is not None


def test_the_root_has_its_names_and_no_other() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_ext.publish is kernel_ext.publish  # a root name: no warning
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kernel_ext.nothing  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'StreamHub'"):
        kernel_ext.StreamHub  # type: ignore[attr-defined]  # noqa: B018  # its home: .stream


def test_the_senders_port_keeps_its_import_paths() -> None:
    from kernel_ext.stream import SenderPort
    from kernel_ext.stream.hub import SenderPort as from_hub

    assert from_hub is SenderPort
