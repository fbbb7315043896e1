"""Headless Chromium (Debian's ``chromium`` package) driven by Playwright, for the UI's page tests."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Chromium's own background traffic has nowhere to go on a closed machine: keep it off.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextlib.contextmanager
def browser_page(width: int = 1300, height: int = 950):
    """A page of a fresh headless Chromium; its errors (uncaught exceptions, failed loads) are
    collected in ``page.errors``."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            raise AssertionError("the UI's browser tests need Chromium: apt-get install chromium")
        pytest.skip("no Chromium here (apt-get install chromium): the UI's page is not tried in a browser")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.errors = []
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))
            yield page
        finally:
            browser.close()
