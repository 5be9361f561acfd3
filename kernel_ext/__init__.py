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
from kernel_ext.errors import (
    BlockTooLargeError,
    ColleagueError,
    ConfigError,
    DecodeError,
    KernelExtError,
)
from kernel_ext.protocol import Block, Envelope, decode, encode, pseudo_envelope

__version__ = "0.1.0"

__all__ = [
    "Block",
    "BlockTooLargeError",
    "ColleagueError",
    "ConfigError",
    "DecodeError",
    "Envelope",
    "KernelExtError",
    "ToolCall",
    "__version__",
    "current_call_id",
    "current_tool_call",
    "decode",
    "encode",
    "pseudo_envelope",
    "reset_tool_call",
    "set_tool_call",
    "use_tool_call",
]
