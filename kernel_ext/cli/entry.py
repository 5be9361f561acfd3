"""The ``kernel-ext`` command: ``relay``, ``tail``, ``stop``, ``demo`` and ``schema``.

Conventions of every subcommand (:mod:`kernel_ext.cli._common`): a bad command line is one line on
stderr and exit status 2, never a usage block or a traceback; ``--help`` lists every option
with its default; a command stopped by SIGINT, SIGTERM or SIGHUP, in any phase, says so in
one line on stderr and exits with 130, 143 or 129, never with a traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import sys
from collections.abc import Sequence

from kernel_ext._version import __version__
from kernel_ext.cli._common import Parser, StopSignals, run_command

PROG = "kernel-ext"


def _cmd_schema(args: argparse.Namespace) -> int:
    if args.typescript:
        from kernel_ext.web.typescript import declarations

        sys.stdout.write(declarations())
        return 0
    from kernel_ext.protocol.schema import block_json_schema

    json.dump(block_json_schema(), sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


def _version() -> str:
    """The installed distribution's version (a source tree run without installing it:
    the version it would be built with)."""
    try:
        return importlib.metadata.version("kernel-ext")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kernel-ext``; each subcommand sets ``func``."""
    # The commands are imported here, where a stop signal already ends them in one line.
    from kernel_ext import demo
    from kernel_ext.cli import relay as relay_command
    from kernel_ext.viewing import ask_stop, tail

    parser = Parser(prog=PROG, description="Live, attributed tool-call detail streams.")
    parser.add_argument("--version", action="version", version=f"kernel-ext {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    relay = sub.add_parser(
        "relay",
        help="serve the /chat relay on its own (what python -m kernel_ext.relay runs)",
        description=relay_command.DESCRIPTION,
    )
    relay_command.add_arguments(relay)
    relay.set_defaults(func=functools.partial(relay_command.run, prog=relay.prog))
    follow = sub.add_parser(
        "tail",
        help="follow a conversation's tool calls live, like tail -f",
        description="Follow a conversation's tool calls live in the terminal, like tail -f.",
    )
    tail.add_arguments(follow)
    follow.set_defaults(func=tail.run)
    halt = sub.add_parser(
        "stop",
        help="ask the relay to stop one running tool call, as its pane's stop button does",
        description="Ask the relay to stop one running tool call of a conversation, as its "
        "pane's stop button does, and print the answer in one line. Exit status: 0 stopping "
        "or already ended, 1 refused, 2 a bad command line or no relay at --url, 3 unknown "
        "call, 4 no worker reachable, 5 no usable answer.",
    )
    ask_stop.add_arguments(halt)
    halt.set_defaults(func=ask_stop.run)
    show = sub.add_parser(
        "demo",
        help="the whole path on this machine, in a browser",
        description="The whole path on this machine: colleagues, a worker, a web process.",
    )
    demo.add_arguments(show)
    show.set_defaults(func=demo.run)
    schema = sub.add_parser(
        "schema",
        help="print the JSON Schema of a tool_event_stream block",
        description="Print the JSON Schema (draft 2020-12) of a tool_event_stream block, or "
        "with --typescript the TypeScript declarations of the wire.",
    )
    schema.add_argument(
        "--typescript",
        action="store_true",
        help="print TypeScript declarations instead (the file kernel_ext/web ships as "
        "tool_event_stream.d.ts) (default: off, JSON Schema)",
    )
    schema.set_defaults(func=_cmd_schema)
    parser.set_defaults(subparsers=sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kernel-ext``; returns the process exit code."""

    def command(stop: StopSignals) -> int:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        owner = args.subparsers.get(args.command, parser)
        if extra:  # reported by the subcommand that got them, with its own usage
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        stop.prog = owner.prog
        code: int = args.func(args)
        return code

    return run_command(PROG, command)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
