"""Debian's chromium driven by Playwright (never a browser Playwright downloads), against a real server."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import RunningServer, start_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():  # `make test` installs it; a bare pytest run may not have
        pytest.fail(
            f"{CHROMIUM} is missing: run `make install` (it installs Debian's chromium) or apt-get install chromium"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def ui_server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    """A server with the sample personas registered, as a first start gives."""
    data_dir = tmp_path_factory.mktemp("ui-data")
    yield from start_server(loaded_model, data_dir, max_loras=4, register_samples=True)
    shutil.rmtree(data_dir, ignore_errors=True)
