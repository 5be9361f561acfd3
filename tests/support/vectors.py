"""The conformance vectors of tests/vectors (one JSON file per case, README.md there): where
they are, and reading one with its string macros expanded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support import TESTS

VECTORS = TESTS / "vectors"
VECTOR_FILES = sorted(VECTORS.glob("*.json"))


def expand(value: Any) -> Any:
    """Expand the vectors' string macros ($repeat, $concat) everywhere in ``value``."""
    if isinstance(value, list):
        return [expand(item) for item in value]
    if isinstance(value, dict):
        if set(value) == {"$repeat", "times"}:
            return str(value["$repeat"]) * int(value["times"])
        if set(value) == {"$concat"}:
            return "".join(expand(part) for part in value["$concat"])
        return {key: expand(item) for key, item in value.items()}
    return value


def load(path: Path) -> dict[str, Any]:
    """The vector in ``path``, its macros expanded."""
    data: dict[str, Any] = expand(json.loads(path.read_text(encoding="utf-8")))
    return data
