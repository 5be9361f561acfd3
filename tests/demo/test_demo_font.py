"""The demo page's own CJK font (:mod:`kernel_ext.demo.font`): it ships with its licence and
record, and holds every CJK character the page can show of its own — so a new Chinese word
in the demo, the colleagues' scripts or the renderer's labels fails here until
``scripts/demo_font.py`` made the subset again. Chromium drawing it on a machine without CJK
fonts is in ``tests/demo/test_demo_browser.py``."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest
from fontTools.ttLib import TTFont

from kernel_ext.demo.font import (
    FONT_FAMILY,
    FONT_FILE,
    UNICODE_RANGES,
    characters_of,
    font_dir,
    page_characters,
    unicode_range_css,
)
from kernel_ext.demo.web import static_root


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


def test_the_page_declares_the_font_for_exactly_its_ranges() -> None:
    css = (static_root() / "app.css").read_text(encoding="utf-8")
    (face,) = re.findall(r"@font-face\s*{([^}]*)}", css)
    assert f'font-family: "{FONT_FAMILY}";' in face
    assert f'url("/static/fonts/{FONT_FILE}") format("woff2")' in face
    assert f"unicode-range: {unicode_range_css()};" in face
    assert unicode_range_css().startswith("U+2E80-2FDF, U+3000-303F")
    assert len(UNICODE_RANGES) == unicode_range_css().count("U+")
    # last in the stack, after the renderer's (whose own CJK faces come first)
    assert f'--demo-font: var(--kx-font, sans-serif), "{FONT_FAMILY}";' in css
    assert f'--demo-mono: ui-monospace, SFMono-Regular, Menlo, monospace, "{FONT_FAMILY}";' in css
