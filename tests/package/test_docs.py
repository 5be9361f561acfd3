"""The docs cannot drift from the code: their examples run, their names exist, their pages
are all in the site.

* Every fenced block of ``docs/*.md`` and the README names its language. A ``python`` block
  is one of two kinds, and its fence says which, where the reader sees it too:

  - a **fragment** is titled ``python title="Fragment — not runnable on its own: <why>"``
    (the site shows the title above the block). It is not run; it parses, every name it
    reads is a builtin or imported or defined in it, and every import in it imports here.
  - anything else is **runnable**: a script of its own (a subprocess with the repository
    root as working directory, no ``KERNEL_EXT_*`` variables inherited) that exits 0.

  A ``<!-- needs: <what> -->`` line right before the fence names what a block needs: a
  module (skipped where it cannot be installed, e.g. pydantic-ai on Python 3.10; never in
  CI on 3.11+), or ``redis-server`` (a real one is started and its URL given as
  ``KERNEL_EXT_REDIS_URL``).
* A fenced ``text title="Output"`` block right after a runnable block is exactly what that
  script writes in a terminal: its standard output and its standard error (a warning it
  logs, say), in the order written. Only ``<sid>`` there stands for something else: a
  Socket.IO session id, new at each run.
* Every ``kernel-ext …`` command in ``sh`` blocks parses with the real command-line parser.
* The environment variables in the Operations page's configuration table are exactly the
  ones the code reads (``kernel_ext.settings.Settings`` and direct reads); every
  ``KERNEL_EXT_*`` name on any page exists in the code.
* The metrics, span attributes and drop reasons the Operations page lists are exactly the
  code's.
* Every page is in the ``mkdocs.yml`` nav and every nav entry is a page.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import inspect
import itertools
import os
import re
import shlex
import subprocess
import symtable
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from html import unescape
from pathlib import Path
from typing import Literal

import pytest
from support import ROOT
from support.network import IN_CI, RedisServer, need_binary

DOCS = ROOT / "docs"
PACKAGE = ROOT / "kernel_ext"
PAGES = sorted(DOCS.glob("*.md"))
README = ROOT / "README.md"
EXAMPLE_TIMEOUT = 60.0
PARALLEL = 4

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<lang>[\w+-]*)(?P<info>.*)$")
_DIRECTIVE = re.compile(r"^<!--\s*(?P<name>[\w-]+)\s*:\s*(?P<value>.*?)\s*-->$")
_TITLE = re.compile(r'\btitle="(?P<title>[^"]*)"')
FRAGMENT_TITLE = "Fragment — not runnable on its own: "
"""How a python block's title starts when the block is a fragment; what follows says why."""
_ENV_NAME = re.compile(r"KERNEL_EXT_[A-Z0-9_]+")


@dataclass
class CodeBlock:
    """One fenced block of a page."""

    page: str
    line: int
    lang: str
    info: str
    text: str
    end: int
    """The line number of the closing fence."""
    directives: dict[str, str] = field(default_factory=dict)
    output: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def title(self) -> str | None:
        """The fence's ``title="…"``, which the site shows above the block."""
        found = _TITLE.search(self.info)
        return found["title"] if found else None

    @property
    def kind(self) -> Literal["runnable", "fragment", "other"]:
        """What the block is: the one rule the tests and the page's reader both go by."""
        if self.lang != "python":
            return "other"
        return "fragment" if (self.title or "").startswith(FRAGMENT_TITLE) else "runnable"


