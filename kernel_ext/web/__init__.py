"""The browser side, shipped as package data: ``renderer.js``, an example page, and the
official Socket.IO client.

``renderer.js`` is an ES module with no dependencies and no build step (the detail-pane
store and DOM renderer; same semantics as :mod:`kernel_ext.view`). ``example.html`` shows
it working: it plays a scripted conversation; with ``?conversation=ID`` it follows that
conversation through the ``/chat`` relay of the server it came from, on the vendored
client; with ``?play=0`` it waits for ``window.kx.store`` to be fed.

``vendor/socket.io.esm.min.js`` is the official JavaScript client, ``socket.io-client``'s
browser ES-module build (exports ``io``), byte for byte as published, with its licence
(``vendor/LICENSE``, MIT) and its record (``vendor/vendor.json``: name, version, source,
sha256; :func:`vendored_client`). To update it: ``npm pack socket.io-client@<version>``,
copy ``package/dist/socket.io.esm.min.js`` and ``package/LICENSE`` here and write the new
version, sha256 and package integrity into ``vendor.json`` (``tests/test_vendored_client.py``
checks them). Nothing needs npm at run or test time.

Serve :func:`web_root` as a static directory (e.g. ``StaticFiles(directory=web_root())``)
or read single files with :func:`asset_path` / :func:`asset_text`.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

__all__ = [
    "ASSETS",
    "SOCKET_IO_CLIENT",
    "asset_path",
    "asset_text",
    "vendored_client",
    "web_root",
]

SOCKET_IO_CLIENT = "vendor/socket.io.esm.min.js"
"""The official Socket.IO client (ES module exporting ``io``), relative to :func:`web_root`."""

ASSETS: tuple[str, ...] = ("renderer.js", "example.html", SOCKET_IO_CLIENT, "vendor/LICENSE")
"""The files this package ships for browsers (the client's licence with it), relative to
:func:`web_root`."""


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


def vendored_client() -> dict[str, str]:
    """The record of the vendored Socket.IO client (``vendor/vendor.json``): ``name``,
    ``version``, ``license``, ``source``, ``sha256`` of :data:`SOCKET_IO_CLIENT`, …"""
    record = json.loads((web_root() / "vendor" / "vendor.json").read_text(encoding="utf-8"))
    return {str(key): str(value) for key, value in record.items()}
