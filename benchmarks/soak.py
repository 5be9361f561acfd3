"""Run the reliability suite at soak scale and print its figures (docs/reliability.md).

Usage::

    python benchmarks/soak.py                      # soak scale; figures to artifacts/
    python benchmarks/soak.py --render FILE        # only print the table of a report
    python benchmarks/soak.py -- -k frozen         # pass pytest arguments after --
    tox -e soak

Not a ``bench_*`` module: ``benchmarks/run.py`` does not pick it up. It runs pytest on the
reliability suite (tests/reliability/) and the terminal-edge tests (test_size_bound.py,
test_closed_streams.py, test_sampling.py, test_shutdown.py, test_fork.py) with the scale
variables below set, unless the environment sets them already; every scenario appends one
JSON line of figures to the report (``KERNEL_EXT_RELIABILITY_REPORT``), which is then
printed as a Markdown table with the machine and the date, ready for docs/reliability.md.

=================================  ========  ====================================
variable                           soak      what
=================================  ========  ====================================
``KERNEL_EXT_RELIABILITY_RUNS``    20        repetitions of each fault scenario
``KERNEL_EXT_SOAK_CALLS``          100000    tool calls through the whole path
``KERNEL_EXT_FLOOD_STREAMS``       1000      concurrent flooded streams
``KERNEL_EXT_FLOOD_SECONDS``       3         seconds each flood lasts
``KERNEL_EXT_FUZZ_EXAMPLES``       2000      hypothesis examples per fuzz test
=================================  ========  ====================================

Without them (the default test run, CI) the suite runs at 3 runs, 2,000 calls, 100 streams
for 1.5 s and 100 examples. The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPORT = ROOT / "artifacts" / "reliability-soak.jsonl"
SUITE = [
    "tests/reliability/test_reliability_faults.py",
    "tests/reliability/test_reliability_redis.py",
    "tests/reliability/test_reliability_workers.py",
    "tests/reliability/test_reliability_load.py",
    "tests/reliability/test_fuzz.py",
    "tests/reliability/test_intruders.py",
    "tests/reliability/test_hostile.py",
    "tests/stream/test_size_bound.py",
    "tests/attribution/test_sampling.py",
    "tests/emit/test_shutdown.py",
    "tests/stream/test_closed_streams.py",
    "tests/emit/test_fork.py",
]
SOAK_SCALE = {
    "KERNEL_EXT_RELIABILITY_RUNS": "20",
    "KERNEL_EXT_SOAK_CALLS": "100000",
    "KERNEL_EXT_FLOOD_STREAMS": "1000",
    "KERNEL_EXT_FLOOD_SECONDS": "3",
    "KERNEL_EXT_FUZZ_EXAMPLES": "2000",
}


def machine() -> str:
    cpus = os.cpu_count() or 0
    return (
        f"{platform.system()} {platform.machine()}, {cpus} CPUs, Python {platform.python_version()}"
    )


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in sorted(value.items())) or "none"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def render(report: Path) -> str:
    """The report as one Markdown table: scenario, then its figures."""
    lines = [
        f"Measured {datetime.date.today().isoformat()} on {machine()}.",
        "",
        "| scenario | figures |",
        "|---|---|",
    ]
    for raw in report.read_text(encoding="utf-8").splitlines():
        row = json.loads(raw)
        scenario = row.pop("scenario")
        row.pop("python", None)
        figures = "; ".join(f"{k.replace('_', ' ')}: {_cell(v)}" for k, v in row.items())
        lines.append(f"| {scenario} | {figures} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/soak.py", description=__doc__)
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT)
    parser.add_argument("--render", type=Path, help="only print the table of this report")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    if args.render is not None:
        print(render(args.render))
        return 0
    env = dict(os.environ)
    for name, value in SOAK_SCALE.items():
        env.setdefault(name, value)
    report = args.report.resolve()
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)
    env["KERNEL_EXT_RELIABILITY_REPORT"] = str(report)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *SUITE]
    status = subprocess.call([*command, *args.pytest_args], cwd=ROOT, env=env)
    if report.exists():
        print()
        print(render(report))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
