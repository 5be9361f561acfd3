"""How a benchmark script run on its own prints its figures (``benchmarks/run.py`` writes the
report; this is the quick look)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def print_figures(title: str, figures: Iterable[dict[str, Any]]) -> None:
    """Print ``title`` with the Python version, then each figure on one line: its verdict
    (``info`` when it has no target, else ``PASS`` or ``MISS``), name, value and unit, and
    its detail on the next line."""
    print(f"kernel_ext {title} — Python {sys.version.split()[0]}")
    for figure in figures:
        verdict = "info" if figure["ok"] is None else ("PASS" if figure["ok"] else "MISS")
        value = "" if figure["value"] is None else f"{figure['value']} {figure['unit']}"
        print(f"  {verdict:4}  {figure['name']}: {value}")
        print(f"        {figure['detail']}")
