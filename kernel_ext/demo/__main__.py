"""``python -m kernel_ext.demo`` is ``kernel-ext demo``."""

from __future__ import annotations

import argparse
import sys

from kernel_ext.demo import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m kernel_ext.demo")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
