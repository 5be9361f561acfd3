"""The package's layout: a root one can read, and every package's map of its modules true.

* The root holds at most :data:`MAX_ROOT_MODULES` modules (the public face); the rest lives
  in sub-packages.
* ``import kernel_ext`` adds no import hook to ``sys.meta_path`` (no old paths kept alive).
* Each package's ``__init__`` docstring (the root's too) names every module of it (but
  ``__main__``), and every ``:mod:`` it names exists.

Issue 34's "done means", each measured here: ``relay/namespace.py`` and every module of the
relay and of the Redis sub-package at most :data:`MAX_RELAY_MODULE_LINES` lines; everything
that speaks Redis (imports redis-py, or is named for it) in that one sub-package; the relay
never asks which manager it has (no ``isinstance(…, …Manager)``); nothing reaches back into
the server's ``namespace_handlers``; class docstrings at most
:data:`MAX_CLASS_DOCSTRING_LINES` lines; no profiler figure in a comment or docstring
(:data:`FIGURE`); Engine.IO's private parts read only in ``kernel_ext._shared.compat``.
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


# -- issue 34's "done means", each measured -------------------------------------------------

MAX_RELAY_MODULE_LINES = 450
MAX_CLASS_DOCSTRING_LINES = 20
COMPAT = PACKAGE / "_shared" / "compat.py"


def sources() -> dict[Path, str]:
    """Every module of kernel_ext, by path."""
    return {path: path.read_text("utf-8") for path in sorted(PACKAGE.rglob("*.py"))}


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def line_count(text: str) -> int:
    return len(text.splitlines())


def imports_redis(text: str) -> bool:
    """The module imports redis-py (``import redis…``, ``from redis… import``), anywhere."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import) and any(
            a.name == "redis" or a.name.startswith("redis.") for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if module == "redis" or module.startswith("redis."):
                return True
    return False


# Modules that import redis-py without speaking Redis, each with its reason.
REDIS_IMPORT_EXEMPT = {
    "kernel_ext/settings.py": "checks a Redis URL with redis-py's own parser; opens nothing",
}


def redis_home(found: dict[Path, str]) -> tuple[Path | None, list[str]]:
    """The one package where everything that speaks Redis lives (the package of most modules
    importing redis-py), and every module that speaks Redis outside it: one importing
    redis-py or named for Redis (``*redis*``)."""
    speaking = [
        path
        for path, text in found.items()
        if relative(path) not in REDIS_IMPORT_EXEMPT
        and (imports_redis(text) or "redis" in path.stem.lower())
    ]
    importing = [p.parent for p in speaking if imports_redis(found[p])]
    if not importing:
        return None, []
    home = max(set(importing), key=lambda p: (importing.count(p), "redis" in p.name, str(p)))
    if home == PACKAGE or home == PACKAGE / "relay":
        # the root or the relay itself is not a package of its own for Redis
        return None, sorted(relative(p) for p in speaking)
    return home, sorted(relative(p) for p in speaking if home not in (p.parent, *p.parents))


def test_everything_that_speaks_redis_lives_in_one_sub_package() -> None:
    home, outside = redis_home(sources())
    assert home is not None, f"no sub-package of its own holds the Redis code: {outside}"
    assert outside == [], f"Redis code outside {relative(home)}: {outside}"


def test_the_redis_check_finds_redis_code_outside_its_one_package() -> None:
    home = PACKAGE / "transport"
    together = {
        home / "manager.py": "import redis.asyncio\n",
        home / "emitter.py": "def f():\n    from redis import asyncio\n",
        home / "routing.py": "X = 1\n",
        PACKAGE / "settings.py": "from redis.connection import parse_url\n",
        PACKAGE / "stream" / "hub.py": "import json\n",
    }
    assert redis_home(together) == (home, [])
    apart = {
        **together,
        PACKAGE / "_redis_routing.py": "X = 1\n",
        PACKAGE / "demo" / "launcher.py": "from redis import asyncio as aioredis\n",
    }
    assert redis_home(apart) == (
        home,
        ["kernel_ext/_redis_routing.py", "kernel_ext/demo/launcher.py"],
    )
    in_the_relay = {PACKAGE / "relay" / "redis_manager.py": "import redis\n"}
    assert redis_home(in_the_relay) == (None, ["kernel_ext/relay/redis_manager.py"])


def test_the_namespace_is_at_most_450_lines() -> None:
    lines = line_count((PACKAGE / "relay" / "namespace.py").read_text("utf-8"))
    assert lines <= MAX_RELAY_MODULE_LINES, f"kernel_ext/relay/namespace.py: {lines} lines"


def test_no_module_of_the_relay_or_of_the_redis_package_is_over_450_lines() -> None:
    found = sources()
    home, _ = redis_home(found)
    homes = [PACKAGE / "relay"] + ([home] if home is not None else [])
    long = {
        relative(path): line_count(text)
        for path, text in found.items()
        if any(h in path.parents for h in homes) and line_count(text) > MAX_RELAY_MODULE_LINES
    }
    assert long == {}


