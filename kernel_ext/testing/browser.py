"""Driving the reference renderer in a real browser: Chromium's launch flags and a directory
(the package's web directory, say) served on 127.0.0.1. For tests and checks that open
``renderer.js`` in headless Chromium through Playwright (the test suite,
``scripts/otel_backend_check.py``); nothing in the library imports it."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["CHROMIUM_ARGS", "serve_directory"]

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""Launch flags for Debian's chromium under Playwright (``executable_path``), as root in CI."""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve_directory(directory: str | os.PathLike[str]) -> Iterator[str]:
    """Serve the files of ``directory`` over HTTP on 127.0.0.1 (a free port, a thread) for
    the duration; yields the base URL. Stopped, and its thread joined, on exit."""
    handler = functools.partial(_QuietHandler, directory=os.fspath(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
