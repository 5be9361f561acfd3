"""The benchmark runner (benchmarks/run.py) works: report rows and a --quick --only run.

No timing is asserted: the trivial benchmark below reports fixed figures.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest
from support import ROOT

RUNNER = ROOT / "benchmarks" / "run.py"


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernel_ext_bench_run", RUNNER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_missed_ceiling_is_marked_miss_with_the_gap(runner: ModuleType) -> None:
    figure = runner.Figure(name="wrapped call", value=1.5, unit="x", target=1.1, ok=False)
    row = runner.format_row(figure)
    assert "**MISS**" in row
    assert "≤ 1.1×" in row
    assert "misses by 0.4× (36%)" in row


def test_a_met_floor_is_marked_pass_with_its_headroom(runner: ModuleType) -> None:
    figure = runner.Figure(name="relay throughput", value=1.2, unit="x", target=1.0, ok=True)
    row = runner.format_row(figure)
    assert "| PASS |" in row
    assert "≥ 1×" in row
    assert "0.2× headroom (20%)" in row


def test_a_missed_floor_reads_as_a_floor(runner: ModuleType) -> None:
    figure = runner.Figure(name="relay throughput", value=0.8, unit="x", target=1.0, ok=False)
    assert runner.format_target(figure) == "≥ 1×"
    assert runner.margin(figure) == "misses by 0.2× (20%)"


def test_information_and_unmeasured_figures_have_no_verdict(runner: ModuleType) -> None:
    info = runner.Figure(name="resolve (info)", value=0.2, unit="µs")
    absent = runner.Figure(name="vs LangGraph", value=None, unit="x", target=1.0, ok=None)
    assert runner.verdict(info) == "info"
    assert runner.verdict(absent) == "not measured"
    assert runner.margin(absent) == ""
    assert "| — |" in runner.format_row(absent)


def test_report_states_the_machine_the_summary_and_the_method(runner: ModuleType) -> None:
    result = runner.ModuleResult(
        name="demo",
        path="benchmarks/bench_demo.py",
        method="Timed side by side.",
        figures=[
            runner.Figure(name="fast", value=0.5, unit="x", target=1.0, ok=True),
            runner.Figure(
                name="slow", value=3.0, unit="µs", target=2.0, ok=False, profile_path="p/x.txt"
            ),
        ],
    )
    text = runner.render_report(
        [result], {"CPU": "test CPU, 2 cores", "load average at start": "1.00"}, quick=True
    )
    assert "| CPU | test CPU, 2 cores |" in text
    assert "1 of 2 targets met, 1 missed" in text
    assert "- slow: 3 µs against ≤ 2 µs, misses by 1 µs (50%) ([profile](p/x.txt))." in text
    assert "Timed side by side." in text


TRIVIAL = textwrap.dedent(
    '''
    """A trivial benchmark for the runner's test."""

    from typing import Any


    def run(quick: bool = False) -> list[dict[str, Any]]:
        return [
            {"name": "quick flag seen", "value": 1.0 if quick else 2.0, "unit": "x",
             "target": 1.5, "ok": quick, "detail": "fixed"},
            {"name": "always over", "value": 3.0, "unit": "µs", "target": 2.0, "ok": False,
             "detail": "fixed"},
        ]
    '''
)


def test_quick_only_runs_one_module_in_a_child_and_writes_the_report(
    runner: ModuleType, tmp_path: Path
) -> None:
    bench_dir = tmp_path / "benchmarks"
    bench_dir.mkdir()
    (bench_dir / "bench_trivial.py").write_text(TRIVIAL)
    (bench_dir / "bench_other.py").write_text("raise SystemExit('must not be imported')\n")
    output = tmp_path / "docs" / "performance.md"
    code = runner.main(
        [
            "--quick",
            "--only",
            "bench_trivial",
            "--bench-dir",
            str(bench_dir),
            "--output",
            str(output),
            "--no-profile",
        ]
    )
    assert code == 0
    text = output.read_text()
    assert "Mode: quick" in text
    assert "only trivial" in text
    assert "| quick flag seen | 1× | ≤ 1.5× | PASS |" in text
    assert "| always over | 3 µs | ≤ 2 µs | **MISS** | misses by 1 µs (50%) | fixed |" in text
    assert "A trivial benchmark for the runner's test." in text
    assert "bench_other" not in text


def test_an_unknown_module_is_refused(runner: ModuleType, tmp_path: Path) -> None:
    assert runner.main(["--only", "nope", "--bench-dir", str(tmp_path)]) == 2


SECTIONED = textwrap.dedent(
    '''
    """A benchmark with tables and a plot under its figures."""
    import os
    from pathlib import Path

    TIMEOUT = 33.5


    def run():
        plots = Path(os.environ["KERNEL_EXT_BENCH_PLOTS"])
        plots.mkdir(parents=True, exist_ok=True)
        (plots / "curve.svg").write_text("<svg/>")
        return [{"name": "one point", "value": 1.2, "unit": "×", "target": 1.0, "ok": True}]


    def sections():
        return "#### Curve\\n\\n| x | y |\\n|---|---|\\n| 1 | 2 |\\n\\n![curve](plots/curve.svg)"
    '''
)


def test_a_module_s_sections_and_plots_go_beside_its_figures(
    runner: ModuleType, tmp_path: Path
) -> None:
    bench_dir = tmp_path / "benchmarks"
    bench_dir.mkdir()
    (bench_dir / "bench_curves.py").write_text(SECTIONED)
    output = tmp_path / "docs" / "performance.md"
    args = ["--quick", "--only", "curves", "--bench-dir", str(bench_dir), "--output", str(output)]
    assert runner.main([*args, "--no-profile"]) == 0
    text = output.read_text()
    figures = text.index("| one point | 1.2× |")
    table = text.index("| 1 | 2 |")
    method = text.index("A benchmark with tables")
    assert figures < table < method  # the module's tables sit between its figures and method
    assert "![curve](plots/curve.svg)" in text
    assert (output.parent / "plots" / "curve.svg").read_text() == "<svg/>"


def test_a_module_may_declare_its_own_time_limit(runner: ModuleType, tmp_path: Path) -> None:
    declared = tmp_path / "bench_slow.py"
    declared.write_text("import os\nTIMEOUT = 1_500.0\n\n\ndef run():\n    return []\n")
    assert runner.module_timeout(declared, 420.0) == 1500.0
    for body in ("TIMEOUT = 'long'\n", "TIMEOUT = -1\n", "TIMEOUT = True\n", "X = 5\n", "def ("):
        other = tmp_path / "bench_other.py"
        other.write_text(body)
        assert runner.module_timeout(other, 420.0) == 420.0, body
    assert runner.module_timeout(tmp_path / "missing.py", 7.0) == 7.0


def test_a_miss_measured_in_other_processes_is_not_profiled(
    runner: ModuleType, tmp_path: Path
) -> None:
    raw = {"name": "far away", "value": 0.9, "unit": "×", "target": 1.0, "ok": False}
    figure = runner.Figure.from_dict({**raw, "profile": False})
    assert figure.profile == ""
    result = runner.ModuleResult("elsewhere", "benchmarks/bench_elsewhere.py", figures=[figure])
    # no bench_elsewhere.py exists: a profile attempt would fail and say so on stderr
    runner.profile_misses([result], tmp_path, tmp_path / "profiles", time.monotonic() + 60)
    assert figure.profile_path is None
    assert not (tmp_path / "profiles").exists()
    assert runner.Figure.from_dict(raw).profile is None  # the default: profiled


def test_the_soak_runs_test_files_that_exist() -> None:
    # benchmarks/soak.py (tox -e soak) names its suite by path: a moved test file would
    # leave the soak running nothing of it.
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None
    assert spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    assert soak.SUITE
    for path in soak.SUITE:
        assert (ROOT / path).is_file(), path
