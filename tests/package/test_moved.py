"""Modules that moved keep resolving at their old import paths (``kernel_ext._moved``): the
old path is the very module at its new home, importing it warns with a
``DeprecationWarning`` that names the new home, and ``python -m <old path>`` still runs."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kernel_ext
from kernel_ext._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_home_and_warns(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    parent, _, name = old.rpartition(".")
    vars(sys.modules[parent]).pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is new
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved: import {MOVED[old]}"
    ]


def test_the_warning_points_at_the_importer() -> None:
    sys.modules.pop("kernel_ext.tap", None)
    vars(kernel_ext).pop("tap", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from kernel_ext import tap  # noqa: F401

    assert [w.filename for w in caught if w.category is DeprecationWarning] == [__file__]


def test_every_new_home_exists_and_no_old_path_is_a_file_again() -> None:
    root = Path(kernel_ext.__file__).parent.parent
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        path = root.joinpath(*old.split("."))
        assert not path.with_suffix(".py").exists(), f"{old} is a module of its own again"
        assert not path.is_dir(), f"{old} is a package of its own again"


def test_python_dash_m_of_an_old_path_runs_the_module() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-m", "kernel_ext.a2a_peer", "-h"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--delay" in done.stdout
    assert "kernel_ext.a2a_peer moved: run python -m kernel_ext.testing.a2a_peer" in done.stderr


def test_an_unknown_module_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kernel_ext.no_such_module")
