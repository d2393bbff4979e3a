"""Alembic environment for coda-memory's tables (async, asyncpg).

The URL is ``config.attributes["url"]`` (set by :mod:`coda_memory.postgres.migrate`), else the
``CODA_MEMORY_DATABASE_URL`` environment variable, else ``sqlalchemy.url`` in alembic.ini.
The schema is ``config.attributes["schema"]``, else ``CODA_MEMORY_SCHEMA``, else
``coda_memory``; the migrations name ``coda_memory`` and ``schema_translate_map`` moves
them. Alembic's version table lives in that schema too, so the library's history never
mixes with a host application's own Alembic history, and autogenerate looks at nothing
else.
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import Connection, MetaData, Text, bindparam, func, pool, select
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.schema import CreateSchema

from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.schema import (
    DEFAULT_SCHEMA,
    NAMING_CONVENTION,
    Xid8,
    metadata,
    schema_translate_map,
    validate_schema_name,
)

#: Wait at most this long for a table lock: on a live database a blocked migration would
#: queue every query of the table behind it. (Offline mode writes the same value.)
LOCK_TIMEOUT = "5s"

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

SCHEMA = validate_schema_name(
    config.attributes.get("schema") or os.environ.get("CODA_MEMORY_SCHEMA") or DEFAULT_SCHEMA
)


def _database_url() -> str:
    url = (
        config.attributes.get("url")
        or os.environ.get("CODA_MEMORY_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise RuntimeError(
            "no database URL: set CODA_MEMORY_DATABASE_URL or sqlalchemy.url in alembic.ini"
        )
    return str(url)


def _target_metadata() -> MetaData:
    """The tables as they should be in ``SCHEMA``, for autogenerate to compare."""
    if SCHEMA == DEFAULT_SCHEMA:
        return metadata
    target = MetaData(schema=SCHEMA, naming_convention=NAMING_CONVENTION)
    for table in metadata.sorted_tables:
        table.to_metadata(target, schema=SCHEMA)
    return target


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Autogenerate reflects our schema only, never the host application's."""
    if type_ == "schema":
        return name == SCHEMA
    return True


def _configure(**kwargs: Any) -> None:
    context.configure(
        target_metadata=_target_metadata(),
        version_table_schema=SCHEMA,
        include_schemas=True,
        include_name=include_name,
        compare_type=True,
        **kwargs,
    )


def run_migrations_offline() -> None:
    """Emit the SQL instead of running it (``alembic upgrade head --sql``)."""
    if SCHEMA != DEFAULT_SCHEMA:
        raise RuntimeError(f"offline mode supports the default schema {DEFAULT_SCHEMA!r} only")
    _configure(url=asyncpg_url(_database_url()), literal_binds=True)
    with context.begin_transaction():
        context.execute("SET LOCAL lock_timeout = '5s'")
        context.execute(CreateSchema(SCHEMA, if_not_exists=True))
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    connection.execution_options(schema_translate_map=schema_translate_map(SCHEMA))
    # Let reflection (autogenerate, `alembic check`) recognise the cursor column's type.
    dialect: Any = connection.dialect
    dialect.ischema_names = {**dialect.ischema_names, "xid8": Xid8}
    _configure(connection=connection)
    with context.begin_transaction():
        setting = bindparam("lock_timeout", LOCK_TIMEOUT, Text)
        connection.execute(select(func.set_config("lock_timeout", setting, True)))
        # The version table lives in the schema, and Alembic creates it before running
        # the first migration.
        connection.execute(CreateSchema(SCHEMA, if_not_exists=True))
        context.run_migrations()


async def run_async_migrations() -> None:
    engine = create_async_engine(asyncpg_url(_database_url()), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        asyncio.run(run_async_migrations())
    else:
        do_run_migrations(connection)


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
