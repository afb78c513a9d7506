"""The adapter registry: a database of named adapters (SQLite or PostgreSQL) and a content-addressed file store."""

from loraserve.registry.adapter_info import AdapterInfo
from loraserve.registry.api_keys import ApiKeyInfo, KeySpec, hash_key
from loraserve.registry.archive import extract_adapter_archive
from loraserve.registry.database import downgrade_database, sqlite_url, upgrade_database
from loraserve.registry.file_store import FileStore
from loraserve.registry.models import AdapterStatus
from loraserve.registry.repository import AdapterNotFoundError, Registry, Usage
from loraserve.registry.settings import InferenceAuth

__all__ = [
    "AdapterInfo",
    "AdapterNotFoundError",
    "AdapterStatus",
    "ApiKeyInfo",
    "FileStore",
    "InferenceAuth",
    "KeySpec",
    "Registry",
    "Usage",
    "downgrade_database",
    "extract_adapter_archive",
    "hash_key",
    "sqlite_url",
    "upgrade_database",
]
