"""AdapterInfo: one registry record as plain values, handed out instead of live database rows."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime

from loraserve.registry.models import AdapterRow, AdapterStatus


@dataclass(frozen=True)
class AdapterInfo:
    """A registered adapter; immutable, so any thread may keep it after its transaction ended."""

    id: int
    name: str
    base_model: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    sha256: str  # content hash of the config and weights files: where the store keeps them
    status: AdapterStatus
    status_reason: str | None  # why it failed; None when ready
    system_prompt: str | None
    description: str | None
    created_at: datetime  # UTC
    updated_at: datetime  # UTC
    request_count: int
    prompt_token_count: int
    completion_token_count: int
    pinned: bool  # kept in a device slot by every server

    @classmethod
    def of(cls, row: AdapterRow) -> AdapterInfo:
        columns = {field.name: getattr(row, field.name) for field in fields(cls)}
        modules = tuple(module for module in row.target_modules.split(",") if module)
        return cls(**{**columns, "target_modules": modules, "status": AdapterStatus(row.status)})
