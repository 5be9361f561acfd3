"""No private name crosses a module of kernel_ext: an underscore name (a function, constant,
attribute or method) is used only in the module that defines it; what another module needs is
public in its owner. Private *modules* (``kernel_ext.worker._fork``, ``kernel_ext.relay._log``
…) are the package's own and may be imported; ``self``/``cls``/``super()`` access is the
class's own.

Read from the sources (``ast``): an import is judged by what it names; an attribute by its
name alone — private to us when some module of ours defines it (a ``def``, an assignment, a
``self.`` attribute, a ``__slots__`` entry; a ``Protocol`` only describes one) and the module
reading it does not; a private name no module of ours defines is another library's, read only
in ``kernel_ext._shared.compat`` but for the few listed, with their reasons, in ``FOREIGN``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kernel_ext

PACKAGE = Path(kernel_ext.__file__).parent
EXEMPT = {"kernel_ext._shared.compat"}
# Other libraries' private names read outside kernel_ext._shared.compat, each on purpose.
SDK_SPAN = "the OpenTelemetry SDK span's fields, read inline by the span processor where "
SDK_SPAN += (
    "kernel_ext._shared.compat.SDK_SPAN_FIELDS probed them (a helper call costs a span a sixth)"
)
FOREIGN = {
    ("kernel_ext.attribution.processor", "_attributes"): SDK_SPAN,
    ("kernel_ext.attribution.processor", "_dict"): SDK_SPAN,
    ("kernel_ext.attribution.processor", "_context"): SDK_SPAN,
    ("kernel_ext.attribution.processor", "_parent"): SDK_SPAN,
    ("kernel_ext.attribution.processor", "_start_time"): SDK_SPAN,
    ("kernel_ext.worker._shutdown", "_getframe"): "CPython's documented sys._getframe",
    ("kernel_ext.settings", "_replace"): "a named tuple's public _replace",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _declarations(tree: ast.Module) -> set[int]:
    """The nodes inside ``Protocol`` classes: they describe another module's members, they do
    not define them."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            getattr(base, "id", getattr(base, "attr", None)) == "Protocol" for base in node.bases
        ):
            inside.update(id(child) for child in ast.walk(node) if child is not node)
    return inside


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, module and class level
    assignments, ``self``/``cls`` attributes, ``__slots__`` entries."""
    names: set[str] = set()
    declarations = _declarations(tree)
    for node in ast.walk(tree):
        if id(node) in declarations:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries (and harmless other strings)
    return {name for name in names if _is_private(name)}


def _sources() -> dict[str, ast.Module]:
    return {
        _module_name(path): ast.parse(path.read_text(encoding="utf-8"), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def crossings(sources: dict[str, ast.Module]) -> list[str]:
    """Every use of a private name of one kernel_ext module in another (``module: what``)."""
    defined = {module: _defined(tree) for module, tree in sources.items()}
    anywhere = set().union(*defined.values())
    found: list[str] = []
    for module, tree in sources.items():
        if module in EXEMPT:
            continue
        package = module if _is_module(module + ".__init__") else module.rpartition(".")[0]
        mine = defined[module]
        modules: set[str] = set()  # local names bound to kernel_ext modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    source = ".".join([*base, source] if source else base)
                if not source.startswith("kernel_ext"):
                    continue
                for alias in node.names:
                    if _is_module(f"{source}.{alias.name}"):
                        modules.add(alias.asname or alias.name)
                    elif _is_private(alias.name):
                        found.append(f"{module}: imports {source}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("kernel_ext") and alias.asname:
                        modules.add(alias.asname)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            if isinstance(owner, ast.Name) and owner.id in modules:
                found.append(f"{module}:{node.lineno}: {owner.id}.{node.attr}")
            elif node.attr in mine or (module, node.attr) in FOREIGN:
                continue
            elif node.attr in anywhere:
                found.append(f"{module}:{node.lineno}: ….{node.attr}")
            else:
                found.append(f"{module}:{node.lineno}: another library's ….{node.attr}")
    return sorted(found)


def test_no_private_name_crosses_a_module_and_other_libraries_stay_in_compat() -> None:
    assert crossings(_sources()) == []


def test_the_check_finds_private_names_imported_or_reached_across_modules_or_libraries() -> None:
    sources = _sources()
    sources["kernel_ext.probe_a"] = ast.parse(
        "from kernel_ext.stream.hub import _result_text\n"
        "from kernel_ext.worker import _fork\n"
        "def f(hub, consumer):\n"
        "    _fork._after_fork_in_child()\n"
        "    return hub._fast_chars, consumer.hub, _fork.reset_in_child, sys._current_frames\n"
    )
    assert crossings(sources) == [
        "kernel_ext.probe_a: imports kernel_ext.stream.hub._result_text",
        "kernel_ext.probe_a:4: _fork._after_fork_in_child",
        "kernel_ext.probe_a:5: another library's …._current_frames",
        "kernel_ext.probe_a:5: …._fast_chars",
    ]


if __name__ == "__main__":
    print("\n".join(crossings(_sources())))
