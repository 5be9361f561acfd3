"""One PEP 562 ``__getattr__`` for the packages that load names on first use.

``module_getattr(module, lazy, moved)`` builds a module's ``__getattr__``: a name in ``lazy``
(name → module to import it from) is imported on first use and cached in the module's
globals; a name in ``moved`` (name → its new home) still resolves, with a
``DeprecationWarning`` naming that home; anything else raises ``AttributeError``. Used by
``kernel_ext``, ``kernel_ext.relay`` and ``kernel_ext.protocol``; it imports nothing heavy.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["module_getattr"]


def module_getattr(
    module: str, lazy: Mapping[str, str], moved: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module`` (see the module docstring)."""
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        home = lazy.get(name)
        if home is not None:
            value = getattr(importlib.import_module(home), name)
            setattr(sys.modules[module], name, value)  # the next access is a plain attribute
            return value
        home = moved.get(name)
        if home is not None:
            warnings.warn(
                f"{module}.{name} moved: import it from {home}", DeprecationWarning, stacklevel=2
            )
            return getattr(importlib.import_module(home), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
