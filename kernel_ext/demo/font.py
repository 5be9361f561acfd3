"""The demo page's own CJK web font: which characters it must hold, where it lives.

A machine without CJK fonts shows Chinese as empty boxes. The demo page therefore ships a
subset of Noto Sans CJK SC (SIL Open Font License 1.1; ``static/fonts/OFL.txt``) holding
exactly the CJK characters the page can show of its own: the demo's words
(:mod:`kernel_ext.demo.script`), the colleagues' scripts (:mod:`kernel_ext.demo.colleague_server`),
the page's script and the renderer's labels (``renderer.js``). ``app.css`` declares it as
:data:`FONT_FAMILY` for :data:`UNICODE_RANGES` only, after every other face of the page's font
stack: a machine's own CJK faces win, Latin text never uses it, and a page without a character
in those ranges (the English page) never loads it. Text the user types may hold characters
outside the subset; those fall back to the machine's fonts.

``scripts/demo_font.py`` makes the subset from the source font and records it in
``static/fonts/font.json`` (source, version, sha256, characters); a test fails when a
character of :func:`page_characters` is missing from the shipped file.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path

__all__ = [
    "FONT_FAMILY",
    "FONT_FILE",
    "TEXT_SOURCES",
    "UNICODE_RANGES",
    "characters_of",
    "font_dir",
    "page_characters",
    "unicode_range_css",
]

FONT_FAMILY = "kernel_ext demo CJK"
"""The ``font-family`` name ``app.css`` gives the subset."""

FONT_FILE = "noto-sans-sc-demo.woff2"
"""The subset's file name in :func:`font_dir`."""

UNICODE_RANGES: tuple[tuple[int, int], ...] = (
    (0x2E80, 0x2FDF),  # CJK radicals
    (0x3000, 0x303F),  # CJK symbols and punctuation
    (0x3400, 0x4DBF),  # CJK unified ideographs, extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFE30, 0xFE4F),  # CJK compatibility forms
    (0xFF00, 0xFFEF),  # half- and full-width forms (，：（）？)
)
"""The code points the font is for (inclusive bounds): its ``@font-face`` ``unicode-range``."""

TEXT_SOURCES: tuple[tuple[str, str], ...] = (
    ("kernel_ext.demo", "script.py"),
    ("kernel_ext.demo", "colleague_server.py"),
    ("kernel_ext.demo", "static/app.js"),
    ("kernel_ext.demo", "static/index.html"),
    ("kernel_ext.web", "renderer.js"),
)
"""The package files whose text the page shows (package, path)."""


def font_dir() -> Path:
    """The directory of the font, its licence and its record (package data)."""
    return Path(str(files("kernel_ext.demo") / "static" / "fonts"))


def characters_of(texts: Iterable[str]) -> str:
    """Every character of :data:`UNICODE_RANGES` in ``texts``, sorted, once each."""
    found: set[str] = set()
    for text in texts:
        found.update(
            char for char in text if any(low <= ord(char) <= high for low, high in UNICODE_RANGES)
        )
    return "".join(sorted(found))


def page_characters() -> str:
    """:func:`characters_of` the files of :data:`TEXT_SOURCES`: what the subset must hold."""
    return characters_of(
        (files(package) / path).read_text(encoding="utf-8") for package, path in TEXT_SOURCES
    )


def unicode_range_css() -> str:
    """:data:`UNICODE_RANGES` as a CSS ``unicode-range`` value."""
    return ", ".join(f"U+{low:04X}-{high:04X}" for low, high in UNICODE_RANGES)