def code_blocks(page: Path) -> list[CodeBlock]:
    """The fenced blocks of ``page`` in order, with their directives and expected output."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[CodeBlock] = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        indent, fence = match["indent"], match["fence"]
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].strip() != fence:
            line = lines[index]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            index += 1
        directives: dict[str, str] = {}
        before = start - 1
        while before >= 0 and (found := _DIRECTIVE.match(lines[before].strip())):
            directives[found["name"]] = found["value"]
            before -= 1
        blocks.append(
            CodeBlock(
                page.name,
                start + 1,
                match["lang"],
                match["info"].strip(),
                "\n".join(body) + "\n",
                index + 1,
                directives,
            )
        )
        index += 1
    # An Output block right after a python block (blank lines between at most).
    for previous, block in itertools.pairwise(blocks):
        if (
            previous.lang == "python"
            and block.lang == "text"
            and 'title="Output"' in block.info
            and all(not line.strip() for line in lines[previous.end : block.line - 1])
        ):
            previous.output = block.text
    return blocks


ALL_BLOCKS = [block for page in [*PAGES, README] for block in code_blocks(page)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.lang == "python"]
RUNNABLE = [block for block in PYTHON_BLOCKS if block.kind == "runnable"]
FRAGMENTS = [block for block in PYTHON_BLOCKS if block.kind == "fragment"]


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_EXT_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _run(
    block: CodeBlock, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """Run ``block`` as a script of its own; its ``stdout`` is all it wrote, standard error
    included, interleaved as a terminal shows them (one pipe for both, unbuffered)."""
    with tempfile.TemporaryDirectory(prefix="kx-docs-") as tmp:
        script = Path(tmp) / f"{Path(block.page).stem.replace('-', '_')}_{block.line}.py"
        script.write_text(block.text, encoding="utf-8")
        return subprocess.run(
            [sys.executable, str(script)],
            cwd=cwd,
            env=_clean_env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=EXAMPLE_TIMEOUT,
        )


OUTPUT_PLACEHOLDERS = {"<sid>": r"[A-Za-z0-9_-]+"}
"""What stands in an Output block for a value new at each run, and what it matches."""


def output_matches(printed: str, documented: str) -> bool:
    """Whether a script that wrote ``printed`` wrote what an Output block ``documented``
    says: line by line, trailing blanks aside, each placeholder matching its pattern."""
    got = [line.rstrip() for line in printed.rstrip("\n").splitlines()]
    want = [line.rstrip() for line in documented.rstrip("\n").splitlines()]
    if len(got) != len(want):
        return False
    split = "(" + "|".join(map(re.escape, OUTPUT_PLACEHOLDERS)) + ")"
    for line, documented_line in zip(got, want, strict=True):
        pattern = "".join(
            OUTPUT_PLACEHOLDERS.get(part) or re.escape(part)
            for part in re.split(split, documented_line)
        )
        if not re.fullmatch(pattern, line):
            return False
    return True


class _Runner:
    """Starts every example that needs nothing special at once, a few at a time, so the
    whole set costs about as much as its slowest members."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}

    def result(self, block: CodeBlock) -> subprocess.CompletedProcess[str]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="docs-example")
                for each in RUNNABLE:
                    if "needs" not in each.directives:
                        self._futures[each.id] = self._pool.submit(_run, each)
            future = self._futures[block.id]
        return future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runner() -> Iterator[_Runner]:
    each = _Runner()
    yield each
    each.close()


@contextlib.contextmanager
def _needs(block: CodeBlock) -> Iterator[dict[str, str]]:
    """Provide what ``<!-- needs: … -->`` names; yields extra environment variables."""
    env: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for need in (n.strip() for n in block.directives.get("needs", "").split(",")):
            if not need:
                continue
            if need == "redis-server":
                server = RedisServer(need_binary("redis-server", "REDIS_SERVER"))
                server.start()
                stack.callback(server.stop)
                env["KERNEL_EXT_REDIS_URL"] = server.url
            elif importlib.util.find_spec(need) is None:
                if IN_CI and sys.version_info >= (3, 11):
                    pytest.fail(f"{need} is required in CI on Python 3.11+")
                pytest.skip(f"{need} is not installed here")
        yield env


def _describe(block: CodeBlock, done: subprocess.CompletedProcess[str]) -> str:
    return (
        f"{block.id} exited with {done.returncode}\n--- what it wrote (stdout and stderr)\n"
        f"{done.stdout[-8000:]}"
    )


def _example(block: CodeBlock) -> object:
    """``block`` as a parameter, marked ``redis`` when it needs a redis-server."""
    needs = {n.strip() for n in block.directives.get("needs", "").split(",")}
    marks = [pytest.mark.redis] if "redis-server" in needs else []
    return pytest.param(block, marks=marks, id=block.id)


@pytest.mark.network
@pytest.mark.parametrize("block", [_example(b) for b in RUNNABLE])
def test_every_python_example_runs_and_prints_its_output(block: CodeBlock, runner: _Runner) -> None:
    if "needs" in block.directives:
        with _needs(block) as env:
            done = _run(block, env)
    else:
        done = runner.result(block)
    assert done.returncode == 0, _describe(block, done)
    if block.output is not None:
        assert output_matches(done.stdout, block.output), (
            f"{block.id}: the Output block differs\n--- documented\n{block.output}"
            f"{_describe(block, done)}"
        )


def test_an_output_block_holds_what_the_script_writes_on_stderr_too() -> None:
    # integrators.md's examples that enable() without a sender also log a warning: the
    # reader sees it, so their Output blocks show it (stderr was not compared).
    script = CodeBlock(
        "example.md",
        1,
        "python",
        "",
        "import logging, sys\nprint('out')\nlogging.getLogger('kx').warning('logged')\n"
        "print('err', file=sys.stderr)\nprint('out again')\n",
        7,
    )
    done = _run(script)
    assert done.returncode == 0, _describe(script, done)
    assert output_matches(done.stdout, "out\nlogged\nerr\nout again\n")
    assert not output_matches(done.stdout, "out\nout again\n")


