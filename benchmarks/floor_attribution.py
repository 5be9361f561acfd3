"""The instruction floor of a wrapped tool call: which part of it is wrapt's, the SDK's, the
contextvars' and kernel_ext's own, counted in instructions under callgrind.

Run: ``python benchmarks/floor_attribution.py [--calls N] [--layouts N] [--output PATH]
[--keep DIR]`` (needs ``valgrind``; about three minutes on two cores); writes
``docs/profiles/attribution-wrapped-floor.txt`` by default. The figure "wrapped tool call vs
the same call in a plain SDK span with the same GenAI attributes" of ``bench_attribution.py``
links to it.

Wall-clock ratios on a shared 2-core machine move by more than the margins in question; an
instruction count does not. The script runs itself under ``valgrind --tool=callgrind``
(``PYTHONHASHSEED=0``, address randomisation off with ``setarch -R``, modules compiled
beforehand). The child builds each variant — the whole wrapped call, its comparison, and
each part of the wrapped call replayed on its own with the same arguments — warms it up, and
calls it N times between two calls of ``os.getppid()``, before which callgrind dumps its
counts (``--dump-before=getppid``). A variant's figure is its dump's instructions per call
less those of an empty call (the loop). The parts the wrapped call is not split into are
kernel_ext's remaining frames and checks, reported as the difference: the measured whole
less the measured parts.

A count repeats to the instruction for one memory layout, but moves by up to about 1 % from
one layout to another: the interpreter's method cache and the contextvars' HAMT hash objects
by address. So the child runs in several layouts (environments and allocations of different
sizes before anything is imported), as many at once as there are cores, and the profile gives
each variant's mean.

``--keep DIR`` keeps the dumps (``layout-<n>/callgrind.out.<part>``, one per marker) for
``callgrind_annotate``; valgrind 3.19's ``callgrind_annotate`` misreads the ``calls=0`` lines
of a dump taken mid-run (a call still on the stack), so rewrite them to ``calls=1`` first
(``sed -i 's/^calls=0 /calls=1 /'``): counts of calls change, costs do not.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
DEFAULT_OUTPUT = ROOT / "docs" / "profiles" / "attribution-wrapped-floor.txt"
CALLS = 2000
LAYOUTS = 5
WARM_UP = 300
MARKER = "getppid"  # the C function callgrind dumps before: os.getppid() calls it
C_FUNCTIONS = ("PyContextVar_Set", "PyContextVar_Reset")
WRAPT_OBJECT = "wrapt/_wrappers"

# -- the variants (the child side) ------------------------------------------------------------

Variants = list[tuple[str, Callable[[], object]]]


@contextmanager
def _passthrough() -> Iterator[Callable[[], object]]:
    """The same runtime method wrapped by wrapt alone, with a wrapper that passes the call
    through: the least any wrapt wrapper costs."""
    import wrapt
    from bench_attribution import PlainRuntime

    def passthrough(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return wrapped(*args, **kwargs)

    runtime_cls = type("Runtime", (), {"invoke": PlainRuntime.invoke})
    wrapt.wrap_function_wrapper(runtime_cls, "invoke", passthrough)
    runtime = runtime_cls()
    yield lambda: runtime.invoke("search", 1)


@contextmanager
def _alongside_span_processor() -> Iterator[Variants]:
    """The figure's case: one provider, one no-op span processor, no sink; the wrapped call,
    its comparisons, and the parts of the wrapped call replayed one by one."""
    from bench_attribution import GENAI, PlainRuntime, describe_tool, wrapped_runtime
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    from kernel_ext.context import _CURRENT_CALL, _CURRENT_CALL_ID, CallLife, ToolCall
    from kernel_ext.instrument._call import ActiveCall, _rare

    plain = PlainRuntime()
    with wrapped_runtime() as (wrapped, provider), _passthrough() as passthrough:
        tracer = provider.get_tracer("bench")

        def empty() -> None:
            pass

        def call() -> None:
            plain.invoke("search", 1)

        def plain_span() -> None:
            with tracer.start_as_current_span("execute_tool search"):
                plain.invoke("search", 1)

        def genai_span() -> None:
            with tracer.start_as_current_span("execute_tool search", attributes=GENAI):
                plain.invoke("search", 1)

        internal = SpanKind.INTERNAL  # read once, as begin() does

        def sdk() -> None:  # the SDK and API calls of the wrapped path, in its order
            current = otel_context.get_current()
            trace.get_current_span(current).is_recording()
            span = tracer.start_span(
                "execute_tool search", current, kind=internal, attributes=GENAI
            )
            span_context = span.get_span_context()
            if span_context.is_valid:
                span_context.span_id  # noqa: B018
            token = otel_context.attach(trace.set_span_in_context(span, current))
            otel_context.detach(token)
            span.is_recording()
            span.end()

        the_call = ToolCall("00f067aa0ba902b7", "search", "conv-1", "llm-1")
        call_get, call_set, call_reset = _CURRENT_CALL.get, _CURRENT_CALL.set, _CURRENT_CALL.reset
        id_set, id_reset = _CURRENT_CALL_ID.set, _CURRENT_CALL_ID.reset

        def contextvars() -> None:
            call_get()
            call_token = call_set(the_call)
            id_token = id_set(the_call.call_id)
            id_reset(id_token)
            call_reset(call_token)

        args: tuple[Any, ...] = ("search", 1)
        kwargs: dict[str, Any] = {}

        def describe() -> None:
            describe_tool(plain, args, kwargs)

        live_span = tracer.start_span("execute_tool search", attributes=GENAI)
        context = trace.set_span_in_context(live_span)
        tuple_new = tuple.__new__

        def no_sink() -> None:
            return None

        def objects() -> None:  # as begin() builds them
            call = tuple_new(
                ToolCall, ("00f067aa0ba902b7", "search", "conv-1", "llm-1", None, CallLife())
            )
            ActiveCall(live_span, True, call, context, _rare, no_sink)

        yield [
            ("empty", empty),
            ("call", call),
            ("plain_span", plain_span),
            ("genai_span", genai_span),
            ("wrapped", wrapped),
            ("wrapt", passthrough),
            ("sdk", sdk),
            ("contextvars", contextvars),
            ("describe", describe),
            ("objects", objects),
        ]


@contextmanager
def _as_enable_wires_it() -> Iterator[Variants]:
    """As :func:`kernel_ext.enable` wires it: the ToolSpanProcessor (its tap, the hub as its
    sink) on the provider and the hub as the instrumentor's sink."""
    from bench_attribution import GENAI, PlainRuntime, wrapped_runtime
    from opentelemetry.sdk.trace import TracerProvider

    from kernel_ext.attribution.processor import ToolSpanProcessor
    from kernel_ext.attribution.tap import LiveCall, Tap
    from kernel_ext.stream import StreamHub

    plain = PlainRuntime()
    tap = Tap()
    hub = StreamHub(tap=tap)
    processor = ToolSpanProcessor(tap=tap, sink=hub)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("bench")
    with wrapped_runtime(provider, sink=hub) as (wrapped, _):

        def genai_span() -> None:
            with tracer.start_as_current_span("execute_tool search", attributes=GENAI):
                plain.invoke("search", 1)

        # A live tool span the processor has not seen (as in bench_attribution's figure).
        started: Any = (
            TracerProvider().get_tracer("bench").start_span("execute_tool search", attributes=GENAI)
        )
        on_start, on_end = processor.on_start, processor.on_end

        def processor_pair() -> None:
            on_start(started)
            on_end(started)

        tuple_new = tuple.__new__

        def hub_end() -> None:  # what ActiveCall.finish adds when there is a sink
            hub.call_attributes("00f067aa0ba902b7")
            hub.tool_call_ended(
                tuple_new(LiveCall, ("00f067aa0ba902b7", "search", "conv-1", "llm-1", None, 0)),
                None,
            )

        yield [
            ("enabled_genai_span", genai_span),
            ("enabled_wrapped", wrapped),
            ("processor", processor_pair),
            ("hub_end", hub_end),
        ]


