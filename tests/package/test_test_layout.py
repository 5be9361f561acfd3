"""The tests' own layout holds: no test module imports another (what two share lives in
``support``, a folder's shared fixtures in its ``conftest.py``), and test module names are
unique across folders (pytest imports each by its bare name, its folder put on ``sys.path``).

Read from the sources (``ast``), so a bare-name import that happens to work because of the
order pytest collects in still fails here.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from support import TESTS


def _test_modules() -> list[Path]:
    return sorted(path for path in TESTS.rglob("test_*.py") if "node_modules" not in path.parts)


def _imported_roots(tree: ast.Module) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
    return roots


def test_no_test_module_imports_another() -> None:
    modules = _test_modules()
    names = {path.stem for path in modules}
    found = []
    for path in [*modules, *TESTS.rglob("conftest.py"), *(TESTS / "support").glob("*.py")]:
        shared = _imported_roots(ast.parse(path.read_text(encoding="utf-8"))) & names
        found += [f"{path.relative_to(TESTS)} imports {name}" for name in sorted(shared)]
    assert found == []


def test_test_module_names_are_unique_across_folders() -> None:
    counts = Counter(path.stem for path in _test_modules())
    assert [name for name, n in counts.items() if n > 1] == []


def test_the_layout_check_sees_a_bare_name_import() -> None:
    # The first check must not pass for want of reading: both forms of import are seen, and
    # the names it looks for are the test modules that exist.
    tree = ast.parse("from test_relay import block\nimport test_protocol as protocol\n")
    assert _imported_roots(tree) == {"test_relay", "test_protocol"}
    assert {"test_relay", "test_protocol"} <= {path.stem for path in _test_modules()}
