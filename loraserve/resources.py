"""The files that ship with the package: the admin page, the registry's migrations and the sample adapters.

A checkout keeps them at the top of the repository, beside loraserve/; the wheel maps them inside the package
(pyproject's package-dir), where importlib.resources finds them: an installed wheel migrates its registry, serves the
admin page and registers the samples, whatever the working directory."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

_PACKAGE = Path(str(files("loraserve")))


def _shipped(name: str) -> Path:
    inside = _PACKAGE / name  # an installed wheel
    return inside if inside.is_dir() else _PACKAGE.parent / name  # a checkout, run in place or installed editable


ADMIN_UI = _shipped("admin_ui")
MIGRATIONS_DIR = _shipped("migrations")
SAMPLE_ADAPTERS = _shipped("adapters")  # pirate, robot, shakespeare, french-tutor
