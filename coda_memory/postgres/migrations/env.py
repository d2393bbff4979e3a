"""Alembic environment for coda-memory's tables (async, asyncpg).

What to migrate, in order of precedence:

- ``config.attributes["connection"]``: a SQLAlchemy ``Connection`` (used as it is, the
  caller commits), an ``Engine`` or an ``AsyncEngine`` (a connection is taken from it and
  committed here), as pytest-alembic and Alembic's cookbook pass them;
- else ``config.attributes["url"]``, the ``CODA_MEMORY_DATABASE_URL`` environment
  variable, or ``sqlalchemy.url`` in an ini file.

The schema is ``config.attributes["schema"]``, else ``CODA_MEMORY_SCHEMA``, else
``coda_memory``; the migrations name ``coda_memory`` and ``schema_translate_map`` moves
them (offline, ``--sql``, renders the translated names). Alembic's version table lives in
that schema too, so the library's history never mixes with a host application's own
Alembic history, and autogenerate looks at nothing else. A schema whose version table
holds revisions that are not coda-memory's is refused, and so is a first migration into a
schema on the search path (where a host's Alembic would find our version table).

An ini file needs no logging sections: they configure logging only when present, so a
two-line ``[alembic]`` / ``script_location = coda_memory.postgres:migrations`` is enough.
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, MetaData, pool, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.schema import CreateSchema

from coda_memory.errors import ForeignAlembicHistory
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.migrate import (
    held_while_migrating,
    known_revision,
    migrating_alone,
    migrating_alone_async,
)
from coda_memory.postgres.schema import (
    DEFAULT_SCHEMA,
    NAMING_CONVENTION,
    Xid8,
    metadata,
    migration_lock_timeout,
    schema_translate_map,
    validate_schema_name,
)

config = context.config
if (
    config.config_file_name is not None
    and config.attributes.get("configure_logger", True)
    and config.file_config.has_section("formatters")
):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

# An empty CODA_MEMORY_SCHEMA is refused (a variable a deploy script left unset), not
# read as the default schema.
SCHEMA = validate_schema_name(
    config.attributes.get("schema") or os.environ.get("CODA_MEMORY_SCHEMA", DEFAULT_SCHEMA)
)


def _database_url() -> str | None:
    url = (
        config.attributes.get("url")
        or os.environ.get("CODA_MEMORY_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    return None if not url else str(url)


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


def _render_translated_schema(dialect: Any) -> None:
    """Offline, compile every statement with ``SCHEMA`` in place of ``coda_memory``.

    Online the connection's ``schema_translate_map`` does this when a statement runs;
    offline nothing runs, so the compilers render the translated names themselves.
    """
    translate = schema_translate_map(SCHEMA)

    def translating(base: Any) -> Any:
        class Translating(base):  # type: ignore[misc]
            def __init__(self, dialect: Any, statement: Any, **kw: Any) -> None:
                kw["schema_translate_map"] = translate
                kw["render_schema_translate"] = True
                super().__init__(dialect, statement, **kw)

        return Translating

    dialect.statement_compiler = translating(dialect.statement_compiler)
    dialect.ddl_compiler = translating(dialect.ddl_compiler)


def run_migrations_offline() -> None:
    """Emit the SQL instead of running it (``alembic upgrade head --sql``), for any schema."""
    # migration_sql() (``coda-memory migrate --sql``) needs no database: the dialect is
    # all the DDL takes, and $CODA_MEMORY_DATABASE_URL may name another store, or a
    # Postgres the driver would refuse.
    url = None if config.attributes.get("dialect_only") else _database_url()
    if url is None:
        _configure(dialect_name="postgresql+asyncpg", literal_binds=True)
    else:
        _configure(url=asyncpg_url(url), literal_binds=True)
    if SCHEMA != DEFAULT_SCHEMA:
        _render_translated_schema(context.get_context().dialect)
    with context.begin_transaction():
        context.execute(migration_lock_timeout())
        context.execute(CreateSchema(SCHEMA, if_not_exists=True))
        context.run_migrations()


def _refuse_foreign_history(connection: Connection) -> None:
    """Stop before touching a schema whose version table holds another history: a
    revision that is not coda-memory's, or one of coda-memory's names in a schema without
    coda-memory's tables (a host's history may number its revisions 0001, 0002, … too)."""
    script: ScriptDirectory = context.script
    heads = context.get_context().get_current_heads()
    for head in heads:
        if not known_revision(head, script):
            raise ForeignAlembicHistory(
                f"schema {SCHEMA!r} is at Alembic revision {head!r}, which is not one of "
                "this coda-memory's migrations: another application's history (migrate "
                "coda-memory into a schema of its own; the default is coda_memory), or a "
                "newer coda-memory's (upgrade this one)"
            )
    if not heads:
        _refuse_a_schema_on_the_search_path(connection)
    # Every revision of coda-memory's has had the observations table since the first.
    table = f'"{SCHEMA}".observations'
    if heads and connection.scalar(text("SELECT to_regclass(:table)"), {"table": table}) is None:
        raise ForeignAlembicHistory(
            f"schema {SCHEMA!r} is at Alembic revision {heads[0]!r} but holds no table of "
            "coda-memory's: another application's history; migrate coda-memory into a "
            "schema of its own (the default is coda_memory)"
        )


def _refuse_a_schema_on_the_search_path(connection: Connection) -> None:
    """Stop before creating the version table in a schema on the search path (``public``,
    usually, or ``coda_memory`` where a DBA put it on the owner role's path): an Alembic
    with its defaults, as a host application's is, looks for its own ``alembic_version``
    there, and would take coda-memory's for it (its first upgrade then fails on a
    revision it does not know, or reads coda-memory's though its own exists further down
    the path). A schema already holding coda-memory's history is upgraded as before, and
    so is one named after the role that migrates (on the path as ``$user``), where a
    host's Alembic, run as its own role, never looks. The ways past it: the schema taken
    off the path (coda-memory names every table with its schema, and needs no path), or,
    where no other Alembic uses the database, the script of ``coda-memory migrate
    --sql`` applied by hand."""
    on_path = connection.scalar(
        text("SELECT :schema = ANY (current_schemas(false)) AND :schema <> current_user"),
        {"schema": SCHEMA},
    )
    if not on_path:
        return
    if SCHEMA == DEFAULT_SCHEMA:
        instead = (
            "take it off the search path of the role that migrates (coda-memory names "
            "every table with its schema; ALTER ROLE … RESET search_path)"
        )
    else:
        instead = "migrate coda-memory into a schema of its own (the default is coda_memory)"
    raise ForeignAlembicHistory(
        f"schema {SCHEMA!r} is on the search path, where another application's Alembic "
        f"looks for its version table and would find coda-memory's; {instead}, or, where "
        "no other Alembic uses this database, apply the script of "
        f"`coda-memory migrate --sql --schema {SCHEMA}` by hand"
    )


def do_run_migrations(connection: Connection) -> None:
    connection.execution_options(schema_translate_map=schema_translate_map(SCHEMA))
    # Let reflection (autogenerate, `alembic check`) recognise the cursor column's type.
    dialect: Any = connection.dialect
    dialect.ischema_names = {**dialect.ischema_names, "xid8": Xid8}
    _configure(connection=connection)
    # The schema's migration lock, from before the version table is read until the
    # caller commits (one of migrating_alone's connections holds it already).
    with held_while_migrating(connection, SCHEMA):
        _refuse_foreign_history(connection)
        with context.begin_transaction():
            connection.execute(migration_lock_timeout())
            # The version table lives in the schema, and Alembic creates it before
            # running the first migration.
            connection.execute(CreateSchema(SCHEMA, if_not_exists=True))
            context.run_migrations()


# On a connection of this module's own: committed here, after any other migration of
# the schema under way.
def _run_on_engine(engine: Engine) -> None:
    with engine.connect() as connection:
        migrating_alone(connection, SCHEMA, lambda: do_run_migrations(connection))


async def _run_on_async_engine(engine: AsyncEngine, *, own: bool = False) -> None:
    async with engine.connect() as connection:
        if own:
            # Bounded by the migrations' lock_timeout, not by a statement_timeout that the
            # role or the database sets (see coda_memory.postgres.migrate.migrate_async).
            # Not on a caller's engine, whose pool would keep the setting.
            await connection.exec_driver_sql("SET statement_timeout = 0")
        await migrating_alone_async(connection, SCHEMA, do_run_migrations)


async def _run_on_url(url: str) -> None:
    engine = create_async_engine(asyncpg_url(url), poolclass=pool.NullPool)
    try:
        await _run_on_async_engine(engine, own=True)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if isinstance(connectable, Connection):
        do_run_migrations(connectable)
    elif isinstance(connectable, Engine):
        _run_on_engine(connectable)
    elif isinstance(connectable, AsyncEngine):
        asyncio.run(_run_on_async_engine(connectable))
    elif connectable is not None:
        raise TypeError(
            'config.attributes["connection"] must be a Connection, an Engine or an '
            f"AsyncEngine, not {type(connectable).__name__}"
        )
    else:
        url = _database_url()
        if url is None:
            raise RuntimeError(
                "no database URL: set CODA_MEMORY_DATABASE_URL or sqlalchemy.url in alembic.ini"
            )
        asyncio.run(_run_on_url(url))


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
