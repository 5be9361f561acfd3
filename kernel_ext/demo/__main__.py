"""``python -m kernel_ext.demo`` is ``kernel-ext demo``."""

from __future__ import annotations

import sys

from kernel_ext._command_line import Parser
from kernel_ext.demo import add_arguments, run

if __name__ == "__main__":
    parser = Parser(prog="python -m kernel_ext.demo")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
