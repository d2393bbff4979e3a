"""Create or upgrade coda-memory's tables from Python, without the repository.

The migrations ship inside the package (``coda_memory/postgres/migrations``); these functions run
them with Alembic's command API on a programmatic configuration, so no alembic.ini is
needed. Alembic's version table lives in the target schema, so a host application's own
Alembic history is untouched; a schema that already holds another history is refused
(:class:`~coda_memory.errors.ForeignAlembicHistory`), and so is a first migration into a
schema on the search path, where a host's Alembic would find coda-memory's version table.

- :func:`migrate_async` from async code (inside a running event loop);
- :func:`migrate` from synchronous code with no running loop (a script, a deploy step);
  inside a running loop it raises at once, before creating any coroutine;
- :func:`migration_sql` writes the DDL for a DBA to review, without a database
  (``coda-memory migrate --sql``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import time
import warnings
from collections.abc import Callable, Iterator

# Absolute imports: the real Alembic, never the sibling module coda_memory.alembic.
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, pool, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from coda_memory.core.urls import refuse_malformed
from coda_memory.errors import MigrationUnderWay
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.schema import DEFAULT_SCHEMA, validate_schema_name

#: Where the migrations live, as Alembic's ``package:directory`` location.
SCRIPT_LOCATION = "coda_memory.postgres:migrations"


def migration_warning(message: str, *args: object) -> None:
    """Log ``message`` at WARNING on the ``coda_memory`` logger, and also issue it as a
    Python warning (to standard error) when no handler would show it: under Alembic's
    command line with a two-line ini, which configures no logging, the package's
    ``NullHandler`` swallowed it, and an operator never learnt what an upgrade left
    undone."""
    logger = logging.getLogger("coda_memory")
    logger.warning(message, *args)
    if logger.isEnabledFor(logging.WARNING) and not _shown(logger, logging.WARNING):
        warnings.warn(message % args, UserWarning, stacklevel=2)


def _shown(logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` reaches a handler that writes it somewhere (not a
    ``NullHandler``), as :meth:`logging.Logger.callHandlers` walks the loggers."""
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if not isinstance(handler, logging.NullHandler) and level >= handler.level:
                return True
        current = current.parent if current.propagate else None
    return False


def alembic_config(*, schema: str = DEFAULT_SCHEMA, url: str | None = None) -> Config:
    """An Alembic configuration for the packaged migrations (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    config.attributes["schema"] = validate_schema_name(schema)
    if url is not None:
        config.attributes["url"] = url
    return config


def known_revision(revision: str, script: ScriptDirectory | None = None) -> bool:
    """Whether ``revision`` is one of coda-memory's migrations (those of ``script``, by
    default the packaged ones): a schema at another is another application's history,
    or a newer coda-memory's."""
    if script is None:
        script = ScriptDirectory.from_config(alembic_config())
    try:
        return script.get_revision(revision) is not None
    except CommandError:
        return False


def revisions() -> list[str]:
    """The ids of coda-memory's migrations, oldest first (no symbolic name: not ``head``)."""
    script = ScriptDirectory.from_config(alembic_config())
    return [found.revision for found in reversed(list(script.walk_revisions()))]


#: The advisory lock that serialises the migrations of one schema (its key, from the
#: schema's name): replicas that all migrate as they start take turns, and each finds
#: the schema as the one before left it.
_MIGRATION_LOCK_KEY = "hashtextextended('coda_memory.migrate:' || :schema, 0)"
_TRY_LOCK = text(f"SELECT pg_try_advisory_lock({_MIGRATION_LOCK_KEY})")
_UNLOCK = text(f"SELECT pg_advisory_unlock({_MIGRATION_LOCK_KEY})")
#: How often a migration waiting for another one of its schema tries the lock again. It
#: waits between tries, not in a statement: ``CREATE INDEX CONCURRENTLY`` waits for every
#: transaction with a snapshot, and one waiting for the lock would be waited for by the
#: migration that holds it (a deadlock).
MIGRATION_LOCK_POLL = 0.2


@contextlib.contextmanager
def held_while_migrating(connection: Connection, schema: str) -> Iterator[None]:
    """Hold ``schema``'s migration lock while the migrations in the block run on
    ``connection`` (a caller's, which the caller commits, or one of
    :func:`migrating_alone`'s, which holds it already): for the session, since a
    migration's own commits (around its ``CONCURRENTLY`` index builds) would release a
    transaction's; at the end of the block it passes to the transaction, which the
    caller's commit ends. :class:`MigrationUnderWay` when another migration holds it:
    waiting inside the caller's transaction would hold a snapshot that the other one's
    index builds wait for."""
    key = {"schema": schema}
    if not connection.scalar(_TRY_LOCK, key):
        raise MigrationUnderWay(
            f"another migration of schema {schema!r} is under way; migrate again once it is done"
        )
    try:
        yield
    except BaseException:
        _unlock_after_failure(connection, key)
        raise
    connection.scalar(text(f"SELECT pg_try_advisory_xact_lock({_MIGRATION_LOCK_KEY})"), key)
    connection.execute(_UNLOCK, key)


def _unlock_after_failure(connection: Connection, key: dict[str, str]) -> None:
    """Release the session's migration lock after a failed migration; a transaction the
    failure aborted (the caller can only roll it back) is rolled back first."""
    try:
        connection.execute(_UNLOCK, key)
    except Exception:
        with contextlib.suppress(Exception):  # the connection may be gone: it goes anyway
            connection.rollback()
            connection.execute(_UNLOCK, key)


