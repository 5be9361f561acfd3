"""The ledger (kernel_ext.observability.count_names): every name kernel_ext counts under,
once; the senders and the relay count with its names, never with a literal of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kernel_ext
from kernel_ext.emit import base
from kernel_ext.integrations import ag_ui
from kernel_ext.observability import count_names
from kernel_ext.stream import block_counts

PACKAGE = Path(kernel_ext.__file__).parent
# The calls that count, and the position of the name they count under.
COUNTING = {
    "_count": 0,
    "_bump": 0,
    "count_frame": 0,
    "_reject": 1,
    "_release": 1,
    "dropped": 0,
    "record_dropped": 0,
}


def test_every_name_has_one_value_and_every_value_one_name() -> None:
    values = [getattr(count_names, name) for name in count_names.__all__]
    assert all(isinstance(value, str) and value for value in values)
    assert len(set(values)) == len(values)


@pytest.mark.parametrize("module", [block_counts, base, ag_ui], ids=lambda m: m.__name__)
def test_the_names_re_exported_elsewhere_are_the_ledgers_own(module: object) -> None:
    shared = [name for name in count_names.__all__ if hasattr(module, name)]
    assert shared
    for name in shared:
        assert getattr(module, name) is getattr(count_names, name), name


def literal_counts(source: str) -> list[str]:
    """Every count in ``source`` made with a string literal instead of a ledger name: a
    counting call, ``counts["…"]``, or an ``up_event``/``down_event`` given as a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = getattr(func, "attr", getattr(func, "id", None))
            at = COUNTING.get(name) if isinstance(name, str) else None
            if at is not None and len(node.args) > at:
                argument = node.args[at]
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    found.append(f"{node.lineno}: {name}({argument.value!r})")
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "counts":
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                found.append(f"{node.lineno}: counts[{key.value!r}]")
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if getattr(target, "id", None) in ("up_event", "down_event"):
                    found.append(f"{node.lineno}: {target.id} = {node.value.value!r}")  # type: ignore[attr-defined]
    return found


def test_the_senders_and_the_relay_count_only_with_the_ledgers_names() -> None:
    folders = [PACKAGE / "emit", PACKAGE / "relay", PACKAGE / "integrations", PACKAGE / "stream"]
    found = {
        str(path.relative_to(PACKAGE)): literal_counts(path.read_text(encoding="utf-8"))
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
    }
    assert {path: hits for path, hits in found.items() if hits} == {}


def test_the_check_finds_a_count_made_with_a_literal() -> None:
    source = (
        "class S:\n"
        "    up_event = 'connects'\n"
        "    def f(self, consumer, counts):\n"
        "        self._count('acks')\n"
        "        consumer.dropped('rejected', 1, None)\n"
        "        self._reject(sid, 'busy', 'x')\n"
        "        return counts['connects'], self._count(count_names.ACKS)\n"
    )
    assert literal_counts(source) == [
        "2: up_event = 'connects'",
        "4: _count('acks')",
        "5: dropped('rejected')",
        "6: _reject('busy')",
        "7: counts['connects']",
    ]
