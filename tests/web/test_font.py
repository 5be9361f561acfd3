"""The pages' own CJK font (:mod:`kernel_ext.web.font`): it ships with its licence and
record, and holds every CJK character the pages can show of their own — so a new Chinese
word in the renderer's labels, the example page, the demo or the colleagues' scripts fails
here until ``scripts/cjk_font.py`` made the subset again. Both pages declare it alike and
the renderer's font stacks end with it. Chromium drawing it on a machine without CJK fonts
is in ``tests/demo/test_demo_browser.py`` and ``tests/web/test_example_fonts_browser.py``."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest
from fontTools.ttLib import TTFont
from support import ROOT

from kernel_ext.demo.script import LANGS, wording
from kernel_ext.demo.web import static_root
from kernel_ext.viewing.view import LABELS
from kernel_ext.web import ASSETS, asset_text
from kernel_ext.web.font import (
    FONT_FAMILY,
    FONT_FILE,
    FONT_LICENCE,
    FONT_PATH,
    UNICODE_RANGES,
    characters_of,
    font_dir,
    page_characters,
    unicode_range_css,
)


def _record() -> dict[str, Any]:
    return json.loads((font_dir() / "font.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def test_the_font_ships_as_package_data_with_its_licence_and_record() -> None:
    record = _record()
    data = (font_dir() / FONT_FILE).read_bytes()
    assert record["file"] == FONT_FILE
    assert record["family"] == FONT_FAMILY
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    assert record["license"] == "OFL-1.1"
    licence = (font_dir() / record["licenseFile"]).read_text(encoding="utf-8")
    assert "SIL OPEN FONT LICENSE Version 1.1 - 26 February 2007" in licence
    assert "Copyright 2014-2021 Adobe" in licence
    assert f"The subset {FONT_FILE} is a Modified Version" in licence
    assert record["source"]["face"] == "Noto Sans CJK SC"
    assert re.fullmatch(r"[0-9a-f]{64}", record["source"]["sha256"])
    assert data[:4] == b"wOF2"
    assert len(data) < 80_000  # a subset: tens of KB, not the source's megabytes


def test_the_font_holds_every_cjk_character_the_page_can_show() -> None:
    font = TTFont(str(font_dir() / FONT_FILE))
    cmap = font.getBestCmap()
    needed = page_characters()
    assert "订" in needed
    assert "已结束"[0] in needed
    assert [char for char in needed if ord(char) not in cmap] == []
    assert _record()["characters"] == needed  # the record says what the subset was made for
    # Its names keep the source's copyright and licence (OFL: in every copy).
    names = font["name"]
    assert "Adobe" in names.getDebugName(0)
    assert "SIL Open Font License" in names.getDebugName(13)


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("\u4e00\u9fff", "\u4e00\u9fff"),  # the ideographs' first and last
        ("\u4dc0\ua000", ""),  # just outside them (hexagrams, Yi)
        ("\u3000\u303f\u3040", "\u3000\u303f"),  # CJK punctuation's bounds; hiragana is not
        ("\uff00\uffef\ufff0", "\uff00\uffef"),  # full-width forms' bounds
        ("\u2e7f\u2e80", "\u2e80"),
        ("abc “quoted” — ok… 42", ""),  # Latin text never needs the font
        ("订单订单，", "单订，"),  # once each, in code point order
    ],
)
def test_the_characters_the_font_is_for_are_those_of_its_ranges(text: str, kept: str) -> None:
    assert characters_of([text]) == kept


def test_it_holds_the_labels_and_the_switch_of_every_language() -> None:
    """The strings themselves, whatever files :func:`page_characters` reads."""
    font = TTFont(str(font_dir() / FONT_FILE))
    cmap = font.getBestCmap()
    strings = [text for labels in LABELS.values() for text in labels.values()]
    strings += [wording(code).name for code in LANGS]  # the demo's switch: "中文"
    assert "中文" in strings
    needed = characters_of(strings)
    assert "最终回复"[0] in needed
    assert [char for char in needed if ord(char) not in cmap] == []


def test_it_ships_beside_the_pages_that_use_it() -> None:
    assert FONT_PATH in ASSETS  # kernel-ext relay serves it next to example.html
    assert FONT_LICENCE in ASSETS
    assert f"fonts/{FONT_FILE}" == FONT_PATH
    assert (font_dir() / FONT_FILE).is_file()


def _face(css: str) -> str:
    (face,) = re.findall(r"@font-face\s*{([^}]*)}", css)
    return face


@pytest.mark.parametrize(
    ("page", "url"),
    [
        ("demo", f'url("/{FONT_PATH}") format("woff2")'),  # the demo serves it at /fonts/
        ("example", f'url("./{FONT_PATH}") format("woff2")'),  # beside the page
        ("docs", f'url("./{FONT_PATH}") format("woff2")'),  # docs/detail-pane.md: as example
    ],
)
def test_each_page_declares_the_font_for_exactly_its_ranges(page: str, url: str) -> None:
    css = {
        "demo": lambda: (static_root() / "app.css").read_text(encoding="utf-8"),
        "example": lambda: asset_text("example.html"),
        "docs": lambda: (ROOT / "docs" / "detail-pane.md").read_text(encoding="utf-8"),
    }[page]()
    face = _face(css)
    assert f'font-family: "{FONT_FAMILY}";' in face
    assert url in face
    assert f"unicode-range: {unicode_range_css()};" in face
    assert unicode_range_css().startswith("U+2E80-2FDF, U+3000-303F")
    assert len(UNICODE_RANGES) == unicode_range_css().count("U+")


def test_the_renderers_font_stacks_end_with_it() -> None:
    """So a page that declares the face shows the panes' labels (their text and their
    monospace) in it, after the machine's own faces."""
    renderer = asset_text("renderer.js")
    (root,) = re.findall(r":root \{([^}]*)\}", renderer)
    stacks = dict(re.findall(r"(--kx-[a-z]+): ([^;]+);", root))
    assert set(stacks) == {"--kx-font", "--kx-mono"}
    for stack in stacks.values():
        faces = [face.strip() for face in stack.split(",")]
        assert faces[-1] == f'"{FONT_FAMILY}"', stack
        assert faces[-2] in ("sans-serif", "monospace"), stack
    # No font of the pane's but those stacks.
    fonts = re.findall(r"(?<![-\w])font(?:-family)?: ([^;]+);", renderer)
    assert fonts
    assert all("var(--kx-font)" in font or "var(--kx-mono)" in font for font in fonts), fonts


def test_the_demo_page_takes_the_renderers_stacks() -> None:
    css = (static_root() / "app.css").read_text(encoding="utf-8")
    assert "font: 14px/1.5 var(--kx-font, sans-serif);" in css
    rules = re.sub(r"@font-face\s*{[^}]*}", "", css)
    fonts = re.findall(r"(?<![-\w])font(?:-family)?: ([^;]+);", rules)
    assert all("var(--kx-" in font or font == "inherit" for font in fonts), fonts
