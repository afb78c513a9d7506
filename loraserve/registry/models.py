"""The registry's tables: `adapters` (uploads, their names, how much each served), `adapter_versions` (every upload of
each name's weights: the current one is the adapter's `sha256`), `adapter_files` (their bytes, where servers share no
disk) and `api_keys` (tenants' key hashes).

The schema changes only through Alembic (migrations/); a test checks that these models and the migrations agree.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class AdapterStatus(StrEnum):
    """Whether an adapter may be served; a failed one keeps its row so the reason can be shown."""

    READY = "ready"
    FAILED = "failed"


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware datetime, always returned in UTC: SQLite stores no time zone and PostgreSQL returns the
    session's, so values are written as UTC and normalized to UTC when read."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.astimezone(UTC)

    def process_result_value(self, value: Any | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utc_now() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class AdapterRow(Base):
    """One registered adapter. Its files live in the file store under `sha256`, shared by equal uploads."""

    __tablename__ = "adapters"
    __table_args__ = (CheckConstraint("status IN ('ready', 'failed')", name="ck_adapters_status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True, index=True)
    base_model: Mapped[str] = mapped_column(String(256))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[str] = mapped_column(String(256))  # comma-separated projection names
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), default=AdapterStatus.READY.value)
    status_reason: Mapped[str | None] = mapped_column(Text)
    system_prompt: Mapped[str | None] = mapped_column(Text)
    description: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utc_now)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utc_now)
    request_count: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    prompt_token_count: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    completion_token_count: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # kept in a slot everywhere


class AdapterVersionRow(Base):
    """One set of weights an adapter's name has had: its first upload, each replacement, in order; a rollback makes an
    older one current again. Their files stay in the store while any version names them."""

    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("adapter_id", "sha256", name="uq_adapter_versions_content"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"), index=True)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[str] = mapped_column(String(256))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utc_now)
    uploaded_by: Mapped[str | None] = mapped_column(String(64))  # the admin token's id; NULL: before versions were kept
    # When its files were checked in the child process (adapter_checks.py); NULL: never (written before checks were
    # recorded). Every version of one content hash shares the verdict.
    checked_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    check_error: Mapped[str | None] = mapped_column(Text)  # why the check refused the files; NULL: they passed


class AdapterFilesRow(Base):
    """The files of one stored content hash, for servers whose store lacks them (Registry(files_in_database=True))."""

    __tablename__ = "adapter_files"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    config: Mapped[bytes] = mapped_column(LargeBinary)  # adapter_config.json
    weights: Mapped[bytes] = mapped_column(LargeBinary)  # adapter_model.safetensors


class ApiKeyRow(Base):
    """An inference key, created through the admin API for a tenant (one may have several: rotation). Only its SHA-256
    is stored (the key is 256 random bits: a fast hash is enough); `key_prefix` lets an admin tell keys apart."""

    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint("weight > 0", name="ck_api_keys_weight"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    weight: Mapped[float] = mapped_column(Float)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    allowed_models: Mapped[str | None] = mapped_column(Text)  # JSON list of model ids; NULL: every model
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utc_now)


class SettingRow(Base):
    """One setting every server sharing the registry follows (settings.py): a name and its value."""

    __tablename__ = "settings"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utc_now, onupdate=utc_now)