def test_an_output_placeholder_stands_for_its_value_only() -> None:
    documented = "dropped browser event 'x' from <sid> (unknown_event)\n"
    assert output_matches(
        "dropped browser event 'x' from QLpucEaS3yo3T8aFAAAB (unknown_event)", documented
    )
    assert not output_matches("dropped browser event 'x' from  (unknown_event)", documented)
    assert not output_matches("dropped browser event 'x' from a b (unknown_event)", documented)
    assert not output_matches("dropped browser event 'x' from s1 (unknown_event)\nmore", documented)
    # Anything else is compared as written, regular expression characters included.
    assert output_matches("a.b [c]", "a.b [c]")
    assert not output_matches("axb [c]", "a.b [c]")


def test_the_vectors_example_fails_loudly_outside_a_checkout(tmp_path: Path) -> None:
    # Run elsewhere it found no vector and printed "False vectors pass", exit status 0.
    (block,) = [b for b in RUNNABLE if b.page == "web.md" and '"tests/vectors"' in b.text]
    done = _run(block, cwd=tmp_path)
    assert done.returncode == 1, _describe(block, done)
    assert done.stdout.startswith(f"no conformance vectors in {tmp_path.resolve()}/tests/vectors")
    assert "checkout" in done.stdout
    assert "pass" not in done.stdout


def test_examples_that_do_not_run_say_why() -> None:
    for block in FRAGMENTS:
        reason = (block.title or "").removeprefix(FRAGMENT_TITLE)
        assert len(reason) >= 10, f"{block.id}: give the reason after {FRAGMENT_TITLE!r}"
        assert block.output is None, f"{block.id}: an Output block nobody checks"
    assert len(RUNNABLE) >= 10  # the parser found the examples
    assert len(FRAGMENTS) >= 5


def test_directives_name_known_needs() -> None:
    for block in ALL_BLOCKS:
        if block.directives and block.lang != "python":
            pytest.fail(f"{block.id}: directives only apply to python blocks")
        # `not-run` was an HTML comment the site's reader never saw: fragments are titled.
        assert set(block.directives) <= {"needs"}, (
            f"{block.id}: unknown directive {sorted(block.directives)}; a block that is not "
            f'run is a fragment: python title="{FRAGMENT_TITLE}<why>"'
        )
        for need in block.directives.get("needs", "").split(","):
            need = need.strip()
            assert not need or need == "redis-server" or need.isidentifier(), block.id


# -- fragments -------------------------------------------------------------------------------


def test_every_block_names_its_language() -> None:
    # A block without a language escapes every check: a python one is neither run nor
    # checked as a fragment, a kernel-ext command line is never parsed.
    unnamed = [block.id for block in ALL_BLOCKS if not block.lang]
    assert unnamed == [], "name the language (python, sh, text, …) of these blocks"


def test_only_python_blocks_are_fragments_and_each_says_so_exactly() -> None:
    # "fragment" in any other form (another case, another wording, another language) would
    # be a block the reader takes for a fragment while the tests run it, or the reverse.
    for block in ALL_BLOCKS:
        if "fragment" in (block.title or "").lower():
            assert block.kind == "fragment", (
                f"{block.id}: a fragment is a python block titled {FRAGMENT_TITLE!r} + why"
            )


def test_the_site_shows_each_fragment_as_one_above_its_block() -> None:
    # The page as the site renders it (the site's Markdown extensions): every fragment's
    # title is the caption of its code block, and no other caption says "Fragment".
    import markdown  # pymdown-extensions' dependency, in the test extra

    extensions = _site_markdown_extensions()
    assert {"pymdownx.highlight", "pymdownx.superfences"} <= set(extensions)
    for page in PAGES:
        html = markdown.markdown(page.read_text(encoding="utf-8"), extensions=extensions)
        captions = [
            unescape(caption)
            for caption in re.findall(r'<span class="filename">([^<]*)</span>', html)
            if unescape(caption).startswith(FRAGMENT_TITLE)
        ]
        titles = [block.title for block in FRAGMENTS if block.page == page.name]
        assert captions == titles, f"{page.name}: fragments not captioned as such on the site"
    # GitHub shows the README without code block titles: no fragment there.
    assert [block.id for block in FRAGMENTS if block.page == README.name] == []


class _DependencyMissing(Exception):
    """A module exists but needs a dependency that is not installed here."""


_BUILTINS = set(dir(builtins))


def _names_read(table: symtable.SymbolTable) -> Iterator[tuple[str, bool]]:
    """(name, whether it is looked up among the module's names) for every name read in
    ``table`` and the scopes in it."""
    for symbol in table.get_symbols():
        if symbol.is_referenced():
            if table.get_type() == "module":
                unbound = not (symbol.is_assigned() or symbol.is_imported())
                yield symbol.get_name(), unbound
            else:
                yield symbol.get_name(), symbol.is_global()
    for child in table.get_children():
        yield from _names_read(child)


