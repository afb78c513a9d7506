"""Create the adapters table.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("base_model", sa.String(256), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.String(256), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("system_prompt", sa.Text(), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("request_count", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("prompt_token_count", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("completion_token_count", sa.BigInteger(), nullable=False, server_default="0"),
        sa.CheckConstraint("status IN ('ready', 'failed')", name="ck_adapters_status"),
    )
    op.create_index("ix_adapters_name", "adapters", ["name"], unique=True)
    op.create_index("ix_adapters_sha256", "adapters", ["sha256"])


def downgrade() -> None:
    op.drop_index("ix_adapters_sha256", table_name="adapters")
    op.drop_index("ix_adapters_name", table_name="adapters")
    op.drop_table("adapters")
