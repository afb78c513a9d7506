"""Server settings shared by every server on one registry: the inference-auth mode to begin with.

`settings` holds one row per setting. `inference_auth` is `open` (any request is served) or `keys` (an API key, or the
admin token, is needed). An existing registry that holds keys starts in `keys`, one without in `open`, which is how
it was served before the mode existed.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "settings",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.execute(
        "INSERT INTO settings (name, value, updated_at) SELECT 'inference_auth', "
        "CASE WHEN EXISTS (SELECT 1 FROM api_keys) THEN 'keys' ELSE 'open' END, CURRENT_TIMESTAMP"
    )


def downgrade() -> None:
    op.drop_table("settings")
