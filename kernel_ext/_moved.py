"""Modules that moved keep resolving at their old import paths, with a ``DeprecationWarning``
naming the new one: ``import kernel_ext.processor`` gives the module
``kernel_ext.attribution.processor`` itself (so patching either name patches both), and
``python -m kernel_ext.a2a_peer`` still runs. Installed by ``kernel_ext``'s ``__init__``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

__all__ = ["MOVED", "install"]

MOVED = {
    "kernel_ext.tap": "kernel_ext.attribution.tap",
    "kernel_ext.resolve": "kernel_ext.attribution.resolve",
    "kernel_ext.processor": "kernel_ext.attribution.processor",
    "kernel_ext._conventions": "kernel_ext.attribution._conventions",
    "kernel_ext.view": "kernel_ext.viewing.view",
    "kernel_ext.tail": "kernel_ext.viewing.tail",
    "kernel_ext.a2a_peer": "kernel_ext.testing.a2a_peer",
    "kernel_ext._cli": "kernel_ext._command_line",
    "kernel_ext.relay.hostile": "kernel_ext.relay.guarded",
    "kernel_ext.relay.terminals": "kernel_ext.relay.terminal_memory",
    "kernel_ext.emit.terminals": "kernel_ext.emit.held_terminals",
    "kernel_ext.relay.redis": "kernel_ext.relay.redis_manager",
    "kernel_ext.emit.redis": "kernel_ext.emit.redis_emitter",
    "kernel_ext.demo.colleague": "kernel_ext.demo.colleague_server",
}
"""Old module path → the module's home now."""


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds an old path of :data:`MOVED`; loads it as the module at its new home."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        home = MOVED[spec.name]
        # stacklevel 2: warnings skips the import machinery's frames to the importer.
        warnings.warn(f"{spec.name} moved: import {home}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(home)

    def exec_module(self, module: ModuleType) -> None:
        """The module at its new home is executed already."""

    def get_code(self, fullname: str) -> CodeType | None:
        """The new home's code (``python -m <old path>`` runs it, warned)."""
        warnings.warn(
            f"{fullname} moved: run python -m {MOVED[fullname]}", DeprecationWarning, stacklevel=2
        )
        home = importlib.util.find_spec(MOVED[fullname])
        if home is None or not isinstance(home.loader, importlib.abc.InspectLoader):
            return None
        return home.loader.get_code(home.name)

    def get_source(self, fullname: str) -> str | None:
        home = importlib.util.find_spec(MOVED[fullname])
        if home is None or not isinstance(home.loader, importlib.abc.InspectLoader):
            return None
        return home.loader.get_source(home.name)

    def is_package(self, fullname: str) -> bool:
        return False


_FINDER = _Moved()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
