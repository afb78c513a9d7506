"""Adapter checks: whether each version's files were checked in the child process, and the verdict.

`adapter_versions.checked_at` is when the files were checked (adapter_sandbox.py), NULL for never; `check_error` why
they were refused, NULL when they passed. Existing rows stay NULL: they were written before uploads were checked in a
child (or their files were put in the store by hand), so the server checks them at its next start.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:  # SQLite alters a table by copying it
        batch.add_column(sa.Column("checked_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("check_error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_column("check_error")
        batch.drop_column("checked_at")