def child(calls: int, layout: int) -> int:
    """Per case: warm up its variants, then run each ``calls`` times, a marker after each.
    Prints one label per marker, in order (``-`` for a dump that measures nothing).
    ``layout`` shifts where everything allocated from here on lies in memory."""
    padding = [bytes(size % 480) for size in range(layout * 997)]  # every small size class
    sys.path.insert(0, str(BENCH_DIR))
    mark = os.getppid
    gc.disable()  # as timeit runs the wall-clock figures
    mark()  # start-up and imports
    print("-", flush=True)
    for case in (_alongside_span_processor, _as_enable_wires_it):
        with case() as found:
            for _, function in found:
                for _ in range(WARM_UP):
                    function()
            mark()  # set-up and warm-up
            print("-", flush=True)
            for name, function in found:
                for _ in range(calls):
                    function()
                mark()
                print(name, flush=True)
    del padding
    return 0


# -- the counts (the parent side) -------------------------------------------------------------


@dataclass
class Dump:
    """One callgrind dump: its total, each function's own cost (with its object file), and
    each function's calls from others (how often, at what inclusive cost)."""

    total: int
    own: dict[str, int]
    objects: dict[str, str]
    called: dict[str, tuple[int, int]]

    def inclusive(self, function: str) -> tuple[int, int]:
        """(times called, inclusive cost) of ``function`` (not recursive), from its callers."""
        return self.called.get(function, (0, 0))

    def own_in_object(self, fragment: str) -> int:
        """The own cost of every function of an object file whose path contains
        ``fragment``."""
        return sum(c for f, c in self.own.items() if fragment in self.objects.get(f, ""))