def migrating_alone(connection: Connection, schema: str, run: Callable[[], None]) -> None:
    """``run()`` (migrations on ``connection``, committed here), after any other
    migration of ``schema`` under way: the schema's migration lock is held for the
    session from before the version table is read until after the commit, which a
    migration's own commits (around its ``CONCURRENTLY`` index builds) do not release.
    A migration that fails is rolled back first."""
    key = {"schema": schema}
    waited = False
    while not connection.scalar(_TRY_LOCK, key):
        waited = waited or _say_waiting(schema)
        connection.commit()  # no transaction, no snapshot, while it waits
        time.sleep(MIGRATION_LOCK_POLL)
    connection.commit()
    try:
        run()
        connection.commit()
    except BaseException:
        with contextlib.suppress(Exception):  # the connection may be gone: it goes anyway
            connection.rollback()
            connection.execute(_UNLOCK, key)
            connection.commit()
        raise
    connection.execute(_UNLOCK, key)
    connection.commit()


async def migrating_alone_async(
    connection: AsyncConnection, schema: str, run: Callable[[Connection], None]
) -> None:
    """:func:`migrating_alone` on an async connection, waiting without blocking the
    event loop; ``run`` gets the sync connection."""
    key = {"schema": schema}
    waited = False
    while not await connection.scalar(_TRY_LOCK, key):
        waited = waited or _say_waiting(schema)
        await connection.commit()
        await asyncio.sleep(MIGRATION_LOCK_POLL)
    await connection.commit()
    try:
        await connection.run_sync(run)
        await connection.commit()
    except BaseException:
        with contextlib.suppress(Exception):
            await connection.rollback()
            await connection.execute(_UNLOCK, key)
            await connection.commit()
        raise
    await connection.execute(_UNLOCK, key)
    await connection.commit()


def _say_waiting(schema: str) -> bool:
    """Say, once, that the migration waits for another one of ``schema``: it waits for as
    long as that one runs, and a deploy step (or ``coda-memory migrate``) seemed to hang
    without a word when that one was stuck. True, for the caller to remember it said so."""
    migration_warning(
        "coda-memory: another migration of schema %r is under way; waiting for it to end",
        schema,
    )
    return True


def _upgrade(connection: Connection, config: Config, revision: str) -> None:
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


async def migrate_async(url: str, *, schema: str = DEFAULT_SCHEMA, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision``, in one transaction (the indexes
    built ``CONCURRENTLY`` excepted), after any other migration of ``schema`` under way
    (see :func:`migrating_alone`). A ``memory://``, ``null://`` or Redis URL has no
    schema to migrate: nothing is done (the host's start-up code stays the same)."""
    if _schemaless(url):
        return
    config = alembic_config(schema=schema)
    engine = create_async_engine(asyncpg_url(url), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            # Bounded by the migrations' lock_timeout, not by a statement_timeout that the
            # role or the database sets: it ended a wait for a lock as a failure, before
            # the 5 s a migration waits, and cut an index built on a large table at every
            # run. (For the session: the first commit below keeps it.)
            await connection.exec_driver_sql("SET statement_timeout = 0")
            upgrade = functools.partial(_upgrade, config=config, revision=revision)
            await migrating_alone_async(connection, schema, upgrade)
    finally:
        await engine.dispose()


def migrate(url: str, *, schema: str = DEFAULT_SCHEMA, revision: str = "head") -> None:
    """Blocking :func:`migrate_async`, for code with no running event loop.

    Raises ``RuntimeError`` at once inside a running loop (``await migrate_async(url)``
    there): blocking the loop for the length of a migration would stall everything else
    it runs.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(
            "coda_memory.migrate() cannot run inside a running event loop; "
            "use `await coda_memory.migrate_async(url)` there"
        )
    validate_schema_name(schema)
    if _schemaless(url):
        return
    asyncpg_url(url)
    asyncio.run(migrate_async(url, schema=schema, revision=revision))


def _schemaless(url: str | URL) -> bool:
    """Whether ``url`` names a store without a schema (nothing to migrate); TypeError for
    anything but a string or a SQLAlchemy URL (an unset environment variable gives None)."""
    if isinstance(url, URL):
        return False
    if not isinstance(url, str):
        raise TypeError(f"the database URL must be a str, not {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower()
    if scheme in _SCHEMALESS:
        # (Refused as MemoryService.from_url refuses them, where nothing was done; Postgres
        # URLs are refused so by asyncpg_url.)
        refuse_malformed(url, scheme)
        return True
    return False


#: The schemes of the stores with no schema.
_SCHEMALESS = frozenset({"memory", "null", "redis", "rediss"})


def migration_sql(
    *, schema: str = DEFAULT_SCHEMA, revision: str = "head", start: str | None = None
) -> str:
    """The SQL that upgrades a database from ``start`` (default: empty) to ``revision``,
    for ``schema``, rendered without connecting anywhere (Alembic's offline mode)."""
    config = alembic_config(schema=schema)
    config.attributes["dialect_only"] = True  # no URL read, not even the environment's
    buffer = io.StringIO()
    config.output_buffer = buffer
    target = revision if start is None else f"{start}:{revision}"
    command.upgrade(config, target, sql=True)
    return buffer.getvalue()