def _undefined_names(tree: ast.Module) -> list[str]:
    """The names ``tree`` reads as globals that it neither imports nor defines and that
    are not builtins, in order of first use; annotations count as read (without
    ``from __future__ import annotations``, which would hide them)."""
    evaluated = ast.Module(
        [
            node
            for node in tree.body
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        ],
        type_ignores=[],
    )
    table = symtable.symtable(ast.unparse(evaluated), "<fragment>", "exec")
    module = {
        symbol.get_name()
        for symbol in table.get_symbols()
        if symbol.is_assigned() or symbol.is_imported()
    }
    undefined: list[str] = []
    for name, global_read in _names_read(table):
        if global_read and name not in module and name not in _BUILTINS and name not in undefined:
            undefined.append(name)
    return undefined


def _import_faults(tree: ast.Module) -> list[str]:
    """Why each import of ``tree`` does not import here (nothing when they all do)."""
    faults = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                try:
                    importlib.import_module(alias.name)
                except ImportError as exc:
                    faults.append(f"import {alias.name}: {exc}")
        elif isinstance(node, ast.ImportFrom):
            if node.level or node.module is None:
                faults.append(f"line {node.lineno}: a relative import")
                continue
            for alias in node.names:
                if alias.name == "*":
                    faults.append(f"from {node.module} import *: import the names it uses")
                    continue
                try:
                    resolved = _resolve(f"{node.module}.{alias.name}")
                except _DependencyMissing as exc:
                    resolved = str(exc)
                if resolved is not None:
                    faults.append(f"from {node.module} import {alias.name}: {resolved}")
    return faults


