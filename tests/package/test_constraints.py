"""The test environments are reproducible: every install takes the tested versions.

``requirements/constraints.txt`` (written by ``tox -e lock``) pins every dependency of every
extra and every tool for each supported Python; ``tox.ini`` gives it to every environment's
installs and ``.ci/run`` installs tox from it; ``tox -e drift`` tries the newest releases.
"""

from __future__ import annotations

import configparser
import re
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
TOOLS = ROOT / "requirements" / "tools.in"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$")


def _environment(python: str) -> dict[str, str]:
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "platform_machine": "x86_64",
        "extra": "",
    }


def _pins(python: str) -> dict[str, str]:
    env = _environment(python)
    found: dict[str, str] = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        match = _PIN.match(line.strip())
        if match is None:
            continue
        name, version, marker = match.groups()
        if marker and not Marker(marker).evaluate(env):
            continue
        found[canonicalize_name(name)] = version
    return found


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    texts = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        texts.extend(extra)
    texts.extend(
        line.strip()
        for line in TOOLS.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    return [
        req
        for req in map(Requirement, texts)
        if canonicalize_name(req.name) != canonicalize_name(project["name"])
    ]


@pytest.mark.parametrize("python", PYTHONS)
def test_every_requirement_is_pinned_to_a_version_it_admits(python: str) -> None:
    pins = _pins(python)
    env = _environment(python)
    checked = 0
    for req in _requirements():
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} is not pinned for Python {python}: run tox -e lock"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} (pinned for Python {python}) does not satisfy {req}: "
            "run tox -e lock"
        )
        checked += 1
    assert checked > 20


def test_the_pins_are_exact_and_name_no_path() -> None:
    text = CONSTRAINTS.read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines
    for line in lines:
        assert _PIN.match(line.strip()), f"not an exact pin: {line!r}"
    assert "/tmp" not in text
    assert str(Path.home()) not in text


def test_every_tox_environment_installs_under_the_constraints() -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini", encoding="utf-8")
    set_env = tox["testenv"]["set_env"]
    assert "PIP_CONSTRAINT = {toxinidir}/requirements/constraints.txt" in set_env
    for section in tox.sections():
        if not section.startswith("testenv:") or "set_env" not in tox[section]:
            continue
        own = tox[section]["set_env"]
        if section in ("testenv:lock", "testenv:drift"):
            # The two that must not be constrained: one writes the pins, one tries past them.
            assert re.search(r"^\s*PIP_CONSTRAINT =\s*$", own, re.M), section
        else:
            assert "{[testenv]set_env}" in own or "PIP_CONSTRAINT" in own, section


def test_ci_installs_tox_from_the_constraints_and_runs_drift_without_failing() -> None:
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "pip install -q -c requirements/constraints.txt tox" in run
    assert re.search(r"if ! python3 -m tox -e drift; then", run)
