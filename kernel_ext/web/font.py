"""The shipped CJK web font: which characters it must hold, where it lives.

A machine without CJK fonts shows Chinese as empty boxes. The package therefore ships a
subset of Noto Sans CJK SC (SIL Open Font License 1.1; ``fonts/OFL.txt``) holding exactly
the CJK characters its pages can show of their own (:func:`page_characters`): the renderer's
labels in every language (``renderer.js``), the example page (``example.html``) and the
demo's words (:mod:`kernel_ext.demo.script`, the colleagues' scripts of
:mod:`kernel_ext.demo.colleague_server`, the page's script), its language switch included.
Text a page gets from elsewhere (peers, what the user types) may hold characters outside
the subset; those fall back to the machine's fonts.

``renderer.js``'s font stacks (``--kx-font``, ``--kx-mono``) end with :data:`FONT_FAMILY`, so a
page that declares the face — ``@font-face`` with :data:`FONT_FAMILY`, the file
:data:`FONT_PATH` (relative to :func:`kernel_ext.web.web_root`) and ``unicode-range``
:func:`unicode_range_css` — shows the panes' labels on any machine; the example page and the
demo's page do, and load it whatever their language (the demo's switch always shows both
languages' names). A machine's own CJK faces come first; Latin text never uses it.

``scripts/cjk_font.py`` makes the subset from the source font and records it in
``fonts/font.json`` (source, version, sha256, characters); a test fails when a character of
:func:`page_characters` is missing from the shipped file.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path

__all__ = [
    "FONT_FAMILY",
    "FONT_FILE",
    "FONT_LICENCE",
    "FONT_PATH",
    "TEXT_SOURCES",
    "UNICODE_RANGES",
    "characters_of",
    "font_dir",
    "page_characters",
    "unicode_range_css",
]

FONT_FAMILY = "kernel_ext CJK"
"""The ``font-family`` name the pages give the subset: the last of ``renderer.js``'s stacks."""

FONT_FILE = "noto-sans-sc-subset.woff2"
"""The subset's file name in :func:`font_dir`."""

FONT_PATH = f"fonts/{FONT_FILE}"
"""The subset's path relative to :func:`kernel_ext.web.web_root` (and to the pages' URLs)."""

FONT_LICENCE = "fonts/OFL.txt"
"""The subset's licence, relative to :func:`kernel_ext.web.web_root`; served beside it."""

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
    ("kernel_ext.web", "renderer.js"),
    ("kernel_ext.web", "example.html"),
    ("kernel_ext.demo", "script.py"),
    ("kernel_ext.demo", "colleague_server.py"),
    ("kernel_ext.demo", "static/app.js"),
    ("kernel_ext.demo", "static/index.html"),
)
"""The package files whose text the pages show (package, path)."""


def font_dir() -> Path:
    """The directory of the font, its licence and its record (package data)."""
    return Path(str(files("kernel_ext.web") / "fonts"))


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
