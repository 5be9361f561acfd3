"""The tests' helpers, one importable package: ``from support import network`` from any
folder of tests/ (pytest puts tests/ on ``sys.path`` for its conftest).

Modules: ``network`` (ports, servers, Chromium, waiting for a port), ``timing`` (waiting
with a deadline, a fake clock), ``relay_helpers``, ``reliability_support`` and
``attribution_support``. The other files here are scripts that tests run as subprocesses
by path (:data:`SUPPORT` / name) and the pytest probe of ``test_markers``.

benchmarks/ (:data:`BENCHMARKS`) is put on ``sys.path`` here, once: ``network`` is built on
its process plumbing (``processes``), and tests/bench/ imports the benchmark modules by
their bare names (``import bench_scale``).
"""

from __future__ import annotations

import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
"""This folder: where the subprocess scripts and ``relay_cli_hooks`` live."""
TESTS = SUPPORT.parent
"""tests/: where ``js/`` and ``vectors/`` live."""
ROOT = TESTS.parent
"""The repository's root."""
BENCHMARKS = ROOT / "benchmarks"
"""benchmarks/: the benchmark modules and the process plumbing they share with the tests."""

if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))
