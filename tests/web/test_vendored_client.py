"""The vendored official Socket.IO client (``kernel_ext/web/vendor``), read through the
installed package (``kernel_ext.web``), never a repository path: its bytes are the ones its
record names, its banner is the recorded version, its licence ships beside it, and no page
of the package loads a home-made client. No npm and no network here: the record was made
from ``npm pack socket.io-client@<version>`` (how to update it: ``kernel_ext.web``).
"""

from __future__ import annotations

import hashlib
import re

from kernel_ext.demo.web import static_root
from kernel_ext.web import ASSETS, SOCKET_IO_CLIENT, asset_path, asset_text, vendored_client

BANNER = re.compile(r"\A/\*!\n \* Socket\.IO v(\d+\.\d+\.\d+)\n")


def test_the_record_names_the_official_package_and_a_version() -> None:
    record = vendored_client()
    assert record["name"] == "socket.io-client"
    assert re.fullmatch(r"\d+\.\d+\.\d+", record["version"])
    assert record["license"] == "MIT"
    assert record["file"] == SOCKET_IO_CLIENT.rsplit("/", 1)[1]
    assert record["source"].startswith(
        f"dist/socket.io.esm.min.js of the npm package socket.io-client@{record['version']}"
    )
    assert record["packageIntegrity"].startswith("sha512-")


def test_the_vendored_file_is_the_recorded_one_byte_for_byte() -> None:
    record = vendored_client()
    data = asset_path(SOCKET_IO_CLIENT).read_bytes()
    assert hashlib.sha256(data).hexdigest() == record["sha256"]
    banner = BANNER.match(data.decode("utf-8"))
    assert banner is not None, data[:80]
    assert banner.group(1) == record["version"]


def test_it_is_the_self_contained_es_module_build_exporting_io() -> None:
    source = asset_text(SOCKET_IO_CLIENT)
    assert 40_000 < len(source.encode()) < 60_000  # the minified browser build, ~41 KB
    exports = re.search(r"export\{([^}]*)\};?\s*(//# sourceMappingURL=\S+\s*)?\Z", source)
    assert exports is not None
    assert "_t as io" in exports.group(1)
    # No import of its own: the browser needs this one file.
    assert re.search(r"(^|[;}\s])import\s*[{\"'*\w]", source) is None


def test_its_licence_ships_beside_it() -> None:
    record = vendored_client()
    licence = asset_text("vendor/" + record["licenseFile"])
    assert licence.startswith("The MIT License (MIT)")
    assert "Guillermo Rauch and Socket.IO contributors" in licence
    assert "Permission is hereby granted, free of charge" in licence


def test_it_is_one_of_the_shipped_browser_assets() -> None:
    assert SOCKET_IO_CLIENT in ASSETS
    for name in ASSETS:
        assert asset_path(name).is_file(), name


def test_no_page_loads_a_home_made_client() -> None:
    assert not (static_root() / "sio.js").exists()
    app = (static_root() / "app.js").read_text(encoding="utf-8")
    assert 'import { io } from "/vendor/socket.io.esm.min.js";' in app
    assert "sio.js" not in app
    example = asset_text("example.html")
    assert 'await import("./vendor/socket.io.esm.min.js")' in example
    assert "sio.js" not in example
