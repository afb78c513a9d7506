"""Alembic environment of the adapter registry.

loraserve runs it through `loraserve.registry.upgrade_database`, which passes an open
connection in `config.attributes["connection"]`; otherwise the URL in the
`sqlalchemy.url` option is used.
"""

from alembic import context
from sqlalchemy import Connection

from loraserve.registry.database import create_registry_engine
from loraserve.registry.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    """Emit the SQL as text (`command.upgrade(config, "head", sql=True)`), for a DBA to apply."""
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
elif (shared := config.attributes.get("connection")) is not None:
    run_migrations(shared)
else:
    engine = create_registry_engine(config.get_main_option("sqlalchemy.url", ""))
    with engine.connect() as connection:
        run_migrations(connection)
    engine.dispose()
