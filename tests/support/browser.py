"""Test helpers for pages in Chromium (Playwright): what a page reported."""

from __future__ import annotations

from typing import Any


class Console:
    """What a page reported: console errors and uncaught exceptions."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.exceptions: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda error: self.exceptions.append(str(error)))

    def _on_console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)
