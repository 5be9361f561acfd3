"""``kernel-ext demo``: the whole path on one machine.

An agent conversation whose ``ask_colleague`` calls stream their colleague's work live into
the browser: two A2A colleagues, a worker instrumented by kernel_ext (its agent on
pydantic-ai, or on LangGraph with ``--kernel langgraph``), and the
``/chat`` relay serving a page that shows one node per tool call, each with its live detail
pane (:mod:`kernel_ext.demo.launcher` for what runs and what is guaranteed).

Importing this package is cheap and works on every supported Python; :func:`run` checks
that the demo can run here (Python ≥ 3.11 for pydantic-ai, the ``demo`` extra installed)
and says what is missing otherwise.

Modules: :mod:`kernel_ext.demo.launcher` (starts and stops the processes),
:mod:`kernel_ext.demo.script` (what is asked, whom, in which words),
:mod:`kernel_ext.demo.agent` (what the agents share), :mod:`kernel_ext.demo.worker` (the
pydantic-ai worker), :mod:`kernel_ext.demo.graph_agent` (the LangGraph one),
:mod:`kernel_ext.demo.colleague_server` (an A2A colleague), :mod:`kernel_ext.demo.web` (the
relay and the page).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import TextIO

from kernel_ext.cli._common import port, positive_seconds, seconds
from kernel_ext.demo.script import (
    DEFAULT_BEAT,
    DEFAULT_KERNEL,
    FAST_BEAT,
    KERNELS,
    LANGS,
)

__all__ = ["EXIT_UNAVAILABLE", "add_arguments", "missing_requirements", "run"]

EXIT_UNAVAILABLE = 2
_NEEDED = {
    "pydantic_ai": "pydantic-ai-slim",
    "a2a": "a2a-sdk",
    "httpx": "httpx",
    "uvicorn": "uvicorn",
    "starlette": "starlette",
}
_NEEDED_BY_KERNEL = {
    "langgraph": {"langgraph": "langgraph", "langchain_core": "langchain-core"},
}


def missing_requirements(kernel: str = DEFAULT_KERNEL) -> str | None:
    """Why the demo cannot run on this interpreter with its agent on ``kernel``, or
    ``None`` when it can."""
    if sys.version_info < (3, 11):
        version = ".".join(str(n) for n in sys.version_info[:3])
        return (
            f"kernel-ext demo needs Python 3.11 or newer (its agent uses pydantic-ai, which "
            f"requires 3.11); this is Python {version}. The library itself works here."
        )
    needed = {**_NEEDED, **_NEEDED_BY_KERNEL.get(kernel, {})}
    missing = [dist for module, dist in needed.items() if importlib.util.find_spec(module) is None]
    if missing:
        return (
            f"kernel-ext demo needs {', '.join(missing)}: install the demo extra, "
            "pip install 'kernel-ext[demo]' (or pip install '.[demo]' in a checkout)"
        )
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``demo``'s options to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="web bind address (127.0.0.1)")
    parser.add_argument("--port", type=port, default=8000, help="web port (8000)")
    parser.add_argument(
        "--headless",
        action="store_true",
        help="run one scripted conversation, print it like `kernel-ext tail`, exit 0 when "
        "every tool call has its terminal",
    )
    parser.add_argument(
        "--redis", default=None, metavar="URL", help="run the web side through Redis (URL)"
    )
    parser.add_argument(
        "--time-limit",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="stop after S seconds (default: none; 60 with --headless, then it is a failure)",
    )
    parser.add_argument(
        "--lang",
        choices=LANGS,
        default=None,
        help="the page's starting language (default: the browser's; the page has a switch) "
        "and, with --headless, the conversation's (default: the locale's, else en)",
    )
    parser.add_argument(
        "--kernel",
        choices=KERNELS,
        default=DEFAULT_KERNEL,
        help=f"the agent's kernel ({DEFAULT_KERNEL}; langgraph: a LangGraph graph with "
        "ToolNode, instrumented through kernel_ext.integrations.langchain)",
    )
    pace = parser.add_mutually_exclusive_group()
    pace.add_argument(
        "--step-delay",
        type=seconds,
        default=None,
        metavar="S",
        help=f"the colleagues' pace: seconds per beat, a step takes 1-2.5 beats ({DEFAULT_BEAT}: "
        "a call takes about 12 s)",
    )
    pace.add_argument(
        "--fast",
        action="store_true",
        help=f"the fast pace of tests and CI (--step-delay {FAST_BEAT:g}: a call takes well "
        "under a second)",
    )


def run(args: argparse.Namespace, err: TextIO | None = None) -> int:
    """Run ``kernel-ext demo`` with parsed ``args``; returns the exit code
    (:data:`EXIT_UNAVAILABLE` when the demo cannot run on this interpreter)."""
    err = err if err is not None else sys.stderr
    problem = missing_requirements(args.kernel)
    if problem is not None:
        err.write(problem + "\n")
        return EXIT_UNAVAILABLE
    from kernel_ext.demo.launcher import Options, launch

    time_limit = args.time_limit
    if time_limit is None and args.headless:
        time_limit = 60.0
    if args.step_delay is not None:
        step_delay = args.step_delay
    else:
        step_delay = FAST_BEAT if args.fast else DEFAULT_BEAT
    options = Options(
        host=args.host,
        port=args.port,
        headless=args.headless,
        redis=args.redis,
        time_limit=time_limit,
        step_delay=step_delay,
        lang=args.lang,
        kernel=args.kernel,
    )
    return launch(options, err=err)
