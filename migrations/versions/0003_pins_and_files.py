"""Pins in the registry, and adapter files in the database for servers that share no disk.

`adapters.pinned`: an admin's pin outlives a restart and reaches every server sharing the database. `adapter_files`:
the bytes of each stored adapter, one row per content hash, written only where servers keep their files there
(`--files-in-database`, which `loraserve cluster` sets).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:  # SQLite alters a table by copying it
        batch.add_column(sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table(
        "adapter_files",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("config", sa.LargeBinary(), nullable=False),
        sa.Column("weights", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("adapter_files")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("pinned")
