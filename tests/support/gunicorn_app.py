"""A WSGI application that enables kernel_ext at import, for tests/emit/test_fork.py under
``gunicorn --preload`` (the import, and ``enable()``, happen in the master; the workers that
serve the requests are forked from it). Never imported by tests.

``GET /call/<index>`` runs one tool call (two running blocks and a ``done`` terminal) in the
conversation ``KERNEL_EXT_TEST_CONV`` and answers ``<call id> <pid>``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import kernel_ext
from kernel_ext import ToolCall, use_tool_call

kernel_ext.enable(
    relay_url=os.environ["KERNEL_EXT_TEST_RELAY"],
    secret=os.environ["KERNEL_EXT_SECRET"],
    emitter_options={"reconnect_delay": 0.05, "reconnect_delay_max": 0.5},
)
CONV = os.environ["KERNEL_EXT_TEST_CONV"]


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    index = int(environ["PATH_INFO"].rsplit("/", 1)[-1])
    call_id = f"6c{index:014x}"
    with use_tool_call(ToolCall(call_id, "ask_colleague", CONV)):
        kernel_ext.publish("step one", task_id="t")
        kernel_ext.publish("step two", task_id="t")
        kernel_ext.publish(f"answer {index}", task_id="t", state="done")
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [f"{call_id} {os.getpid()}".encode()]
