"""Run every benchmark under ``benchmarks/`` and write ``docs/performance.md``.

Usage::

    python benchmarks/run.py                # all of them; writes docs/performance.md
    python benchmarks/run.py --quick        # fewer repetitions and smaller counts
    python benchmarks/run.py --only peers   # one module (repeatable; with or without bench_)
    tox -e bench [-- --quick]

A benchmark module is a ``bench_<name>.py`` file beside this one exposing
``run() -> list[dict]``; each dict is one figure: ``name``, ``value``, ``unit``, ``target``
(``None`` for information), ``ok`` (``True``/``False``, ``None`` when there is no verdict) and
``detail``; optionally ``target_text`` (how to print the target) and ``profile`` (a key for
the module's ``profile_target``; ``False``: none, the path runs in other processes). A
module's docstring is its method, copied into the report.
A module may also expose ``sections() -> str``: markdown (tables, plots) printed under its
figures, called after ``run()``; plots go to the directory named by ``KERNEL_EXT_BENCH_PLOTS``
(``plots/`` beside the report), linked relative to the report. A module whose run takes
longer than the common limit declares its own ``TIMEOUT = <seconds>`` at the top level.
``--quick`` calls ``run(quick=True)`` when ``run`` takes that argument, otherwise lowers the
module's ``REPEATS`` constant; ``KERNEL_EXT_BENCH_QUICK=1`` is set in the environment either
way.

Each module runs in a child process of its own, with a time limit (the whole run is bounded
too); a child that overruns is killed with its process group. For every missed target a
profile (pyinstrument, text) of the path behind it is written under ``profiles/`` beside the
report and linked from it: the callable the module's ``profile_target(figure_name)`` returns,
else the module's whole quick run.

A full run writes ``docs/performance.md``; a ``--quick`` or ``--only`` run writes to the
temporary directory unless ``--output`` says otherwise, so that a partial run never replaces
the full report. The exit status is 1 when a module failed to run, 0 otherwise: a missed
target is reported, not an error.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import importlib.metadata
import inspect
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
DEFAULT_OUTPUT = ROOT / "docs" / "performance.md"

MODULE_TIMEOUT = 420.0
QUICK_MODULE_TIMEOUT = 180.0
PROFILE_TIMEOUT = 120.0
TOTAL_BUDGET = 3_000.0
PLOT_DIR_ENV = "KERNEL_EXT_BENCH_PLOTS"
MAX_PROFILES = 6
QUICK_ENV = "KERNEL_EXT_BENCH_QUICK"
PROFILE_INTERVAL = 0.0002  # a targeted path: short, sample densely
WHOLE_RUN_INTERVAL = 0.001  # a module's whole quick run: long, sample at the default rate

# The figures of issues 8 (design.md §7), 17, 24, 25 and 35, and the module expected to
# measure each.
TARGETS: tuple[tuple[str, str, str], ...] = (
    ("`current_call_id()` vs bare `ContextVar.get()`", "≤ 2×", "attribution"),
    (
        "wrapped tool call vs plain SDK span with the same GenAI attributes and processor",
        "≤ 1.10×",
        "attribution",
    ),
    ("span processor on a tool span", "≤ 2 µs added", "attribution"),
    ("`publish()` of a running block (event loop and worker thread)", "≤ 2 µs median", "stream"),
    ("a dropped block (over the limit)", "≤ 1 µs median", "stream"),
    ("per event tool → sender vs LangGraph and pydantic-ai", "≤ 0.8× each", "peers"),
    ("relay throughput vs plain python-socketio relay", "≥ 1.0×, aim 1.5×", "stream"),
    ("latency p99 at 100 streams × 10 blocks/s vs plain relay", "≤ 1.5×", "stream"),
    ("memory after 100,000 finished calls", "≤ 1 MB growth", "memory"),
    ("CPU of a flooding peer (10,000 running blocks/s)", "report; terminal arrives", "memory"),
    ("every point of the scale curves (issue 17): throughput vs plain relay", "≥ 1.0×", "scale"),
    ("every point of the scale curves: p99 latency vs plain relay", "≤ 1.5×", "scale"),
    (
        "2 and 4 web processes behind Redis (issue 25): their summed CPU per delivered block "
        "vs 1 process",
        "≤ 1.2×",
        "scale",
    ),
    ("relay throughput, catch-up on vs off (issue 24)", "≥ 0.95× (within 5 %)", "catchup"),
    ("latency p99 at 100 streams × 10 blocks/s, catch-up on vs off", "≤ 1.05×", "catchup"),
    ("relay CPU per delivered block, catch-up on vs off", "≤ 1.05×", "catchup"),
    (
        "relay memory per stream at 5× its capacity, back-pressure on (issue 25)",
        "≤ 1.25× the 2× figure (or + 0.1 MB); every terminal",
        "backpressure",
    ),
    (
        "relay throughput, latency p99 and relay CPU per block, back-pressure on vs off",
        "≥ 0.95×, ≤ 1.05×, ≤ 1.05×",
        "backpressure",
    ),
    (
        "stop_call → stopped terminal at the browser p99 (issue 35), loopback / via Redis",
        "≤ 100 ms / ≤ 250 ms",
        "stop",
    ),
    ("live path throughput, stopping a call on vs off", "≥ 0.95× (within 5 %)", "stop"),
)

VERSIONED = (
    "kernel-ext",
    "opentelemetry-sdk",
    "python-socketio",
    "pydantic",
    "langgraph",
    "langchain-core",
    "pydantic-ai-slim",
    "openai-agents",
    "pyinstrument",
)


# -- data ---------------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured figure, as a benchmark module reported it."""

    name: str
    value: Any = None
    unit: str = ""
    target: Any = None
    ok: bool | None = None
    detail: str = ""
    target_text: str | None = None
    profile: str | None = None
    profile_path: str | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Figure:
        ok = raw.get("ok")
        return cls(
            name=str(raw.get("name", "?")),
            value=raw.get("value"),
            unit=str(raw.get("unit") or ""),
            target=raw.get("target"),
            ok=None if ok is None else bool(ok),
            detail=str(raw.get("detail") or ""),
            target_text=raw.get("target_text"),
            profile="" if raw.get("profile") is False else raw.get("profile"),
        )


