"""The browser side, shipped as package data: ``renderer.js`` and an example page.

``renderer.js`` is an ES module with no dependencies and no build step (the detail-pane
store and DOM renderer; same semantics as :mod:`kernel_ext.view`). ``example.html`` shows
it working without a server-side socket: it plays a scripted conversation, or, with
``?play=0``, waits for ``window.kx.store`` to be fed.

Serve :func:`web_root` as a static directory (e.g. ``StaticFiles(directory=web_root())``)
or read single files with :func:`asset_path` / :func:`asset_text`.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["ASSETS", "asset_path", "asset_text", "web_root"]

ASSETS: tuple[str, ...] = ("renderer.js", "example.html")
"""The files this package ships for browsers."""


def web_root() -> Path:
    """The directory holding :data:`ASSETS` (the installed package's own directory)."""
    return Path(str(files(__name__)))


def asset_path(name: str) -> Path:
    """The path of the shipped file ``name``; raises ``KeyError`` for a name not in
    :data:`ASSETS` (so no caller can be led outside the directory)."""
    if name not in ASSETS:
        raise KeyError(f"no web asset named {name!r}; known: {', '.join(ASSETS)}")
    return web_root() / name


def asset_text(name: str) -> str:
    """The UTF-8 text of the shipped file ``name`` (see :func:`asset_path`)."""
    return asset_path(name).read_text(encoding="utf-8")
