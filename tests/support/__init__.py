"""The tests' helpers, one importable package: ``from support import network`` from any
folder of tests/ (pytest puts tests/ on ``sys.path`` for its conftest).

Modules, one a part of the package or a kind of test: ``network`` (ports, servers,
redis-server, Chromium, waiting for a port), ``timing`` (waiting with a deadline, a fake
clock), ``relay_helpers`` (relays in-process and as subprocesses, workers, browsers, the
hooks' environment), ``redis_helpers``, ``cli_helpers``, ``protocol_helpers``,
``stream_helpers``, ``sampling_helpers``, ``attribution_helpers``, ``a2a_helpers``,
``reliability_helpers``, ``demo_helpers``, ``bench_helpers`` (the benchmarks' figures),
``stop_calls`` and ``stop_helpers``, ``vectors`` (the shared test vectors),
``renderer_page`` and ``browser`` (pages in Chromium: what they reported, and whether
their Chinese is drawn on a machine without CJK fonts). No test module imports
another: what two test modules share lives here, and a fixture one folder shares lives in
that folder's ``conftest.py``. The other files here are scripts that tests run as
subprocesses by path (:data:`SUPPORT` / name) and the pytest probe of ``test_markers``.

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
