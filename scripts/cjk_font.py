"""Make the pages' CJK subset font: ``kernel_ext/web/fonts/``.

The font holds exactly :func:`kernel_ext.web.font.page_characters` — every CJK character of
the renderer's labels, the example page, the demo's words, the colleagues' scripts and the
demo page's script — cut from Noto Sans CJK SC Regular (SIL Open Font License 1.1) with
fontTools, as WOFF2.
It writes the font and its record, ``font.json`` (the source's name, version and sha256,
the subset's sha256, the fontTools version and options, the characters). The licence,
``OFL.txt``, is the source's and does not change.

Run it after adding or changing Chinese text a page shows (a test fails until you do)::

    pip install 'fonttools[woff]'
    apt-get download fonts-noto-cjk && dpkg-deb -x fonts-noto-cjk_*.deb noto  # no install
    python scripts/cjk_font.py \\
        --source noto/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc \\
        --origin "Debian package fonts-noto-cjk 1:20220127+repack1-1"

``--source`` may be the collection (``.ttc``: the face named ``--face`` is taken) or a single
``.otf``/``.ttf`` of Noto Sans CJK SC or Source Han Sans SC.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

from fontTools import subset, version
from fontTools.ttLib import TTCollection, TTFont

from kernel_ext.web.font import FONT_FAMILY, FONT_FILE, font_dir, page_characters

RECORD = "font.json"
NAME_IDS = [0, 1, 2, 3, 4, 5, 6, 7, 13, 14]  # copyright, names, version, licence and its URL


def _face(source: Path, face: str) -> TTFont:
    if source.suffix.lower() in (".ttc", ".otc"):
        for font in TTCollection(str(source)).fonts:
            if font["name"].getDebugName(1) == face:
                return font
        raise SystemExit(f"{source} has no face named {face!r}")
    font = TTFont(str(source))
    if font["name"].getDebugName(1) != face:
        raise SystemExit(f"{source} is {font['name'].getDebugName(1)!r}, not {face!r}")
    return font


def options() -> subset.Options:
    """The subsetter's options: WOFF2, no hinting, the names that carry the licence."""
    chosen = subset.Options()
    chosen.flavor = "woff2"
    chosen.hinting = False
    chosen.desubroutinize = True
    chosen.name_IDs = NAME_IDS
    chosen.notdef_outline = True
    return chosen


def make(source: Path, face: str, origin: str, out_dir: Path) -> dict[str, Any]:
    """Write the subset and its record into ``out_dir``; the record."""
    text = page_characters()
    font = _face(source, face)
    missing = [char for char in text if ord(char) not in font.getBestCmap()]
    if missing:
        raise SystemExit(f"{face} has no glyph for {''.join(missing)!r}")
    chosen = options()
    subsetter = subset.Subsetter(chosen)
    subsetter.populate(text=text)
    subsetter.subset(font)
    buffer = io.BytesIO()
    font.flavor = "woff2"
    font.recalcTimestamp = False  # the same source and characters give the same bytes
    font.save(buffer)
    data = buffer.getvalue()
    (out_dir / FONT_FILE).write_bytes(data)
    record = {
        "name": f"{face} Regular, subset for kernel_ext's pages",
        "family": FONT_FAMILY,
        "license": "OFL-1.1",
        "licenseFile": "OFL.txt",
        "file": FONT_FILE,
        "sha256": hashlib.sha256(data).hexdigest(),
        "source": {
            "face": face,
            "version": font["name"].getDebugName(5),
            "file": source.name,
            "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
            "origin": origin,
            "upstream": "https://github.com/notofonts/noto-cjk",
        },
        "subset": {
            "tool": f"fontTools {version} (scripts/cjk_font.py)",
            "options": {
                "flavor": "woff2",
                "hinting": False,
                "desubroutinize": True,
                "name_IDs": NAME_IDS,
                "text": "kernel_ext.web.font.page_characters()",
            },
        },
        "characters": text,
    }
    (out_dir / RECORD).write_text(
        json.dumps(record, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/cjk_font.py")
    parser.add_argument("--source", type=Path, required=True, help="the source font file")
    parser.add_argument("--face", default="Noto Sans CJK SC", help="the face to take")
    parser.add_argument("--origin", required=True, help="where the source file came from")
    parser.add_argument("--out", type=Path, default=None, help="the output directory")
    args = parser.parse_args(argv)
    record = make(args.source, args.face, args.origin, args.out or font_dir())
    size = len((args.out or font_dir()).joinpath(FONT_FILE).read_bytes())
    sys.stdout.write(f"{FONT_FILE}: {len(record['characters'])} characters, {size} bytes\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
