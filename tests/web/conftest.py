"""The browser tests' fixtures: the shipped example page served on 127.0.0.1, one headless
Chromium per module, and a fresh page of the example for each test (its helpers in
``support.renderer_page``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from support.network import chromium, started
from support.renderer_page import WAIT_MS

from kernel_ext.testing.browser import serve_directory
from kernel_ext.web import web_root


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """The installed package's web directory, served on 127.0.0.1."""
    started("network")
    with serve_directory(web_root()) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the whole module."""
    with chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Any, base_url: str) -> Iterator[Any]:
    """A fresh page of the example, not playing its script; page errors fail the test."""
    context = browser.new_context(viewport={"width": 900, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{base_url}/example.html?play=0")
    page.wait_for_selector("body[data-ready='1']")
    yield page
    context.close()
    assert errors == [], errors
