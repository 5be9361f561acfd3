"""Report how the installed distributions differ from a constraints file (tox -e drift).

Usage: ``python scripts/drift.py requirements/constraints.txt``. Prints one line per pinned
distribution installed at another version (``name: pinned -> installed``) and a summary
line; exits 0 either way: drift is news, not a failure (the pinned run is the one that must
pass). Pins whose environment marker does not apply to this interpreter are skipped.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$")


def pins(path: Path) -> dict[str, str]:
    """The ``name==version`` lines of ``path`` whose marker holds here, by canonical name."""
    found: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _PIN.match(line.strip())
        if match is None:
            continue
        name, version, marker = match.groups()
        if marker and not Marker(marker).evaluate():
            continue
        found[canonicalize_name(name)] = version
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: drift.py CONSTRAINTS_FILE", file=sys.stderr)
        return 2
    pinned = pins(Path(argv[0]))
    if not pinned:
        print(f"drift: no pins read from {argv[0]}", file=sys.stderr)
        return 2
    installed = {
        canonicalize_name(dist.metadata["Name"]): dist.version for dist in metadata.distributions()
    }
    drifted = sorted(
        (name, version, installed[name])
        for name, version in pinned.items()
        if name in installed and installed[name] != version
    )
    for name, version, now in drifted:
        print(f"drift: {name}: {version} -> {now}")
    print(
        f"drift: {len(drifted)} of {len(pinned)} pinned distributions differ from the newest "
        "releases installed here"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
