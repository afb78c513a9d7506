"""A real server for the admin page tests (the browser: tests/conftest.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.server.conftest import RunningServer, start_server


@pytest.fixture(scope="module")
def ui_server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    """A server with the sample personas registered, as a first start gives."""
    data_dir = tmp_path_factory.mktemp("ui-data")
    yield from start_server(loaded_model, data_dir, max_loras=4, register_samples=True)
    shutil.rmtree(data_dir, ignore_errors=True)