def manager_type_branches(text: str, name: str) -> list[str]:
    """Every ``isinstance(x, C)`` in ``text`` where ``C`` (or one in a tuple) is named
    ``…Manager``: the code asks which manager it has."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"):
            continue
        if len(node.args) != 2:
            continue
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        for kind in kinds:
            kind_name = getattr(kind, "id", None) or getattr(kind, "attr", "")
            if kind_name.endswith("Manager"):
                found.append(f"{name}:{node.lineno}: isinstance(…, {kind_name})")
    return found


def test_the_relay_never_asks_which_manager_it_has() -> None:
    found = []
    for path, text in sources().items():
        if PACKAGE / "relay" in path.parents or path == PACKAGE / "cli" / "relay.py":
            found += manager_type_branches(text, relative(path))
    assert found == []


def test_nothing_reaches_back_into_the_servers_namespace_handlers() -> None:
    """python-socketio's registry of namespace handlers is read in compat alone (its
    ``namespace_handler``: whether a relay is still its server's), and nothing of the Redis
    package reaches the relay's namespace through it or by import: the manager is given
    what it needs."""
    found = [
        f"{relative(path)}:{number}"
        for path, text in sources().items()
        if path != COMPAT
        for number, line in enumerate(text.splitlines(), 1)
        if "namespace_handlers" in line
        or (
            PACKAGE / "redis" in path.parents
            and ("namespace_handler" in line or "relay.namespace" in line)
        )
    ]
    assert found == []


def long_class_docstrings(text: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            doc = ast.get_docstring(node)
            if doc and line_count(doc.strip()) > MAX_CLASS_DOCSTRING_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {line_count(doc.strip())} lines")
    return found


def test_every_class_docstring_is_at_most_20_lines() -> None:
    found = [f for path, text in sources().items() for f in long_class_docstrings(text, str(path))]
    assert found == []


# A figure measured by a profiler: a time per operation (5 µs, 0.3 us, 120 ns, 2.5 ms) or
# an instruction count, or the profiler named. Names of settings and timeouts (``timeout_ms``,
# ``ack_timeout``) are identifiers, not a number followed by a unit, so they do not match;
# seconds (``5 s``) are durations users set, not profiles.
FIGURE = re.compile(
    r"\d[\d,.]*\s*(?:µs|μs|us|ns|ms)\b|\b(?:micro|nano|milli)seconds? (?:per|each|a|an)\b"
    r"|machine instructions|\bcallgrind\b|\bcProfile\b|\bpyinstrument\b|\bprofil(?:e|ed|er|ing)\b",
    re.IGNORECASE,
)


def prose_of(text: str) -> list[tuple[int, str]]:
    """The comments and docstrings (every string statement) of a module, with their lines."""
    import io
    import tokenize

    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.append((node.lineno, node.value.value))
    return found


def figures_in(text: str, name: str) -> list[str]:
    return [
        f"{name}:{number}: {match.group(0)!r}"
        for number, prose in prose_of(text)
        for match in FIGURE.finditer(prose)
    ]


def test_no_profiler_figure_is_quoted_in_code() -> None:
    found = [f for path, text in sources().items() for f in figures_in(text, relative(path))]
    assert found == []


def test_the_figure_check_finds_profiles_and_leaves_settings_and_wire_words_alone() -> None:
    quoted = (
        '"""One ``Counter.add`` costs about 5 µs."""\n'
        "x = 1  # a NamedTuple costs ~0.3 us to build\n"
        "def f():\n"
        '    """540 machine instructions per block (callgrind)."""\n'
        "y = 2  # 120ns per call; 2.5 ms a frame\n"
    )
    assert len(figures_in(quoted, "m")) == 6
    plain = (
        '"""Waits ``ack_timeout`` seconds (default 5 s); ``timeout_ms`` is epoch milliseconds."""\n'
        "ts_ms = 3  # a timestamp in ms since the epoch\n"
        "def profile_path(): ...\n"
    )
    assert figures_in(plain, "m") == []


# Engine.IO's and python-socketio's private parts, read only in kernel_ext._shared.compat:
# a server's ``sockets`` (and through it a connection's ``queue``), ``send_packet`` but
# compat's own, ``create_queue``, ``_trigger_event``, the ``packet`` modules.
ENGINE_ATTRIBUTES = {"sockets", "create_queue", "_trigger_event", "_send_packet", "send_packet"}
ENGINE_MODULES = {"engineio.packet", "socketio.packet", "engineio.async_socket", "engineio.socket"}
COMPAT_NAMES = {"compat", "_compat"}


def engine_private_uses(text: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if node.attr in ENGINE_ATTRIBUTES and getattr(owner, "id", None) not in COMPAT_NAMES:
                found.append(f"{name}:{node.lineno}: .{node.attr}")
            if node.attr == "packet" and getattr(owner, "id", None) in ("socketio", "engineio"):
                found.append(f"{name}:{node.lineno}: {getattr(owner, 'id', '')}.packet")
        elif isinstance(node, ast.ImportFrom) and node.module in ENGINE_MODULES:
            found.append(f"{name}:{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import):
            found += [
                f"{name}:{node.lineno}: import {a.name}"
                for a in node.names
                if a.name in ENGINE_MODULES
            ]
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_engineio_private_names_are_read_only_in_compat() -> None:
    found = [
        f
        for path, text in sources().items()
        if path != COMPAT
        for f in engine_private_uses(text, relative(path))
    ]
    assert found == []


def test_the_engineio_check_finds_each_kind_of_use_and_spares_compats_own() -> None:
    code = (
        "import socketio\n"
        "from engineio.packet import Packet\n"
        "def f(eio, sid, p):\n"
        "    eio.sockets[sid].queue.qsize()\n"
        "    eio.send_packet(p)\n"
        "    socketio.packet.Packet\n"
        "    return _compat.send_packet(eio, sid, p), _compat.queued(eio, sid)\n"
    )
    assert engine_private_uses(code, "m") == [
        "m:2: from engineio.packet",
        "m:4: .sockets",
        "m:5: .send_packet",
        "m:6: socketio.packet",
    ]