def fragment_faults(source: str) -> list[str]:
    """What keeps ``source`` from being a fragment a reader can build on: a syntax error, a
    name it reads without importing or defining it, an import that does not import."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [f"does not parse: {exc.msg} (line {exc.lineno})"]
    faults = [f"{name} is neither imported nor defined" for name in _undefined_names(tree)]
    return faults + _import_faults(tree)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in FRAGMENTS])
def test_every_fragment_parses_imports_what_it_uses_and_its_imports_exist(
    block: CodeBlock,
) -> None:
    with _needs(block):
        assert fragment_faults(block.text) == [], block.id


def _shown_parameters(function: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """(name, kind, default) of each parameter of a ``def`` as written (default: a literal,
    or ``inspect.Parameter.empty``)."""
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults = [inspect.Parameter.empty] * (len(positional) - len(arguments.defaults))
    defaults += [ast.literal_eval(node) for node in arguments.defaults]
    shown = [
        (each.arg, "POSITIONAL_ONLY" if each in arguments.posonlyargs else "POSITIONAL_OR_KEYWORD")
        for each in positional
    ]
    found = [(name, kind, default) for (name, kind), default in zip(shown, defaults, strict=True)]
    if arguments.vararg:
        found.append((arguments.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    for each, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True):
        value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        found.append((each.arg, "KEYWORD_ONLY", value))
    if arguments.kwarg:
        found.append((arguments.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return found


def test_a_fragment_that_shows_a_function_of_the_package_shows_its_parameters() -> None:
    # A fragment titled "… the signature of kernel_ext.publish" holds a `def publish(…)`:
    # its parameters are the function's, in order, kind and default.
    checked = 0
    for block in FRAGMENTS:
        for dotted in _DOTTED.findall(block.title or ""):
            module, name = dotted.rsplit(".", 1)
            shown = [
                node
                for node in ast.parse(block.text).body
                if isinstance(node, ast.FunctionDef) and node.name == name
            ]
            if not shown:
                continue
            real = inspect.signature(getattr(importlib.import_module(module), name))
            want = [(p.name, p.kind.name, p.default) for p in real.parameters.values()]
            assert _shown_parameters(shown[0]) == want, f"{block.id}: not {dotted}'s parameters"
            checked += 1
    assert checked >= 2


def test_a_fragment_with_an_undefined_name_a_syntax_error_or_a_bad_import_is_caught() -> None:
    # The first example of the integrators page as it was: `your_describe_hook` came from
    # nowhere; and the chat_event example: `...` inside a dict display.
    assert fragment_faults(
        "import kernel_ext\n\nkernel_ext.enable(describe=your_describe_hook)\n"
    ) == ["your_describe_hook is neither imported nor defined"]
    assert fragment_faults('publish_chat_event({"eventId": call_id, ...})\n')[0].startswith(
        "does not parse"
    )
    # A name read in a function or a class body is looked up among the module's too.
    assert fragment_faults("def f():\n    return call_id\n") == [
        "call_id is neither imported nor defined"
    ]
    assert fragment_faults("class C:\n    x = [y for _ in ()]\n") == [
        "y is neither imported nor defined"
    ]
    # An annotation is a name used, postponed or not.
    assert fragment_faults(
        "from __future__ import annotations\n\n\ndef describe(a) -> ToolDescription: ...\n"
    ) == ["ToolDescription is neither imported nor defined"]
    # Bound anywhere in the fragment is bound: parameters, closures, loops, with, except.
    assert (
        fragment_faults(
            "import asyncio\n\n\ndef outer(a):\n    b = a\n    def inner():\n        return b\n"
            "    for c in (a,):\n        pass\n    try:\n        pass\n    except Exception as e:\n"
            "        print(e, c)\n    return inner, asyncio\n"
        )
        == []
    )
    # Imports import, here and for real: a name the package does not have, a module that
    # does not exist, a relative import, a star import.
    assert fragment_faults("from kernel_ext import no_such_name\n") == [
        "from kernel_ext import no_such_name: kernel_ext has no no_such_name"
    ]
    assert fragment_faults("import kernel_ext.no_such_module\n")[0].startswith(
        "import kernel_ext.no_such_module:"
    )
    assert fragment_faults("from . import x\n") == ["line 1: a relative import"]
    assert fragment_faults("from kernel_ext import *\n") == [
        "from kernel_ext import *: import the names it uses"
    ]


def _cli_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for block in ALL_BLOCKS:
        if block.lang not in ("sh", "bash", "console", "shell"):
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if "kernel-ext" not in line:
                continue  # another command (its quoting may hold the separators below)
            for part in re.split(r"&&|;|\|", line):
                words = shlex.split(part, comments=True)
                if words and words[0] == "kernel-ext":
                    args = []
                    for word in words[1:]:
                        if word.startswith(">"):
                            break
                        args.append(word)
                    commands.append((block.id, args))
    return commands


def test_every_documented_command_line_parses() -> None:
    from kernel_ext.cli.entry import build_parser

    commands = _cli_commands()
    assert commands, "no kernel-ext command found in the docs"
    for where, args in commands:
        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{where}: `kernel-ext {' '.join(args)}` does not parse")


# -- the README ------------------------------------------------------------------------------


def test_the_readme_sets_up_with_exactly_its_two_commands() -> None:
    commands = [block.text.strip() for block in code_blocks(README) if block.lang == "sh"]
    assert commands == ["pip install '.[demo]' && kernel-ext demo", "pip install tox && tox"]


def test_every_pointer_of_the_readme_names_a_file_of_the_repository() -> None:
    # "The original spec … live with the project's shared documents" named nothing a
    # reader of the repository has.
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Where to read on\n(.*?)(?=^## )", text, re.S | re.M)
    assert section is not None
    entries = re.findall(r"^- (.*(?:\n  .*)*)", section.group(1), re.M)
    assert len(entries) >= 3
    for entry in entries:
        named = re.match(r"`([^`]+)` — ", entry)
        assert named is not None, f"a pointer that names no file of the repository: {entry!r}"
        assert (ROOT / named.group(1)).exists(), named.group(1)


# -- extras ----------------------------------------------------------------------------------


def pyproject_extras() -> list[str]:
    """The extras of pyproject.toml's ``[project.optional-dependencies]``, in order (read
    without a TOML parser: Python 3.10 has none)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    table = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text, re.S | re.M)
    assert table is not None, "pyproject.toml has no [project.optional-dependencies]"
    return re.findall(r"^([A-Za-z0-9][A-Za-z0-9_.-]*) = \[", table.group(1), re.M)


def _pip_installs() -> list[tuple[str, str, list[str]]]:
    """(block id, what is installed, its extras) of every ``pip install`` in a shell block."""
    found = []
    for block in ALL_BLOCKS:
        if block.lang not in ("sh", "bash", "console", "shell"):
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            if "pip install" not in line:
                continue  # another command (its quoting may hold the separators below)
            for part in re.split(r"&&|;|\|", line.strip().removeprefix("$ ")):
                words = shlex.split(part, comments=True)
                if words[:2] != ["pip", "install"]:
                    continue
                for word in words[2:]:
                    if not word.startswith("-"):
                        name, _, extras = word.partition("[")
                        found.append((block.id, name, extras.rstrip("]").split(",")))
    return found


def test_the_extras_table_lists_every_extra_of_pyproject() -> None:
    # `agui` was missing from the integrators' table.
    text = (DOCS / "integrators.md").read_text(encoding="utf-8")
    table = text[text.index("| extra | for |") :].split("\n\n", 1)[0].splitlines()[2:]
    documented = [re.match(r"^\| `([^`]+)` \|", row) for row in table]
    assert all(documented), table
    extras = pyproject_extras()
    assert len(extras) >= 10, "the parser found the extras"
    assert sorted(m.group(1) for m in documented if m) == sorted(extras)


