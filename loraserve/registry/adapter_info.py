"""AdapterInfo: one registry record as plain values, handed out instead of live database rows."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime

from loraserve.registry.models import AdapterRow, AdapterStatus, AdapterVersionRow


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


@dataclass(frozen=True)
class AdapterVersion:
    """One set of weights an adapter has had (registry.versions)."""

    sha256: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    created_at: datetime  # UTC: when it was uploaded
    uploaded_by: str | None  # the admin token's id; None for versions from before they were recorded
    current: bool  # the weights the name serves now

    @classmethod
    def of(cls, row: AdapterVersionRow, current_sha256: str) -> AdapterVersion:
        modules = tuple(module for module in row.target_modules.split(",") if module)
        return cls(
            row.sha256, row.rank, row.alpha, modules, row.size_bytes, row.created_at, row.uploaded_by,
            row.sha256 == current_sha256,
        )  # fmt: skip
