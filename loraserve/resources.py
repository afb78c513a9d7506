"""Files that ship inside the package, found through importlib.resources: an installed wheel migrates its registry,
serves the admin page and registers the sample adapters, whatever the working directory."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def _packaged(*parts: str) -> Path:
    return Path(str(files("loraserve").joinpath(*parts)))


ADMIN_UI = _packaged("server", "admin_ui")
MIGRATIONS_DIR = _packaged("registry", "migrations")
SAMPLE_ADAPTERS = _packaged("samples")  # pirate, robot, shakespeare, french-tutor