def test_every_pip_install_names_extras_that_exist_from_a_checkout_and_by_name() -> None:
    installs = _pip_installs()
    extras = set(pyproject_extras())
    for where, name, wanted in installs:
        if name in (".", "kernel-ext"):
            assert set(wanted) <= extras, f"{where}: pip install {name}[{','.join(wanted)}]"
    # Installing an extra is shown both ways: from a checkout and by the package's name.
    pages = {where.split(":")[0] for where, name, wanted in installs if name == "."}
    named = {where.split(":")[0] for where, name, wanted in installs if name == "kernel-ext"}
    assert "integrators.md" in pages & named


# -- environment variables ---------------------------------------------------------------


def _module_constants(tree: ast.Module) -> dict[str, str]:
    constants = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value
    return constants


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def environment_variables_read() -> set[str]:
    """Every environment variable name the package reads: the variable of every field of
    ``kernel_ext.settings.Settings`` (how ``enable()``, the entry point and the instrumentor
    read theirs), literal or constant arguments of ``os.environ.get`` / ``os.environ[...]``
    / ``os.getenv``, and every module constant named like ours (helpers that take the name
    as a parameter are fed those)."""
    from kernel_ext.settings import Settings, env_name

    names = {env_name(field) for field in Settings.model_fields}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = _module_constants(tree)
        names.update(v for v in constants.values() if _ENV_NAME.fullmatch(v))

        def value_of(node: ast.AST, constants: dict[str, str] = constants) -> str | None:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.Name):
                return constants.get(node.id)
            return None

        for node in ast.walk(tree):
            key: ast.AST | None = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                if isinstance(func, ast.Attribute) and (
                    (func.attr == "get" and _is_environ(func.value))
                    or (
                        func.attr == "getenv"
                        and isinstance(func.value, ast.Name)
                        and func.value.id == "os"
                    )
                ):
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and _is_environ(node.value):
                key = node.slice
            if key is not None:
                name = value_of(key)
                if name is not None:
                    names.add(name)
    return names


