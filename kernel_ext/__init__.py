"""kernel_ext: live, attributed tool-call detail streams for agent kernels.

The root holds what kernel integrators and tool authors use:

* tool authors: :func:`publish` (and :func:`publish_chat_event`), :func:`current_call_id`,
  :func:`current_tool_call`, :func:`use_tool_call` and :class:`ToolCall`
  (``ToolCall.stop_requested``);
* whoever stops one running call: :func:`stop_call` and its :data:`StopAnswer`;
* integrators: :func:`enable`, :func:`disable` / ``await`` :func:`adisable`, :func:`enabled`
  (what is running),
  :class:`ToolDescription` (the describe hook's answer), :func:`set_tool_call` /
  :func:`reset_tool_call` for runtimes with hooks;
* everyone: the error family (:class:`KernelExtError` and its subclasses), ``__version__``.

The root's modules are the public face: :mod:`kernel_ext.context` (the contextvar),
:mod:`kernel_ext.errors`, :mod:`kernel_ext.settings` (every ``KERNEL_EXT_*`` variable),
``__main__`` (``python -m kernel_ext`` is the ``kernel-ext`` command), ``_version`` and
:mod:`kernel_ext.stop` (stopping one running call). Everything else lives in a sub-package
named for what it is, each listing its modules:

* :mod:`kernel_ext.protocol` — the wire (blocks, envelopes, encode/decode; ``.schema``);
* :mod:`kernel_ext.worker` — the worker process's life (``enable``, fork, shutdown, the
  OpenTelemetry entry point);
* :mod:`kernel_ext.stream`, :mod:`kernel_ext.emit`, :mod:`kernel_ext.attribution`,
  :mod:`kernel_ext.instrument` — the worker side: the hub, the senders, which call a block
  belongs to, the tool wrappers;
* :mod:`kernel_ext.relay` — the relay (web process) side;
* :mod:`kernel_ext.redis` — everything that speaks Redis (the worker's sender, the relay's
  client manager, room routing);
* :mod:`kernel_ext.observability` — what kernel_ext counts and logs;
* :mod:`kernel_ext.cli` — the ``kernel-ext`` command;
* :mod:`kernel_ext.integrations`, :mod:`kernel_ext.a2a`, :mod:`kernel_ext.viewing`,
  :mod:`kernel_ext.web`, :mod:`kernel_ext.testing`, :mod:`kernel_ext.demo`;
* ``kernel_ext._shared`` — private mechanisms both sides share.

Importing ``kernel_ext`` is light: only the contextvar and the errors are imported at once;
each other name is imported the first time it is used (PEP 562), and importing
``kernel_ext`` or ``kernel_ext.context`` loads no Socket.IO, Engine.IO or aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernel_ext._shared.lazy import module_getattr
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
    from kernel_ext.stop import StopAnswer, stop_call
    from kernel_ext.stream import publish, publish_chat_event
    from kernel_ext.worker.wiring import adisable, disable, enable, enabled

__all__ = [
    "BlockTooLargeError",
    "ColleagueError",
    "ConfigError",
    "DecodeError",
    "KernelExtError",
    "StopAnswer",
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
    "stop_call",
    "use_tool_call",
]

# Root names imported on first use, by module.
_LAZY = {
    "publish": "kernel_ext.stream",
    "publish_chat_event": "kernel_ext.stream",
    "enable": "kernel_ext.worker.wiring",
    "disable": "kernel_ext.worker.wiring",
    "adisable": "kernel_ext.worker.wiring",
    "enabled": "kernel_ext.worker.wiring",
    "ToolDescription": "kernel_ext.instrument",
    "stop_call": "kernel_ext.stop",
    "StopAnswer": "kernel_ext.stop",
}

__getattr__ = module_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(__all__)
