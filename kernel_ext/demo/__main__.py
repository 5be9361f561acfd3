"""``python -m kernel_ext.demo`` is ``kernel-ext demo``."""

from __future__ import annotations

import sys

from kernel_ext.cli._common import Parser, StopSignals, run_command
from kernel_ext.demo import add_arguments, run

PROG = "python -m kernel_ext.demo"


def _command(stop: StopSignals) -> int:
    parser = Parser(prog=PROG)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(run_command(PROG, _command))
