"""AdapterInfo: one registry record as plain values, handed out instead of live database rows."""

from __future__ import annotations

from dataclasses import dataclass
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

    @classmethod
    def of(cls, row: AdapterRow) -> AdapterInfo:
        return cls(
            id=row.id,
            name=row.name,
            base_model=row.base_model,
            rank=row.rank,
            alpha=row.alpha,
            target_modules=tuple(module for module in row.target_modules.split(",") if module),
            size_bytes=row.size_bytes,
            sha256=row.sha256,
            status=AdapterStatus(row.status),
            status_reason=row.status_reason,
            system_prompt=row.system_prompt,
            description=row.description,
            created_at=row.created_at,
            updated_at=row.updated_at,
            request_count=row.request_count,
            prompt_token_count=row.prompt_token_count,
            completion_token_count=row.completion_token_count,
        )
