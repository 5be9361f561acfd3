"""What tests/bench/ checks of every benchmark's figures."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

FIELDS = frozenset({"name", "value", "unit", "target", "ok", "detail"})
"""The keys every figure has (``benchmarks/run.py`` reads them)."""


def check_shape(figures: Iterable[dict[str, Any]]) -> None:
    """Each figure has :data:`FIELDS`; ``ok`` is ``None`` exactly when it has no target,
    a bool otherwise."""
    for figure in figures:
        assert set(figure) >= FIELDS, figure
        if figure["target"] is None:
            assert figure["ok"] is None, figure
        else:
            assert isinstance(figure["ok"], bool), figure