def _table_first_column(page: str, heading: str) -> list[str]:
    """The first-column code spans of the tables under ``## heading`` of ``page``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section is not None, f"{page} has no section '## {heading}'"
    found = []
    lines = section.group(1).splitlines()
    for line, following in zip(lines, [*lines[1:], ""], strict=True):
        match = re.match(r"^\| (`[^|]+`) \|", line)
        if match and not following.startswith("|---"):  # not a header row
            found.extend(re.findall(r"`([^`]+)`", match.group(1)))
    return found


def test_configuration_table_lists_exactly_the_variables_the_code_reads() -> None:
    documented = set(_table_first_column("operations.md", "Configuration"))
    read = environment_variables_read()
    assert read, "found no environment variable in the code"
    assert documented == read, (
        f"undocumented: {sorted(read - documented)}; documented but not read: "
        f"{sorted(documented - read)}"
    )


def test_every_variable_named_in_the_docs_exists() -> None:
    read = environment_variables_read()
    # The benchmarks and the test suite have knobs of their own (performance and
    # reliability pages name them).
    knobs = {
        name
        for folder in (ROOT / "benchmarks", ROOT / "tests")
        for path in folder.rglob("*.py")
        if path.name != "test_docs.py"
        for name in _ENV_NAME.findall(path.read_text(encoding="utf-8"))
    }
    for page in PAGES:
        for name in set(_ENV_NAME.findall(page.read_text(encoding="utf-8"))):
            assert name in read or name in knobs, f"{page.name} names {name}, which nothing reads"


# -- telemetry names -----------------------------------------------------------------------


def test_documented_metrics_are_the_instruments() -> None:
    source = (PACKAGE / "observability" / "otel_metrics.py").read_text(encoding="utf-8")
    instruments = set(re.findall(r'create_counter\(\s*"([^"]+)"', source))
    documented = {
        name
        for name in _table_first_column("operations.md", "OpenTelemetry export")
        if name.startswith("kernel_ext.") and "stream" not in name and "call_id" not in name
    }
    assert instruments
    assert documented == instruments


def test_documented_span_attributes_are_the_hubs() -> None:
    from kernel_ext import stream

    attributes = {getattr(stream, n) for n in dir(stream) if n.startswith("ATTR_")}
    documented = {
        name
        for name in _table_first_column("operations.md", "OpenTelemetry export")
        if name.startswith(("kernel_ext.stream.", "kernel_ext.call_id."))
    }
    assert documented == attributes


def _reasons_in_code() -> set[str]:
    """Drop reasons: the constants under the "# Drop reasons" comments of the stream hub and
    the senders, and the literal reasons counted elsewhere."""
    reasons: set[str] = set()
    blocks = 0
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for block in re.finditer(r"^# Drop reasons.*?\n(.*?)(?:^\s*$|^#)", text, re.S | re.M):
            blocks += 1
            reasons.update(re.findall(r'^[A-Z_]+ = "([a-z_]+)"', block.group(1), re.M))
        reasons.update(re.findall(r'"reason": "([a-z_]+)"', text))
    assert blocks >= 2, "the '# Drop reasons' blocks of the stream layer and the senders moved"
    return reasons


def test_documented_drop_reasons_are_the_codes() -> None:
    documented = set(_table_first_column("operations.md", "What is dropped and how to see it"))
    code = _reasons_in_code()
    assert documented == code, (
        f"undocumented: {sorted(code - documented)}; documented but unknown: "
        f"{sorted(documented - code)}"
    )


def test_quoted_benchmark_figures_are_the_reports() -> None:
    report = (DOCS / "performance.md").read_text(encoding="utf-8")
    text = (DOCS / "operations.md").read_text(encoding="utf-8")
    section = text[text.index("### Performance") : text.index("### Reliability")]
    summary = re.search(r"\((\d+ of \d+ targets met, \d+ missed);", section)
    assert summary is not None
    assert summary.group(1) in report, "the quoted summary is not the report's"
    rows = re.findall(r"^\|[^\n]*\| ([^|\n]+?) \|$", section, re.M)
    figures = [row.removesuffix(" (missed)") for row in rows if row not in ("measured", "---")]
    assert len(figures) >= 10
    for figure in figures:
        assert f"| {figure} |" in report, (
            f"operations.md quotes {figure!r}, which docs/performance.md does not hold: "
            "copy the new figures after a benchmark run"
        )


def test_quoted_capacity_figures_are_the_reports() -> None:
    # The capacity guide's table is the scale benchmark's, row for row, from the same run.
    report = (DOCS / "performance.md").read_text(encoding="utf-8")
    text = (DOCS / "operations.md").read_text(encoding="utf-8")
    section = text[text.index("## Capacity") : text.index("## Performance and reliability")]
    head = "| quantity (one web process, this machine) | measured |"
    table = section[section.index(head) :].split("\n\n", 1)[0].splitlines()
    measured = table[2:]  # the rows under the header and its rule
    assert len(measured) >= 6
    assert all(row.startswith("| ") and row.endswith(" |") for row in measured), measured
    report_table = report[report.index("#### Capacity") :]
    for row in measured:
        assert row in report_table, (
            f"operations.md quotes {row!r}, which the capacity table of docs/performance.md "
            "does not hold: copy the new figures after a benchmark run"
        )


def test_quoted_reliability_figures_are_the_reports() -> None:
    report = (DOCS / "reliability.md").read_text(encoding="utf-8")
    text = (DOCS / "operations.md").read_text(encoding="utf-8")
    section = text[text.index("### Reliability") :]
    rows = re.findall(r"^(\| [^\n]+ \|)$", section, re.M)[2:]  # without the header
    assert len(rows) >= 5
    for row in rows:
        assert row in report, (
            f"operations.md quotes {row!r}, which docs/reliability.md does not hold: "
            "copy the new figures after a soak run"
        )


def test_the_redis_names_operations_gives_are_the_codes() -> None:
    # An operator asks PUBSUB NUMSUB about these: they were only in docs/contracts.md.
    from kernel_ext.protocol import NAMESPACE
    from kernel_ext.redis.routing import marker_channel, room_channel, room_log
    from kernel_ext.settings import Settings

    channel = Settings.model_fields["redis_channel"].default
    code = {
        channel,
        marker_channel(channel),
        room_channel(channel, NAMESPACE, "conv-1"),
        room_log(channel, NAMESPACE, "conv-1"),
    }
    text = (DOCS / "operations.md").read_text(encoding="utf-8")
    table = text[text.index("| name on Redis |") :].split("\n\n", 1)[0].splitlines()[2:]
    rows = [re.match(r"^\| `([^`]+)` \|", row) for row in table]
    assert all(rows), table
    assert {row.group(1) for row in rows if row} == code
    named = set(re.findall(rf"{re.escape(channel)}#kx-[^\s`:]+(?::[^\s`]+)?", text))
    assert named <= code, f"operations.md names {sorted(named - code)}, which the code does not"


# -- Python names ---------------------------------------------------------------------------

_DOTTED = re.compile(r"(?<![\w/.-])kernel_ext(?:\.[A-Za-z_]\w*)+")


def _telemetry_names() -> set[str]:
    """Names that are not Python but OpenTelemetry's (metrics and span attributes) or
    another protocol's (the AG-UI bridge's activity type)."""
    from kernel_ext import stream

    source = (PACKAGE / "observability" / "otel_metrics.py").read_text(encoding="utf-8")
    names = set(re.findall(r'create_counter\(\s*"([^"]+)"', source))
    names.update(getattr(stream, n) for n in dir(stream) if n.startswith("ATTR_"))
    # Read from the module's source: the bridge needs the agui extra to import.
    bridge = (PACKAGE / "integrations" / "ag_ui.py").read_text(encoding="utf-8")
    names.update(re.findall(r'^ACTIVITY_TYPE = "([^"]+)"', bridge, re.MULTILINE))
    return names


def _resolve(dotted: str) -> str | None:
    """Why ``dotted`` names neither a module nor an attribute reached from its longest
    importable module prefix; ``None`` when it does. Raises :class:`_DependencyMissing`
    when a module on the way needs a dependency not installed here (pydantic-ai on 3.10)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            value: object = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and not (dotted + ".").startswith(exc.name + "."):
                raise _DependencyMissing(f"{module} needs {exc.name}, not installed") from exc
            continue  # not a module: a shorter prefix may be, with this as an attribute
        except ImportError:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # a moved name is not a name
            for part in parts[cut:]:
                try:
                    value = getattr(value, part)
                except (AttributeError, DeprecationWarning):
                    return f"{module} has no {'.'.join(parts[cut:])}"
        return None
    return f"no module {parts[0]}"


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute reached from the longest
    importable module prefix (``kernel_ext.enabled().emitter`` is checked up to
    ``kernel_ext.enabled``: what follows a call is a value's); a name behind an optional
    dependency not installed here counts as a name."""
    try:
        return _resolve(dotted) is None
    except _DependencyMissing:
        return True


def test_every_python_name_in_the_docs_exists() -> None:
    """``kernel_ext.enabled()`` was documented while only ``kernel_ext.worker.wiring.enabled``
    existed: every dotted ``kernel_ext`` name on a page (up to a call's parenthesis) resolves,
    except telemetry names, which the tests above hold against the code."""
    telemetry = _telemetry_names()
    missing = []
    for page in [*PAGES, README]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for match in _DOTTED.finditer(line):
                dotted = match.group(0)
                if line[match.end() : match.end() + 3] in (".py", ".md", ".js"):
                    continue  # a file name (kernel_ext.web.py is not a thing, but be safe)
                if any(dotted == t or dotted.startswith(t + ".") for t in telemetry):
                    continue
                if not _resolves(dotted):
                    missing.append(f"{page.name}:{number}: {dotted}")
    assert missing == []


# -- the site ------------------------------------------------------------------------------


def _mkdocs_section(key: str) -> str:
    """The text under the top-level ``key:`` of mkdocs.yml (read without a YAML parser)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    section = re.search(rf"^{key}:\n(.*?)(?=^\S|\Z)", text, re.S | re.M)
    assert section is not None, f"mkdocs.yml has no {key}"
    return section.group(1)


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, in order."""
    return re.findall(r"([\w./-]+\.md)\s*$", _mkdocs_section("nav"), re.M)


def _site_markdown_extensions() -> list[str]:
    """The names of mkdocs.yml's ``markdown_extensions``, with which the site renders."""
    return re.findall(r"^  - ([\w.]+)", _mkdocs_section("markdown_extensions"), re.M)


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = nav_pages()
    pages = {page.name for page in PAGES}
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    assert set(nav) == pages, (
        f"not in the nav: {sorted(pages - set(nav))}; in the nav but missing: "
        f"{sorted(set(nav) - pages)}"
    )


def test_every_link_to_a_page_and_its_anchor_resolves() -> None:
    # The site's own check (mkdocs --strict, validation.anchors) found only in the docs
    # environment: here in the fast suite, with the site's extensions and slugs.
    import markdown

    extensions = _site_markdown_extensions()
    ids: dict[str, set[str]] = {}
    links: list[tuple[str, str, str]] = []
    for page in PAGES:
        html = markdown.markdown(page.read_text(encoding="utf-8"), extensions=extensions)
        ids[page.name] = set(re.findall(r'\bid="([^"]+)"', html))
        for target in re.findall(r'<a [^>]*href="([^"]+)"', html):
            target = unescape(target)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # another site
            name, _, fragment = target.partition("#")
            links.append((page.name, name or page.name, fragment))
    broken = [
        f"{page}: {name}#{fragment}" if fragment else f"{page}: {name}"
        for page, name, fragment in links
        if name.endswith(".md") and (name not in ids or (fragment and fragment not in ids[name]))
    ]
    assert broken == []
    assert any(fragment for _, _, fragment in links), "no anchor link checked"


def test_pages_hold_no_machine_paths_or_secrets() -> None:
    forbidden = re.compile(r"/work/|/root/|/home/|/tmp/|\.venv|BEGIN [A-Z ]*PRIVATE KEY")
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            assert not forbidden.search(line), f"{page.name}:{number}: {line.strip()}"