def read_dump(path: Path) -> Dump:
    """Parse a callgrind output file written with ``--compress-strings=no
    --compress-pos=no`` (one event, Ir)."""
    total = 0
    own: dict[str, int] = {}
    objects: dict[str, str] = {}
    called: dict[str, tuple[int, int]] = {}
    function = ""
    obj = ""
    callee: str | None = None
    calls = 0
    pending = False  # the next cost line is a call's inclusive cost
    for line in path.read_text(errors="replace").splitlines():
        if not line:
            continue
        head = line[0]
        if head.isdigit() or head in "+-*":
            cost = int(line.split()[1]) if " " in line else 0
            if pending:
                if callee is not None and callee != function:
                    n, c = called.get(callee, (0, 0))
                    called[callee] = (n + calls, c + cost)
                pending = False
            else:
                own[function] = own.get(function, 0) + cost
            continue
        key, _, value = line.partition("=")
        if key == "fn":
            function, callee = value, None
            objects.setdefault(function, obj)
        elif key == "ob":
            obj = value
        elif key == "cfn":
            callee = value
        elif key == "calls":
            calls, pending = int(value.split()[0]), True
        elif line.startswith("summary:"):
            total = int(line.split()[1])
    return Dump(total, own, objects, called)


@dataclass
class Layout:
    """One child's counts: instructions per call of each variant (an empty call's
    subtracted) and the wrapped call's dump."""

    per_call: dict[str, float]
    wrapped: Dump