@dataclass
class ModuleResult:
    """What one module's child process produced."""

    name: str
    path: str
    method: str = ""
    figures: list[Figure] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    load_at_start: tuple[float, float, float] | None = None
    profile_hook: bool = False
    sections: str = ""


# -- formatting (pure, tested) ------------------------------------------------------------


def _num(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.0f}"


def format_value(value: Any, unit: str) -> str:
    """A value with its unit, as the report prints it."""
    if value is None:
        return "—"
    if unit in ("x", "×"):
        return f"{_num(value)}×"
    return f"{_num(value)} {unit}".rstrip()


def higher_is_better(figure: Figure) -> bool:
    """Whether the target is a floor (``≥``) rather than a ceiling (``≤``), read from the
    module's own verdict: a pass above the target or a miss below it means a floor."""
    if not isinstance(figure.value, (int, float)) or not isinstance(figure.target, (int, float)):
        return False
    if figure.ok is None:
        return False
    return (figure.ok and figure.value > figure.target) or (
        not figure.ok and figure.value < figure.target
    )


def format_target(figure: Figure) -> str:
    """The target as printed: the module's ``target_text``, else ``≤``/``≥`` the target."""
    if figure.target_text:
        return str(figure.target_text)
    if figure.target is None:
        return "—"
    if not isinstance(figure.target, (int, float)) or isinstance(figure.target, bool):
        return str(figure.target)
    sign = "≥" if higher_is_better(figure) else "≤"
    return f"{sign} {format_value(figure.target, figure.unit)}"


def verdict(figure: Figure) -> str:
    """``PASS``, ``MISS``, ``info`` (no target) or ``not measured`` (a target, no verdict)."""
    if figure.ok is True:
        return "PASS"
    if figure.ok is False:
        return "MISS"
    return "info" if figure.target is None else "not measured"


def margin(figure: Figure) -> str:
    """How far from the target: ``misses by …`` for a miss, the headroom for a pass."""
    value, target = figure.value, figure.target
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (value, target))
    if figure.ok is None or not numeric:
        return ""
    gap = abs(value - target)
    relative = f" ({gap / abs(target):.0%})" if target else ""
    if figure.ok:
        return f"{format_value(gap, figure.unit)} headroom{relative}"
    return f"misses by {format_value(gap, figure.unit)}{relative}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_row(figure: Figure) -> str:
    """One markdown table row: figure, measured, target, verdict, margin, detail."""
    shown = f"**{verdict(figure)}**" if figure.ok is False else verdict(figure)
    how_far = margin(figure)
    if figure.profile_path:
        how_far += f" — [profile]({figure.profile_path})"
    cells = (
        figure.name,
        format_value(figure.value, figure.unit),
        format_target(figure),
        shown,
        how_far,
        figure.detail,
    )
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _load(load: Sequence[float] | None) -> str:
    if not load:
        return "unknown"
    return " / ".join(f"{x:.2f}" for x in load) + " (1 / 5 / 15 min)"


