"""The ``kernel-ext`` command line (``python -m kernel_ext`` runs it too).

Modules:

* :mod:`kernel_ext.cli.entry` — the ``kernel-ext`` entry point (``main``): the ``relay``,
  ``tail``, ``demo`` and ``schema`` subcommands;
* :mod:`kernel_ext.cli.relay` — ``kernel-ext relay`` (also ``python -m kernel_ext.relay``):
  a standalone relay served with uvicorn;
* :mod:`kernel_ext.cli._common` — what every subcommand shares: one-line argument errors,
  option types, the listening socket, exit codes and stop signals.

``main`` is importable from this package (``kernel_ext.cli:main``, the entry point
pyproject.toml declares), imported from :mod:`kernel_ext.cli.entry` on first use.

The other subcommands live with what they run (:mod:`kernel_ext.viewing.tail`,
:mod:`kernel_ext.demo`). Importing this package imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernel_ext._shared.lazy import module_getattr

if TYPE_CHECKING:
    from kernel_ext.cli.entry import main

__all__ = ["main"]

__getattr__ = module_getattr(__name__, {"main": "kernel_ext.cli.entry"})
