"""One PEP 562 ``__getattr__`` for the packages that load names on first use.

``module_getattr(module, lazy)`` builds a module's ``__getattr__``: a name in ``lazy``
(name → module to import it from) is imported on first use and cached in the module's
globals; anything else raises ``AttributeError``. Used by ``kernel_ext``, ``kernel_ext.cli``
and ``kernel_ext.relay``; it imports nothing heavy.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["module_getattr"]


def module_getattr(module: str, lazy: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module`` (see the module docstring)."""

    def __getattr__(name: str) -> Any:
        home = lazy.get(name)
        if home is not None:
            value = getattr(importlib.import_module(home), name)
            setattr(sys.modules[module], name, value)  # the next access is a plain attribute
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