def render_report(
    results: Sequence[ModuleResult],
    machine: dict[str, str],
    *,
    quick: bool,
    only: Sequence[str] = (),
    missing: Sequence[str] = (),
) -> str:
    """The whole ``performance.md`` text."""
    lines: list[str] = ["# Performance", ""]
    mode = "quick (fewer repetitions, smaller counts)" if quick else "full"
    lines += [
        "Written by `python benchmarks/run.py` (`tox -e bench`); do not edit by hand. "
        f"Mode: {mode}" + (f"; only {', '.join(only)}" if only else "") + ".",
        "",
        "Every ratio below was measured side by side in this one run, against its comparison "
        "on the same machine; timings are medians of repeated runs after a warm-up. Absolute "
        "times depend on the machine and on what else shares it (see the load average); the "
        "targets are held against the ratios.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in machine.items()]
    figures = [f for r in results for f in r.figures]
    judged = [f for f in figures if f.ok is not None]
    misses = [f for f in judged if f.ok is False]
    errors = [r for r in results if r.error]
    lines += ["", "## Summary", ""]
    lines.append(
        f"{len(judged) - len(misses)} of {len(judged)} targets met, {len(misses)} missed"
        + (f"; {len(errors)} module(s) failed to run" if errors else "")
        + "."
    )
    if misses:
        lines += ["", "Missed:", ""]
        for f in misses:
            link = f" ([profile]({f.profile_path}))" if f.profile_path else ""
            lines.append(
                f"- {f.name}: {format_value(f.value, f.unit)} against {format_target(f)}, "
                f"{margin(f)}{link}."
            )
    for r in errors:
        last = (r.error or "").strip().splitlines() or ["?"]
        lines.append(f"- `{r.path}` did not run to the end: {last[-1]}")
    for name in missing:
        lines.append(f"- `benchmarks/bench_{name}.py` does not exist yet: its figures are absent.")
    lines += [
        "",
        "## Targets (issue 8, design.md §7) and where they are measured",
        "",
        "| figure | target | module | state |",
        "|---|---|---|---|",
    ]
    by_name = {r.name: r for r in results}
    for what, target, module in TARGETS:
        result = by_name.get(module)
        if result is None:
            state = "absent" if module in missing else "not run"
        elif result.error:
            state = "failed to run"
        else:
            state = "measured"
        lines.append(f"| {what} | {target} | `bench_{module}.py` | {state} |")
    lines += ["", "## Figures"]
    for r in results:
        load = f"; load average at its start {_load(r.load_at_start)}" if r.load_at_start else ""
        lines += ["", f"### {r.name} — `{r.path}` ({r.seconds:.1f} s{load})", ""]
        if r.figures:
            lines += [
                "| figure | measured | target | verdict | margin | detail |",
                "|---|---|---|---|---|---|",
            ]
            lines += [format_row(f) for f in r.figures]
        if r.sections:
            lines += ["", r.sections.strip()]
        if r.error:
            lines += ["", "Failed:", "", "```", r.error.strip(), "```"]
        if r.method:
            lines += ["", "**Method.**", "", r.method.strip()]
    lines.append("")
    return "\n".join(lines)


# -- the machine --------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def _commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def _versions() -> str:
    found = []
    for dist in VERSIONED:
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{dist} (not installed)")
    return ", ".join(found)


def machine_info(load_at_start: tuple[float, float, float] | None) -> dict[str, str]:
    """Cores, CPU model, Python, platform, load average at the start, commit, versions."""
    return {
        "CPU": f"{_cpu_model()}, {os.cpu_count()} cores",
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "load average at start": _load(load_at_start),
        "commit": _commit(),
        "packages": _versions(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# -- discovery and child processes ----------------------------------------------------------


def discover(bench_dir: Path) -> list[str]:
    """Names of the benchmark modules in ``bench_dir`` (``bench_<name>.py`` → ``<name>``)."""
    return sorted(p.stem[len("bench_") :] for p in bench_dir.glob("bench_*.py"))


def _normalise(name: str) -> str:
    name = name.removesuffix(".py")
    return name.removeprefix("bench_")


def module_timeout(path: Path, default: float) -> float:
    """The module's own top-level ``TIMEOUT = <number>`` when it declares one (read from its
    source, not imported), else ``default``."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return default
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["TIMEOUT"]
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, (int, float))
            and not isinstance(node.value.value, bool)
            and node.value.value > 0
        ):
            return float(node.value.value)
    return default


def _run_child(
    args: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int | None, str]:
    """Run ``run.py --child …`` in its own process group; kill the group on timeout.
    Returns (exit code or ``None`` on timeout, combined output tail)."""
    command = [sys.executable, str(Path(__file__).resolve()), *args]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        log.seek(0)
        output = log.read()
    return code, output[-4000:]


def run_module(
    name: str, bench_dir: Path, *, quick: bool, timeout: float, plots: Path | None = None
) -> ModuleResult:
    """Run one module in a child process and collect its figures (plots, if any, are
    written to ``plots``)."""
    path = bench_dir / f"bench_{name}.py"
    shown = os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else str(path)
    result = ModuleResult(name=name, path=shown)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = ["--child", name, "--bench-dir", str(bench_dir), "--result", str(out)]
        if quick:
            args.append("--quick")
        started = time.perf_counter()
        env = {PLOT_DIR_ENV: str(plots)} if plots is not None else None
        code, output = _run_child(args, timeout, env)
        result.seconds = time.perf_counter() - started
        data: dict[str, Any] = {}
        if out.exists():
            try:
                data = json.loads(out.read_text())
            except ValueError as exc:
                result.error = f"unreadable result: {exc}"
    result.method = str(data.get("method") or "")
    result.profile_hook = bool(data.get("profile_hook"))
    result.sections = str(data.get("sections") or "")
    result.figures = [Figure.from_dict(f) for f in data.get("figures") or []]
    load = data.get("load_at_start")
    result.load_at_start = (float(load[0]), float(load[1]), float(load[2])) if load else None
    if data.get("error"):
        result.error = str(data["error"])
    elif code is None:
        result.error = f"killed after the time limit of {timeout:.0f} s\n{output}"
    elif code != 0 and result.error is None:
        result.error = f"exit status {code}\n{output}"
    return result


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "figure"


def profile_misses(
    results: Sequence[ModuleResult], bench_dir: Path, profile_dir: Path, deadline: float
) -> None:
    """Profile the path behind each missed figure (one profile per module and path key) and
    set ``profile_path`` on the figures, relative to the report."""
    done: dict[tuple[str, str], str | None] = {}
    for r in results:
        for f in r.figures:
            if f.ok is not False or f.profile == "":
                continue  # met, or measured in other processes (``"profile": False``)
            # Without a profile_target hook the whole module is profiled: once is enough.
            key = (r.name, (f.profile or f.name) if r.profile_hook else "quick-run")
            if key not in done:
                remaining = deadline - time.monotonic()
                if len(done) >= MAX_PROFILES or remaining < 20:
                    done[key] = None
                    continue
                profile_dir.mkdir(parents=True, exist_ok=True)
                target = profile_dir / f"{r.name}-{_slug(key[1])}.txt"
                args = [
                    "--child",
                    r.name,
                    "--bench-dir",
                    str(bench_dir),
                    "--profile",
                    f.name,
                    "--profile-out",
                    str(target),
                ]
                code, output = _run_child(args, min(PROFILE_TIMEOUT, remaining))
                if code == 0 and target.exists():
                    done[key] = f"{profile_dir.name}/{target.name}"
                else:
                    print(f"  profile of {f.name!r} failed: {output[-300:]}", file=sys.stderr)
                    done[key] = None
            f.profile_path = done[key]


# -- the child side -------------------------------------------------------------------------


def _import_module(name: str, bench_dir: Path) -> Any:
    if str(bench_dir) not in sys.path:
        sys.path.insert(0, str(bench_dir))
    try:
        importlib.import_module("kernel_ext")
    except ImportError:  # a source checkout that was not installed
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"bench_{name}")


def _call_run(module: Any, quick: bool) -> list[dict[str, Any]]:
    run: Callable[..., list[dict[str, Any]]] = module.run
    if "quick" in inspect.signature(run).parameters:
        return run(quick=quick)
    repeats = getattr(module, "REPEATS", None)
    if quick and isinstance(repeats, int) and not isinstance(repeats, bool):
        module.REPEATS = max(3, repeats // 3)
    return run()


def child_main(args: argparse.Namespace) -> int:
    """Run one module (or profile one of its paths) and write the result file."""
    if args.quick:
        os.environ[QUICK_ENV] = "1"
    bench_dir = Path(args.bench_dir)
    if args.profile is not None:
        from pyinstrument import Profiler

        module = _import_module(args.child, bench_dir)
        hook = getattr(module, "profile_target", None)
        target = hook(args.profile) if hook is not None else None
        what = "the path behind the figure" if target is not None else "the module's quick run"
        interval = PROFILE_INTERVAL if target is not None else WHOLE_RUN_INTERVAL
        profiler = Profiler(interval=interval)
        profiler.start()
        try:
            if target is not None:
                target()
            else:
                _call_run(module, True)
        finally:
            profiler.stop()
        header = (
            f"pyinstrument profile of {what}: {args.profile!r} "
            f"(benchmarks/bench_{args.child}.py), sampled every {interval * 1e3:g} ms, "
            f"Python {platform.python_version()}, load average {_load(_loadavg())}\n\n"
        )
        text = profiler.output_text(unicode=True, color=False, show_all=False)
        # No machine paths in the committed report: paths relative to the project root.
        text = text.replace(str(bench_dir.parent.resolve()) + os.sep, "")
        Path(args.profile_out).write_text(header + text)
        return 0
    result: dict[str, Any] = {"load_at_start": _loadavg()}
    try:
        module = _import_module(args.child, bench_dir)
        result["method"] = inspect.getdoc(module) or ""
        result["profile_hook"] = callable(getattr(module, "profile_target", None))
        result["figures"] = _call_run(module, args.quick)
        sections = getattr(module, "sections", None)
        if callable(sections):
            result["sections"] = str(sections())
    except BaseException:
        import traceback

        result["error"] = traceback.format_exc()
    Path(args.result).write_text(json.dumps(result, default=str))
    return 0 if "error" not in result else 1


# -- main -----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="run only this module"
    )
    parser.add_argument("--output", type=Path, help="report path (default: see --help text)")
    parser.add_argument("--no-profile", action="store_true", help="skip profiles of misses")
    parser.add_argument("--bench-dir", default=str(BENCH_DIR), help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        return child_main(args)
    started = time.monotonic()
    deadline = started + TOTAL_BUDGET
    load_at_start = _loadavg()
    bench_dir = Path(args.bench_dir).resolve()
    available = discover(bench_dir)
    only = [_normalise(n) for n in args.only]
    unknown = [n for n in only if n not in available]
    if unknown:
        print(f"no such benchmark: {', '.join(unknown)} (have: {', '.join(available)})")
        return 2
    names = only or available
    expected = {module for _, _, module in TARGETS}
    missing = [] if only else sorted(expected - set(available))
    output = args.output
    if output is None:
        partial = args.quick or bool(only)
        output = Path(tempfile.gettempdir()) / "performance.md" if partial else DEFAULT_OUTPUT
    machine = machine_info(load_at_start)
    per_module = QUICK_MODULE_TIMEOUT if args.quick else MODULE_TIMEOUT
    results: list[ModuleResult] = []
    for name in names:
        remaining = deadline - time.monotonic()
        if remaining < 10:
            results.append(
                ModuleResult(name, f"benchmarks/bench_{name}.py", error="skipped: time budget")
            )
            continue
        print(f"bench_{name} …", flush=True)
        limit = module_timeout(bench_dir / f"bench_{name}.py", per_module)
        result = run_module(
            name,
            bench_dir,
            quick=args.quick,
            timeout=min(limit, remaining),
            plots=output.parent / "plots",
        )
        results.append(result)
        for f in result.figures:
            print(f"  {verdict(f):<12} {f.name}: {format_value(f.value, f.unit)}", flush=True)
        if result.error:
            print(f"  failed: {result.error.strip().splitlines()[-1]}", flush=True)
    if not args.no_profile:
        profile_misses(results, bench_dir, output.parent / "profiles", deadline)
    machine["load average at end"] = _load(_loadavg())
    machine["run time"] = f"{time.monotonic() - started:.0f} s"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render_report(results, machine, quick=args.quick, only=only, missing=missing))
    print(f"wrote {output}")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
