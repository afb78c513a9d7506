"""Adapter versions: every set of weights a name has had, so a replacement can be rolled back.

`adapter_versions` holds one row per (adapter, content hash), with who uploaded it; the adapter's own `sha256` stays the
current version. Each existing adapter gets its current weights as its first version (uploaded_by unknown).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter_versions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("adapter_id", sa.Integer(), sa.ForeignKey("adapters.id", ondelete="CASCADE"), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.String(256), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uploaded_by", sa.String(64), nullable=True),
        sa.UniqueConstraint("adapter_id", "sha256", name="uq_adapter_versions_content"),
    )
    op.create_index("ix_adapter_versions_adapter_id", "adapter_versions", ["adapter_id"])
    op.create_index("ix_adapter_versions_sha256", "adapter_versions", ["sha256"])
    op.execute(
        "INSERT INTO adapter_versions (adapter_id, sha256, rank, alpha, target_modules, size_bytes, created_at) "
        "SELECT id, sha256, rank, alpha, target_modules, size_bytes, created_at FROM adapters"
    )


def downgrade() -> None:
    op.drop_index("ix_adapter_versions_sha256", table_name="adapter_versions")
    op.drop_index("ix_adapter_versions_adapter_id", table_name="adapter_versions")
    op.drop_table("adapter_versions")
