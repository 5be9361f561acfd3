"""The browser renderer (kernel_ext/web/renderer.js) under node's test runner.

tests/js/renderer.test.mjs runs every conformance vector in tests/vectors through the
renderer's store; this module runs it with ``node --test`` and checks that the renderer's
labels are the Python reducer's.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from support import ROOT
from support.network import need_binary

from kernel_ext.protocol import STOP_ANSWERS
from kernel_ext.viewing.view import LABELS, MAX_JOIN_STREAMS
from kernel_ext.web import ASSETS, asset_path, asset_text, web_root

JS_TEST = ROOT / "tests" / "js" / "renderer.test.mjs"


def test_renderer_passes_every_vector_under_node() -> None:
    node = need_binary("node", "NODE")
    result = subprocess.run(
        [node, "--test", "--test-reporter=tap", str(JS_TEST)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    vectors = len(list((ROOT / "tests" / "vectors").glob("*.json")))
    passed = [line for line in result.stdout.splitlines() if line.startswith("# pass ")]
    assert passed, report
    # One test per vector plus the renderer's own checks: a vector silently skipped fails.
    assert int(passed[0].split()[-1]) > vectors, report
    assert "# fail 0" in result.stdout, report


def exported(name: str) -> object:
    """The value of renderer.js's export ``name``, through JSON, as node reads the module."""
    node = need_binary("node", "NODE")
    script = (
        f"import {{ {name} }} from {json.dumps(asset_path('renderer.js').as_uri())};"
        f"console.log(JSON.stringify({name}));"
    )
    result = subprocess.run(
        [node, "--input-type=module", "-e", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_renderer_labels_are_the_python_labels() -> None:
    assert exported("LABELS") == LABELS


def test_renderer_join_bound_is_the_python_bound() -> None:
    assert exported("MAX_JOIN_STREAMS") == MAX_JOIN_STREAMS


def test_renderer_stop_answers_are_the_protocols() -> None:
    assert exported("STOP_ANSWERS") == list(STOP_ANSWERS)


def test_web_assets_are_locatable_in_the_installed_package() -> None:
    for name in ASSETS:
        assert asset_path(name).is_file(), name
        assert asset_path(name) == web_root() / name  # inside the web directory
    assert "export class PaneStore" in asset_text("renderer.js")
    assert "./renderer.js" in asset_text("example.html")
    with pytest.raises(KeyError, match="no web asset"):
        asset_path("../view.py")
