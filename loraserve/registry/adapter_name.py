"""What an adapter may be called: a name that is safe in URLs, file names and OpenAI model ids."""

from __future__ import annotations

import re

from loraserve.errors import AdapterError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def validate_adapter_name(name: str) -> None:
    """Raise AdapterError("name", ...) unless `name` is 1-128 of [A-Za-z0-9._-], starts alphanumeric, has no '..'."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise AdapterError(
            "name",
            f"{name[:64]!r} is not a valid adapter name: use 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'",
        )
