"""The package's layout: a root one can read, and every package's map of its modules true.

* The root holds at most :data:`MAX_ROOT_MODULES` modules (the public face); the rest lives
  in sub-packages.
* ``import kernel_ext`` adds no import hook to ``sys.meta_path`` (no old paths kept alive).
* Each package's ``__init__`` docstring (the root's too) names every module of it (but
  ``__main__``), and every ``:mod:`` it names exists.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kernel_ext

PACKAGE = Path(kernel_ext.__file__).parent
MAX_ROOT_MODULES = 10


def packages() -> list[Path]:
    """The root and every package below it."""
    return sorted(init.parent for init in PACKAGE.rglob("__init__.py"))


def dotted(package: Path) -> str:
    return ".".join(package.relative_to(PACKAGE.parent).parts)


def modules_of(package: Path) -> list[str]:
    """The modules and sub-packages directly in ``package`` (but ``__init__``, ``__main__``)."""
    names = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    names += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(names)


def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text("utf-8"))) or ""


def names_module(doc: str, package: str, module: str) -> bool:
    """``doc`` names ``module`` of ``package``: by its dotted path, ``.module`` or
    ````module````."""
    name = re.escape(module)
    pattern = rf"{re.escape(package)}\.{name}\b|(?<![\w.])\.{name}\b|``{name}``"
    return re.search(pattern, doc) is not None


def mod_references(doc: str, package: str) -> list[str]:
    """The modules ``doc`` refers to with ``:mod:``, relative ones made absolute."""
    found = []
    for ref in re.findall(r":mod:`~?([\w.]+)`", doc):
        found.append(f"{package}{ref}" if ref.startswith(".") else ref)
    return found


def test_the_root_holds_at_most_ten_modules() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_importing_kernel_ext_adds_no_import_hook() -> None:
    code = (
        "import sys, json\n"
        "before = [repr(f) for f in sys.meta_path]\n"
        "import kernel_ext\n"
        "print(json.dumps([before, [repr(f) for f in sys.meta_path]]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    before, after = json.loads(done.stdout)
    assert after == before


@pytest.mark.parametrize("package", packages(), ids=dotted)
def test_a_package_docstring_names_each_of_its_modules(package: Path) -> None:
    doc = docstring(package)
    missing = [m for m in modules_of(package) if not names_module(doc, dotted(package), m)]
    assert missing == [], f"{dotted(package)}'s docstring does not name {missing}"


@pytest.mark.parametrize("package", packages(), ids=dotted)
def test_a_package_docstring_names_no_module_that_does_not_exist(package: Path) -> None:
    refs = mod_references(docstring(package), dotted(package))
    absent = [ref for ref in refs if importlib.util.find_spec(ref) is None]
    assert absent == []


def test_the_check_sees_a_module_missing_from_a_map_and_one_that_does_not_exist() -> None:
    doc = "Modules: :mod:`kernel_ext.worker.wiring`, :mod:`.auto`, ``_fork``, :mod:`.gone`."
    assert names_module(doc, "kernel_ext.worker", "wiring")
    assert names_module(doc, "kernel_ext.worker", "auto")
    assert names_module(doc, "kernel_ext.worker", "_fork")
    assert not names_module(doc, "kernel_ext.worker", "_shutdown")
    refs = mod_references(doc, "kernel_ext.worker")
    assert [r for r in refs if importlib.util.find_spec(r) is None] == ["kernel_ext.worker.gone"]
