"""kernel_ext: live, attributed tool-call detail streams for agent kernels.

Public names are re-exported here; see each module for its guarantees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kernel_ext.context import (
    ToolCall,
    current_call_id,
    current_tool_call,
    reset_tool_call,
    set_tool_call,
    use_tool_call,
)
from kernel_ext.emit import Emitter, LoopbackEmitter, RedisEmitter
from kernel_ext.errors import (
    BlockTooLargeError,
    ColleagueError,
    ConfigError,
    DecodeError,
    KernelExtError,
)
from kernel_ext.instrument import ToolDescription, ToolRuntimeInstrumentor
from kernel_ext.plugin import adisable, disable, enable
from kernel_ext.processor import ToolSpanProcessor
from kernel_ext.protocol import Block, Envelope, decode, encode, pseudo_envelope
from kernel_ext.resolve import Resolution, ResolutionPath, resolve_call_id
from kernel_ext.stream import (
    StreamHub,
    get_default_hub,
    publish,
    publish_chat_event,
    set_default_hub,
)
from kernel_ext.tap import CallSink, LiveCall, Tap, default_tap
from kernel_ext.testing import MemoryEmitter

if TYPE_CHECKING:
    from kernel_ext.relay import ChatRelay, create_app, mount_relay

__version__ = "0.1.0"

# Imported on first use: ``python -m kernel_ext.relay`` must find the module not yet
# imported (runpy warns, and would run a second copy of it, otherwise).
_RELAY_NAMES = frozenset({"ChatRelay", "create_app", "mount_relay"})


def __getattr__(name: str) -> Any:
    if name in _RELAY_NAMES:
        from kernel_ext import relay

        return getattr(relay, name)
    raise AttributeError(f"module 'kernel_ext' has no attribute {name!r}")


__all__ = [
    "Block",
    "BlockTooLargeError",
    "CallSink",
    "ChatRelay",
    "ColleagueError",
    "ConfigError",
    "DecodeError",
    "Emitter",
    "Envelope",
    "KernelExtError",
    "LiveCall",
    "LoopbackEmitter",
    "MemoryEmitter",
    "RedisEmitter",
    "Resolution",
    "ResolutionPath",
    "StreamHub",
    "Tap",
    "ToolCall",
    "ToolDescription",
    "ToolRuntimeInstrumentor",
    "ToolSpanProcessor",
    "__version__",
    "adisable",
    "create_app",
    "current_call_id",
    "current_tool_call",
    "decode",
    "default_tap",
    "disable",
    "enable",
    "encode",
    "get_default_hub",
    "mount_relay",
    "pseudo_envelope",
    "publish",
    "publish_chat_event",
    "reset_tool_call",
    "resolve_call_id",
    "set_default_hub",
    "set_tool_call",
    "use_tool_call",
]
