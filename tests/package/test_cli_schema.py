"""`kernel-ext schema` prints the block's JSON Schema for the front-end team."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kernel_ext.cli.entry import main
from kernel_ext.protocol.schema import block_json_schema


def test_schema_command_prints_the_block_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == block_json_schema()
    assert printed["properties"]["callId"]["anyOf"][0]["pattern"] == "^[0-9a-f]{16}$"


def test_console_script_is_installed_and_runs() -> None:
    exe = shutil.which("kernel-ext")
    cmd = [exe, "schema"] if exe else [sys.executable, "-m", "kernel_ext.cli.entry", "schema"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout
    assert json.loads(out)["title"] == "tool_event_stream block"