def measure(calls: int, layouts: int, keep: Path | None = None) -> list[Layout]:
    """Run the child under callgrind once per memory layout, as many at once as there are
    cores."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    # Compiled first: a module compiled during the run lies elsewhere in memory than one
    # loaded from its .pyc.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(ROOT / "kernel_ext"), str(BENCH_DIR)],
        check=True,
        capture_output=True,
    )
    setarch = shutil.which("setarch")
    fixed = [setarch, platform.machine(), "-R"] if setarch else []  # no address randomisation
    env = dict(os.environ, PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)

    def run(layout: int, folder: Path) -> Layout:
        out = folder / f"layout-{layout}" / "callgrind.out"
        out.parent.mkdir(parents=True, exist_ok=True)
        command = [
            *fixed,
            valgrind,
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            f"--dump-before={MARKER}",
            "--compress-strings=no",
            "--compress-pos=no",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            str(calls),
            "--layout",
            str(layout),
        ]
        # The environment is copied onto the heap at start-up: its size moves what the
        # interpreter allocates then; the child's padding moves what comes after.
        padded = dict(env, FLOOR_LAYOUT="x" * (layout * 541))
        child = subprocess.run(command, env=padded, capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(f"the child failed under callgrind:\n{child.stderr[-3000:]}")
        dumps = {
            label: out.with_name(f"{out.name}.{part}")
            for part, label in enumerate(child.stdout.split(), start=1)
            if label != "-"
        }
        totals = {name: read_dump(path).total / calls for name, path in dumps.items()}
        per_call = {name: total - totals["empty"] for name, total in totals.items()}
        return Layout(per_call, read_dump(dumps["wrapped"]))

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count()) as pool:
        folder = keep or Path(tmp)
        return list(pool.map(run, range(layouts), [folder] * layouts))


# -- the report -------------------------------------------------------------------------------

WRAPPED_PARTS: tuple[tuple[str, str], ...] = (
    ("call", "the tool call itself (Runtime.invoke, unwrapped)"),
    ("wrapt", "wrapt: dispatch through a FunctionWrapper to a pass-through wrapper (a)"),
    ("sdk", "OpenTelemetry SDK and API: the wrapped path's calls, replayed (b)"),
    ("contextvars", "contextvars: get, 2 set, 2 reset (the active call and its id)"),
    ("describe", "the describe hook (the benchmark's: one ToolDescription)"),
    ("objects", "kernel_ext: its ToolCall, CallLife and ActiveCall"),
)
NOTES = """\
(a) wrapt's C code and what it asks of the interpreter: a bound wrapper and a bound method per
    call, the wrapper's Python frame, the args tuple and kwargs dict, the call re-splatted.
(b) get_current, get_current_span + is_recording, start_span(name, context, kind,
    attributes=<4 GenAI>), get_span_context, set_span_in_context, attach, detach,
    is_recording, end.
