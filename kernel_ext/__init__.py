"""kernel_ext: live, attributed tool-call detail streams for agent kernels.

The root holds what kernel integrators and tool authors use:

* tool authors: :func:`publish` (and :func:`publish_chat_event`), :func:`current_call_id`,
  :func:`current_tool_call`, :func:`use_tool_call` and :class:`ToolCall`;
* integrators: :func:`enable`, :func:`disable` / ``await`` :func:`adisable`, :func:`enabled`
  (what is running),
  :class:`ToolDescription` (the describe hook's answer), :func:`set_tool_call` /
  :func:`reset_tool_call` for runtimes with hooks;
* everyone: the error family (:class:`KernelExtError` and its subclasses), ``__version__``.

Everything else lives in its module (``kernel_ext.protocol``, ``.stream``, ``.emit``,
``.relay``, ``.tap``, ``.resolve``, ``.processor``, ``.instrument``, ``.testing`` …).
Importing ``kernel_ext`` is light: only the contextvar and the errors are imported at once;
each other name is imported the first time it is used (PEP 562), and importing
``kernel_ext`` or ``kernel_ext.context`` loads no Socket.IO, Engine.IO or aiohttp.

Names the root exported before they moved to their modules still resolve, with a
``DeprecationWarning`` naming the module to import them from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernel_ext import _moved
from kernel_ext._lazy import module_getattr
from kernel_ext._version import __version__
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

if TYPE_CHECKING:
    from kernel_ext.instrument import ToolDescription
    from kernel_ext.plugin import adisable, disable, enable, enabled
    from kernel_ext.stream import publish, publish_chat_event

__all__ = [
    "BlockTooLargeError",
    "ColleagueError",
    "ConfigError",
    "DecodeError",
    "KernelExtError",
    "ToolCall",
    "ToolDescription",
    "__version__",
    "adisable",
    "current_call_id",
    "current_tool_call",
    "disable",
    "enable",
    "enabled",
    "publish",
    "publish_chat_event",
    "reset_tool_call",
    "set_tool_call",
    "use_tool_call",
]

# Root names imported on first use, by module.
_LAZY = {
    "publish": "kernel_ext.stream",
    "publish_chat_event": "kernel_ext.stream",
    "enable": "kernel_ext.plugin",
    "disable": "kernel_ext.plugin",
    "adisable": "kernel_ext.plugin",
    "enabled": "kernel_ext.plugin",
    "ToolDescription": "kernel_ext.instrument",
}

# Names the root used to export, and where they live now.
_MOVED = {
    "Block": "kernel_ext.protocol",
    "Envelope": "kernel_ext.protocol",
    "decode": "kernel_ext.protocol",
    "encode": "kernel_ext.protocol",
    "pseudo_envelope": "kernel_ext.protocol",
    "CallSink": "kernel_ext.attribution.tap",
    "LiveCall": "kernel_ext.attribution.tap",
    "Tap": "kernel_ext.attribution.tap",
    "default_tap": "kernel_ext.attribution.tap",
    "Resolution": "kernel_ext.attribution.resolve",
    "ResolutionPath": "kernel_ext.attribution.resolve",
    "resolve_call_id": "kernel_ext.attribution.resolve",
    "StreamHub": "kernel_ext.stream",
    "get_default_hub": "kernel_ext.stream",
    "set_default_hub": "kernel_ext.stream",
    "Emitter": "kernel_ext.emit",
    "LoopbackEmitter": "kernel_ext.emit",
    "RedisEmitter": "kernel_ext.emit",
    "MemoryEmitter": "kernel_ext.testing",
    "ChatRelay": "kernel_ext.relay",
    "create_app": "kernel_ext.relay",
    "mount_relay": "kernel_ext.relay",
    "ToolRuntimeInstrumentor": "kernel_ext.instrument",
    "ToolSpanProcessor": "kernel_ext.attribution.processor",
}


__getattr__ = module_getattr(__name__, _LAZY, _MOVED)
_moved.install()  # the old paths of modules that moved (kernel_ext._moved)


def __dir__() -> list[str]:
    return sorted(__all__)
