"""Create or upgrade coda-memory's tables from Python, without the repository.

The migrations ship inside the package (``coda_memory/postgres/migrations``); these functions run
them with Alembic's command API on a programmatic configuration. Alembic's version table
lives in the target schema, so a host application's own Alembic history is untouched.
"""

from __future__ import annotations

import asyncio

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, pool
from sqlalchemy.ext.asyncio import create_async_engine

from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.schema import DEFAULT_SCHEMA, validate_schema_name

#: Where the migrations live, as Alembic's ``package:directory`` location.
SCRIPT_LOCATION = "coda_memory.postgres:migrations"


def alembic_config(*, schema: str = DEFAULT_SCHEMA, url: str | None = None) -> Config:
    """An Alembic configuration for the packaged migrations (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    config.attributes["schema"] = validate_schema_name(schema)
    if url is not None:
        config.attributes["url"] = url
    return config


def _upgrade(connection: Connection, config: Config, revision: str) -> None:
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def migrate_async(url: str, *, schema: str = DEFAULT_SCHEMA, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision``, in one transaction."""
    config = alembic_config(schema=schema)
    engine = create_async_engine(asyncpg_url(url), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_upgrade, config, revision)
            await connection.commit()
    finally:
        await engine.dispose()


def migrate(url: str, *, schema: str = DEFAULT_SCHEMA, revision: str = "head") -> None:
    """Blocking :func:`migrate_async`; call ``migrate_async`` from a running event loop."""
    asyncio.run(migrate_async(url, schema=schema, revision=revision))