(c) kernel_ext's frames and checks: the wrapper, begin_described, begin (the attribute
    dict, the span name, span_id_hex), ActiveCall's activate, deactivate and finish; by
    difference."""
WIDTH = 72


def _table(title: str, rows: list[tuple[str, float]], whole: float, column: str) -> list[str]:
    lines = [f"{title:<{WIDTH}} {'Ir':>9}  {column:>8}"]
    for label, value in rows:
        number = f"{value:+,.0f}" if column.startswith("of") else f"{value:,.0f}"
        lines.append(f"  {label:<{WIDTH - 2}} {number:>9}  {value / whole:>8.1%}")
    return lines


def report(layouts: list[Layout], calls: int) -> str:
    """The profile's text: each variant's mean over the layouts."""
    per_call = {
        name: statistics.fmean(layout.per_call[name] for layout in layouts)
        for name in layouts[0].per_call
    }
    wrapped, genai, bare = per_call["wrapped"], per_call["genai_span"], per_call["plain_span"]
    ratios = [layout.per_call["wrapped"] / layout.per_call["genai_span"] for layout in layouts]
    sdk_plain = genai - per_call["call"]
    rest = wrapped - sum(per_call[key] for key, _ in WRAPPED_PARTS)
    enabled, enabled_genai = per_call["enabled_wrapped"], per_call["enabled_genai_span"]
    wrapt_own = (
        statistics.fmean(layout.wrapped.own_in_object(WRAPT_OBJECT) for layout in layouts) / calls
    )
    c_functions = []
    for function in C_FUNCTIONS:
        times, cost = (
            statistics.fmean(layout.wrapped.inclusive(function)[i] for layout in layouts) / calls
            for i in (0, 1)
        )
        c_functions.append(f"  {function:<24} {times:>3.0f} calls {cost:>9,.0f} Ir")
    head = (
        f"The instruction floor of a wrapped tool call, written by "
        f"benchmarks/floor_attribution.py (do not edit by hand). callgrind "
        f"({_valgrind_version()}), Python {platform.python_version()}, opentelemetry-sdk "
        f"{version('opentelemetry-sdk')}, wrapt {version('wrapt')}"
        f"{' (its C extension)' if _wrapt_is_c() else ''}, commit {_commit()}. Instructions "
        f"(Ir) per call: each variant called {calls:,} times after {WARM_UP} warm-up calls, "
        f"the garbage collector off (as timeit runs the wall-clock figures), PYTHONHASHSEED=0, "
        f"an empty call's instructions subtracted; the mean of {len(layouts)} memory layouts "
        f"(the interpreter's method cache and the contextvars' HAMT hash by address, so a "
        f"variant's count moves by up to about 1 % from one layout to another). Both sides "
        f"start their spans from one TracerProvider with one no-op span processor; no sink."
    )
    return "\n".join(
        [
            *textwrap.wrap(head, WIDTH + 21, break_on_hyphens=False),
            "",
            "Like for like (the target, <= 1.10x): the wrapped call vs the same call in a plain",
            "SDK span with the same 4 GenAI attributes (start_as_current_span)",
            f"  {wrapped:,.0f} vs {genai:,.0f} Ir = {wrapped / genai:.3f}x "
            f"(by layout: {', '.join(f'{ratio:.3f}x' for ratio in ratios)})",
            "Information: the wrapped call vs the same call in a plain SDK span without attributes",
            f"  {wrapped:,.0f} vs {bare:,.0f} Ir = {wrapped / bare:.3f}x",
            "",
            *_table(
                "The wrapped call, part by part",
                [
                    *((label, per_call[key]) for key, label in WRAPPED_PARTS),
                    ("kernel_ext: the rest (c)", rest),
                    ("total (measured)", wrapped),
                ],
                wrapped,
                "share",
            ),
            "",
            *_table(
                "The comparison: the call in a plain SDK span with the GenAI attributes",
                [
                    ("the tool call itself", per_call["call"]),
                    (
                        "SDK: start_as_current_span(name, attributes=<4 GenAI>) and its end",
                        sdk_plain,
                    ),
                    ("total (measured)", genai),
                ],
                genai,
                "share",
            ),
            "",
            *_table(
                "Wrapped less plain, by part",
                [
                    ("wrapt", per_call["wrapt"]),
                    ("contextvars", per_call["contextvars"]),
                    ("the describe hook", per_call["describe"]),
                    (
                        "kernel_ext's own work (its objects and the rest)",
                        per_call["objects"] + rest,
                    ),
                    (
                        "SDK: the wrapped path's calls less start_as_current_span's",
                        per_call["sdk"] - sdk_plain,
                    ),
                    ("total", wrapped - genai),
                ],
                genai,
                "of plain",
            ),
            "",
            NOTES,
            "",
            "C functions in the wrapped call (callgrind, inclusive, per wrapped call):",
            *c_functions,
            "  (3 each: kernel_ext's 2 contextvars, OpenTelemetry's context)",
            f"  {'wrapt C extension, own':<34} {wrapt_own:>9,.0f} Ir",
            "",
            "As kernel_ext.enable() wires it (information): the ToolSpanProcessor (its tap, the",
            "hub as its sink) on the provider, the hub as the wrapper's sink",
            "  the wrapped call vs the same call in a plain SDK span with the same attributes",
            f"  {enabled:,.0f} vs {enabled_genai:,.0f} Ir = {enabled / enabled_genai:.3f}x",
            *_table(
                "  of which",
                [
                    (
                        "ToolSpanProcessor on_start + on_end, one tool span (both sides)",
                        per_call["processor"],
                    ),
                    (
                        "the wrapper telling the hub (call_attributes, tool_call_ended)",
                        per_call["hub_end"],
                    ),
                ],
                enabled,
                "share",
            )[1:],
            "",
        ]
    )


def _valgrind_version() -> str:
    try:
        return subprocess.run(
            ["valgrind", "--version"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "valgrind"


def _wrapt_is_c() -> bool:
    import wrapt

    return bool(wrapt.FunctionWrapper.__module__ == "_wrappers")  # its C extension's classes


def _commit() -> str:
    """The short commit, marked when the library or the benchmarks differ from it."""
    try:
        head, dirty = (
            subprocess.run(
                ["git", *command], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
            for command in (
                ["rev-parse", "--short", "HEAD"],
                ["status", "--porcelain", "--", "kernel_ext", "benchmarks"],
            )
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=CALLS, help="calls per variant")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="profile path")
    parser.add_argument("--keep", type=Path, help="keep the callgrind dumps in this directory")
    parser.add_argument("--layouts", type=int, default=LAYOUTS, help="memory layouts to average")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--layout", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child(args.child, args.layout)
    text = report(measure(args.calls, args.layouts, args.keep), args.calls)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
