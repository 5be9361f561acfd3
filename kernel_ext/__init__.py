"""kernel_ext: live, attributed tool-call detail streams for agent kernels.

Public names are re-exported here; see each module for its guarantees.
"""

from __future__ import annotations

from kernel_ext.context import (
    ToolCall,
    current_call_id,
    current_tool_call,
    reset_tool_call,
    set_tool_call,
    use_tool_call,
)
from kernel_ext.emit import Emitter, LoopbackEmitter, MemoryEmitter, RedisEmitter
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
from kernel_ext.relay import ChatRelay, create_app, mount_relay
from kernel_ext.resolve import Resolution, ResolutionPath, resolve_call_id
from kernel_ext.stream import (
    StreamHub,
    get_default_hub,
    publish,
    publish_chat_event,
    set_default_hub,
)
from kernel_ext.tap import CallSink, LiveCall, Tap, default_tap

__version__ = "0.1.0"

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
