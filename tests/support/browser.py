"""Test helpers for pages in Chromium (Playwright): what a page reported, and whether its
Chinese is drawn or shows as boxes on a machine without CJK fonts.

:func:`latin_only_fonts` gives Chromium a fontconfig that knows Latin faces only; there
every CJK character a page's own face (``kernel_ext.web.font``) does not draw is a
missing-glyph box. :func:`undrawn_cjk` asks Chromium (DevTools ``CSS.getPlatformFontsForNode``)
which font drew each rendered text node's glyphs, as laid out; :func:`looks_like_boxes`
compares an element's picture with the same element holding characters no font has."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fontTools.ttLib import TTFont

from kernel_ext.web.font import FONT_FILE, UNICODE_RANGES, font_dir


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


LATIN_FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/truetype/liberation")
"""The only font directories of :func:`latin_only_fonts`."""

LATIN_ONLY_FONTS = """<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "fonts.dtd">
<fontconfig>
  {dirs}
  <cachedir>{cache}</cachedir>
  <include ignore_missing="yes">/etc/fonts/conf.d</include>
</fontconfig>
"""

MISSING = "龘"
"""A CJK character no font Chromium has under :func:`latin_only_fonts` draws (nor the
page's own subset): it shows as a box."""


def latin_only_fonts(tmp_path: Path) -> dict[str, str]:
    """This process's environment with a fontconfig (written under ``tmp_path``) that knows
    :data:`LATIN_FONT_DIRS` only: Chromium started with it has no CJK font of the machine's."""
    conf = tmp_path / "fonts.conf"
    dirs = "\n  ".join(f"<dir>{folder}</dir>" for folder in LATIN_FONT_DIRS)
    conf.write_text(LATIN_ONLY_FONTS.format(dirs=dirs, cache=tmp_path / "cache"), "utf-8")
    return {**os.environ, "FONTCONFIG_FILE": str(conf)}


def latin_faces_with(chars: str) -> dict[str, str]:
    """Each face file under :data:`LATIN_FONT_DIRS` that has any of ``chars``: which of them."""
    found: dict[str, str] = {}
    for folder in LATIN_FONT_DIRS:
        for path in sorted(Path(folder).glob("*.[ot]tf")):
            cmap = TTFont(str(path), lazy=True).getBestCmap()
            have = "".join(char for char in chars if ord(char) in cmap)
            if have:
                found[path.name] = have
    return found


def shipped_face() -> str:
    """The PostScript name of the package's CJK subset: how Chromium names it when it drew."""
    return str(TTFont(str(font_dir() / FONT_FILE))["name"].getDebugName(6))


def is_cjk(char: str) -> bool:
    """Whether ``char`` is one the package's face is for (``kernel_ext.web.font``)."""
    return any(low <= ord(char) <= high for low, high in UNICODE_RANGES)


@dataclass
class GlyphAudit:
    """Every rendered text node with CJK characters: ``drawn`` (its text, each of its CJK
    characters drawn by the package's face) and ``undrawn`` (its text, and the fonts
    Chromium drew its glyphs with, by PostScript name and glyph count)."""

    drawn: list[str] = field(default_factory=list)
    undrawn: list[tuple[str, dict[str, int]]] = field(default_factory=list)


def _text_nodes(node: dict[str, Any]) -> Any:
    if node.get("nodeType") == 3:
        yield node
    for key in ("children", "shadowRoots", "pseudoElements"):
        for child in node.get(key, ()):
            yield from _text_nodes(child)
    if "contentDocument" in node:
        yield from _text_nodes(node["contentDocument"])


def undrawn_cjk(page: Any) -> GlyphAudit:
    """Which font Chromium drew each CJK character of ``page``'s rendered text with, as it is
    laid out now (shadow trees too: an input's placeholder). A text node is ``drawn`` when the
    package's face drew as many glyphs as it has CJK characters (:func:`is_cjk`); under
    :func:`latin_only_fonts` any other is a box. Text not rendered (hidden, a closed
    ``<details>``) is in neither list."""
    face = shipped_face()
    audit = GlyphAudit()
    session = page.context.new_cdp_session(page)
    try:
        session.send("DOM.enable")
        session.send("CSS.enable")
        root = session.send("DOM.getDocument", {"depth": -1, "pierce": True})["root"]
        for node in _text_nodes(root):
            text = node.get("nodeValue", "")
            needed = sum(1 for char in text if is_cjk(char))
            if not needed:
                continue
            fonts = session.send("CSS.getPlatformFontsForNode", {"nodeId": node["nodeId"]})
            used = {font["postScriptName"]: font["glyphCount"] for font in fonts["fonts"]}
            if not used:
                continue  # not laid out
            if used.get(face, 0) == needed:
                audit.drawn.append(text)
            else:
                audit.undrawn.append((text, used))
    finally:
        session.detach()
    return audit


def looks_like_boxes(element: Any) -> bool:
    """Whether ``element`` (a Playwright locator) looks the same as when each of its CJK
    characters is :data:`MISSING` (a box), as laid out now; its text is put back after."""
    drawn = element.screenshot()
    text = element.evaluate("(node) => node.textContent")
    boxes = "".join(MISSING if is_cjk(char) else char for char in text)
    element.evaluate("(node, text) => { node.textContent = text; }", boxes)
    try:
        return bool(element.screenshot() == drawn)
    finally:
        element.evaluate("(node, text) => { node.textContent = text; }", text)
