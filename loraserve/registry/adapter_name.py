"""What adapters and tenants may be called: names safe in URLs, file names, metric labels and OpenAI model ids."""

from __future__ import annotations

import re

from loraserve.errors import AdapterError, InvalidRequestError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RULE = "use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit, without '..'"
# The rules as JSON Schema patterns (openapi.json): is_valid_name's, and validate_tenant_name's without reserved names.
NAME_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
TENANT_PATTERN = r"^(?!unkeyed$|key-)" + NAME_PATTERN.removeprefix("^")


def is_valid_name(name: str) -> bool:
    """1-128 of [A-Za-z0-9._-], starting alphanumeric, without '..'."""
    return bool(_NAME.fullmatch(name)) and ".." not in name


def validate_adapter_name(name: str) -> None:
    """Raise AdapterError("name", ...) unless `name` is valid (is_valid_name)."""
    if not is_valid_name(name):
        raise AdapterError("name", f"{name[:64]!r} is not a valid adapter name: {_RULE}")


def validate_tenant_name(name: str) -> None:
    """Raise InvalidRequestError("tenant", ...) unless `name` is valid and not one the server gives itself:
    "unkeyed" (requests without a key) and "key-..." (the --api-key keys)."""
    if not is_valid_name(name):
        raise InvalidRequestError("tenant", f"{name[:64]!r} is not a valid tenant name: {_RULE}")
    if name == "unkeyed" or name.startswith("key-"):
        raise InvalidRequestError("tenant", f"{name!r} is reserved (unkeyed traffic, --api-key keys); choose another")
