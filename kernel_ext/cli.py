"""The ``kernel-ext`` command: ``schema``, ``tail`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kernel_ext import demo, tail
from kernel_ext.protocol import block_json_schema


def _cmd_schema(args: argparse.Namespace) -> int:
    json.dump(block_json_schema(), sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kernel-ext``; each subcommand sets ``func``."""
    parser = argparse.ArgumentParser(
        prog="kernel-ext", description="Live, attributed tool-call detail streams."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    schema = sub.add_parser("schema", help="print the JSON Schema of a tool_event_stream block")
    schema.set_defaults(func=_cmd_schema)
    follow = sub.add_parser("tail", help="follow a conversation's tool calls live, like tail -f")
    tail.add_arguments(follow)
    follow.set_defaults(func=tail.run)
    show = sub.add_parser("demo", help="the whole path on this machine, in a browser")
    demo.add_arguments(show)
    show.set_defaults(func=demo.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kernel-ext``; returns the process exit code."""
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
