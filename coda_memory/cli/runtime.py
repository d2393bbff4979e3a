"""What every command runs on: one-line errors, durations, and the database it works on.

A command's work is a coroutine passed to :func:`run`, which turns every failure into one
line on stderr and an exit code (1; 2 for bad usage; 3 when another transaction's lock
kept the command out past ``--lock-wait``), or re-raises it under ``--debug``.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn, TypeVar

import typer
from sqlalchemy import pool, select
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from coda_memory.core.logs import masked_url
from coda_memory.errors import AccessDenied, ForeignAlembicHistory, SchemaNotMigrated
from coda_memory.postgres import maintenance
from coda_memory.postgres.connection import (
    INSUFFICIENT_PRIVILEGE,
    LOCK_NOT_AVAILABLE,
    MAX_TIMEOUT,
    QUERY_CANCELED,
    is_read_only,
    sqlstate,
    timeout_setting,
)
from coda_memory.postgres.engine import asyncpg_url
from coda_memory.postgres.schema import DEFAULT_SCHEMA, validate_schema_name
from coda_memory.postgres.store import PostgresStore
from coda_memory.postgres.tenancy import ALL_IDENTITIES

T = TypeVar("T")

#: The exit code of a command that another transaction's lock kept out (and of
#: ``consolidate`` when identities were left busy): a script can tell "run it again
#: later" from a failure (1) and from done (0).
BUSY_EXIT_CODE = 3
#: ``--lock-wait`` of the commands that read or maintain, when not given.
DEFAULT_LOCK_WAIT = "10s"
#: What a lock not granted in time means, for people.
_LOCKED_OUT = (
    "another transaction holds a lock this command needs (a migration, a LOCK TABLE, a "
    "long maintenance statement)"
)

#: What a write refused for reading only means, for people.
_READS_ONLY = (
    "the database only reads (a hot standby or read replica, a writer that a failover "
    "demoted, or default_transaction_read_only): run it against the primary"
)

#: Why the server cancels a command's statement.
_CANCELED = (
    "the commands that only read run under the statement_timeout that the role or the "
    "database sets; or a cancel request ended it"
)

#: The environment variable that gives ``--url``.
URL_VARIABLE = "CODA_MEMORY_DATABASE_URL"
SCHEMA_VARIABLE = "CODA_MEMORY_SCHEMA"
#: Seconds to wait for a connection before reporting the database as unreachable.
CONNECT_TIMEOUT = 10.0


class CliError(Exception):
    """A failure reported as one line on stderr, with an exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    text = str(exc).strip()
    # SQLAlchemy's asyncpg adapter prefixes the driver's class: "<class '…'>: message".
    text = re.sub(r"^<class '[\w.]+'>:\s*", "", text)
    line = text.splitlines()[0] if text else ""
    return line or type(exc).__name__


def describe(exc: BaseException, schema: str = DEFAULT_SCHEMA) -> str:
    """One line about an unexpected failure: its type and the first line of its message."""
    if isinstance(exc, SchemaNotMigrated):
        return _not_migrated(schema)
    if isinstance(exc, TimeoutError):  # (asyncio's say nothing more; the library's say what)
        return f"timed out: {_first_line(exc)}" if str(exc) else "timed out"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _not_migrated(schema: str) -> str:
    option = "" if schema == DEFAULT_SCHEMA else f" --schema {schema}"
    return f"schema {schema} is not migrated: run coda-memory migrate{option}"


@dataclass
class _Options:
    """Options of the whole invocation, set by the callback that runs before a command."""

    debug: bool = False


invocation = _Options()


def debug_enabled() -> bool:
    """True under ``--debug``: failures show their traceback instead of one line."""
    return invocation.debug


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def run(main: Callable[[], Coroutine[Any, Any, T]], schema: str = DEFAULT_SCHEMA) -> T:
    """Run a command's coroutine; turn every failure into one line and an exit code."""
    try:
        return asyncio.run(main())
    except (typer.Exit, typer.Abort):  # Abort: the app says "aborted" (input ended)
        raise
    except CliError as exc:
        if debug_enabled() and exc.__cause__ is not None:
            raise
        fail(str(exc), exc.code)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except (AccessDenied, ForeignAlembicHistory) as exc:
        if debug_enabled():
            raise
        fail(str(exc))
    except Exception as exc:
        if debug_enabled():
            raise
        if sqlstate(exc) == LOCK_NOT_AVAILABLE:
            fail(f"{_LOCKED_OUT}: run it again later", BUSY_EXIT_CODE)
        if is_read_only(exc):
            fail(_READS_ONLY)
        if sqlstate(exc) == QUERY_CANCELED:
            fail(f"the server cancelled a statement: {_first_line(exc)} ({_CANCELED})")
        if isinstance(exc, SchemaNotMigrated):
            hint = ""
        elif sqlstate(exc) == INSUFFICIENT_PRIVILEGE:
            hint = (
                " (the role lacks a grant: analysts may run analytics only; as the schema's "
                "owner, coda-memory grant app|analyst ROLE grants what each needs)"
            )
        else:
            hint = " (run with --debug for details)"
        fail(describe(exc, schema) + hint)


_UNITS = {
    "ms": "milliseconds",
    "s": "seconds",
    "m": "minutes",
    "h": "hours",
    "d": "days",
    "w": "weeks",
}


def parse_duration(text: str, option: str, *, at_most: timedelta | None = None) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, ``500ms`` or ``2w`` as a positive timedelta, of
    ``at_most`` whole days at most when given, that reaches no further back from now than
    year 1."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d|w)\s*", text.lower())
    if match is None or float(match[1]) <= 0:
        raise CliError(
            f"invalid duration {text!r} for {option}: use a positive number and a unit "
            "(ms, s, m, h, d or w), e.g. 30d, 12h, 90m",
            code=2,
        )
    try:
        duration = timedelta(**{_UNITS[match[2]]: float(match[1])})
        if at_most is not None and duration > at_most:
            whole = at_most == timedelta(days=at_most.days)
            limit = f"{at_most.days}d" if whole else str(at_most)
            raise CliError(f"invalid duration {text!r} for {option}: at most {limit}", code=2)
        datetime.now(UTC) - duration  # a duration back from now, as every option uses it
    except OverflowError as exc:
        raise CliError(f"invalid duration {text!r} for {option}: too long", code=2) from exc
    if duration <= timedelta(0):
        raise CliError(
            f"invalid duration {text!r} for {option}: shorter than a microsecond", code=2
        )
    return duration


@dataclass(frozen=True)
class Target:
    """Where the command works: a URL, a schema, and how to name it in messages."""

    url: str
    schema: str
    display: str
    embedded: bool


def check_database_url(url: str) -> None:
    """Refuse, with a ``ValueError`` whose message says why in one line, a Postgres URL
    that SQLAlchemy cannot parse or that the driver would refuse only on connecting."""
    if "\x00" in url or any("\ud800" <= c <= "\udfff" for c in url):
        # A byte that is not UTF-8 (an argument or a variable in another encoding) reached
        # the driver, which failed on its own attributes ("'Protocol' object has no
        # attribute '_on_error'") as if the server had.
        raise ValueError("it holds bytes that are not UTF-8 text, or a NUL character")
    try:
        asyncpg_url(url)
    except (ArgumentError, ValueError, TypeError) as exc:
        raise ValueError(_first_line(exc)) from exc


def checked_schema(schema: str) -> str:
    """``--schema``, or a usage error: a name that is not a plain lower-case identifier,
    or an empty ``$CODA_MEMORY_SCHEMA``."""
    # An empty schema variable is the same mistake as an empty URL (see resolve_target),
    # not a request for the default schema: another tenant's tables, perhaps. (click
    # passes it on as no --schema at all.)
    if schema == DEFAULT_SCHEMA and os.environ.get(SCHEMA_VARIABLE) == "":
        raise CliError(f"${SCHEMA_VARIABLE} is empty: give a schema, or unset it", code=2)
    try:
        return validate_schema_name(schema)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from exc


def resolve_target(url: str | None, schema: str, *, announce: bool = True) -> Target:
    """The database named by ``--url``/the environment, or the embedded one (started
    here, and named on stderr unless ``announce`` is false)."""
    schema = checked_schema(schema)
    # An empty URL is a mistake (an unset variable in a deploy script), not a request for
    # the embedded Postgres, which would answer as if it were the operator's database.
    # (click passes an empty $CODA_MEMORY_DATABASE_URL on as no --url at all.)
    empty_variable = url is None and os.environ.get(URL_VARIABLE) == ""
    if empty_variable or (url is not None and not url.strip()):
        raise CliError(f"--url or ${URL_VARIABLE} is empty: give a database URL", code=2)
    if url and url.split(":", 1)[0].lower() in ("redis", "rediss"):
        raise CliError(
            "analytics and the other commands need Postgres; a Redis URL serves only "
            "MemoryService (copy it into Postgres with coda-memory import-redis)",
            code=2,
        )
    if url:
        try:
            check_database_url(url)
        except ValueError as exc:
            raise CliError(f"invalid database URL {masked_url(url)!r}: {exc}", code=2) from exc
        return Target(url, schema, masked_url(url), embedded=False)
    from coda_memory.postgres.embedded import DEFAULT_DATA_DIR, embedded_url

    data_dir = os.environ.get("CODA_MEMORY_DATA_DIR") or str(DEFAULT_DATA_DIR)
    try:
        embedded = embedded_url(data_dir)
    except Exception as exc:
        raise CliError(
            f"cannot start the embedded Postgres in {data_dir}: {_first_line(exc)}"
        ) from exc
    target = Target(embedded, schema, f"the embedded Postgres in {data_dir}", embedded=True)
    if announce:
        typer.echo(f"coda-memory: using {target.display}", err=True)
    return target


async def _check_connection(engine: AsyncEngine, target: Target) -> None:
    try:
        async with engine.connect() as conn:
            await conn.execute(select(1))
    except Exception as exc:
        # asyncpg's connect timeout is a TimeoutError without a message.
        reason = (
            f"no answer within {CONNECT_TIMEOUT:g} s"
            if isinstance(exc, TimeoutError)
            else _first_line(exc)
        )
        raise CliError(f"cannot connect to {target.display}: {reason}") from exc


async def check_reachable(target: Target) -> None:
    """Connect once to the target, or fail with "cannot connect to …"."""
    engine = create_async_engine(
        asyncpg_url(target.url),
        poolclass=pool.NullPool,
        connect_args={"timeout": CONNECT_TIMEOUT},
    )
    try:
        await _check_connection(engine, target)
    finally:
        await engine.dispose()


@asynccontextmanager
async def open_store(
    target: Target,
    *,
    migrated: bool = True,
    pool_size: int = 2,
    lock_timeout: timedelta | None = None,
    across: bool = True,
    lock_wait: timedelta | None = None,
    reads_only: bool = False,
) -> AsyncIterator[PostgresStore]:
    """A store on the target, connected and (when ``migrated``) checked to be migrated;
    the embedded database is migrated here, any other only by ``migrate``. With
    ``across`` (every command but analytics, which read the aggregate views), the role
    must read every identity's rows: row-level security would otherwise hide them, and
    the command answer as if there were none. ``lock_timeout`` is the store's wait for an
    identity's checkpoint row; ``lock_wait`` (``--lock-wait``), when given, bounds every
    lock wait of every statement (a table that a migration or ``LOCK TABLE`` holds), and
    the checkpoint row's too unless ``lock_timeout`` says otherwise. A command that
    ``reads_only`` keeps the ``statement_timeout`` of the role or the database."""
    options: dict[str, Any] = {}
    settings: dict[str, str] = {**ALL_IDENTITIES}
    if not reads_only:
        # A command that writes must finish: no statement_timeout of the role's or the
        # database's (a managed server's parameter group), which ended a wait for a lock
        # that --lock-wait bounds as a failure, and cut a long prune batch, erasure or
        # consolidation at every run. A command that only reads keeps the one a DBA set
        # (an analyst's role, say): it reads on the admin pool, which sets none of its
        # own. (The request pool, which only peeks and consolidations use, sets 0.)
        settings["statement_timeout"] = "0"
    if lock_wait is not None:
        settings["lock_timeout"] = timeout_setting(lock_wait, "--lock-wait")
        options["table_lock_timeout"] = lock_wait
        options["lock_timeout"] = lock_wait
    if lock_timeout is not None:
        options["lock_timeout"] = lock_timeout
    store = PostgresStore.from_url(
        target.url,
        schema=target.schema,
        pool_size=pool_size,
        # The owner's maintenance works across identities (row-level security).
        connect_args={"timeout": CONNECT_TIMEOUT, "server_settings": settings},
        # Maintenance (a rollup rebuild, a big prune batch, the consolidation of a long
        # backlog) may run long; a lock wait ends after --lock-wait, not before.
        command_timeout=None,
        statement_timeout=None,
        **options,
    )
    try:
        await _check_connection(store.engine, target)
        if target.embedded:
            from coda_memory.postgres.migrate import migrate_async

            await migrate_async(target.url, schema=target.schema)
        if migrated:
            revision = await _revision(store)
            if revision is None:
                raise CliError(_not_migrated(target.schema))
            from coda_memory.postgres.migrate import known_revision

            if revision != "unknown" and not known_revision(revision):
                raise CliError(_foreign_revision(target.schema, revision))
        if across and not await maintenance.sees_every_identity(store):
            raise CliError(
                f"the role of {target.display} cannot read every identity's rows (row-level "
                "security): run this command as the schema's owner (the role that ran the "
                "migrations), a superuser or a role with BYPASSRLS"
            )
        yield store
    finally:
        await store.close()


async def _revision(store: PostgresStore) -> str | None:
    """The schema's revision; "unknown" for a role that may not read it (an analyst, who
    is granted the aggregate views only)."""
    try:
        return await maintenance.schema_revision(store)
    except AccessDenied:
        return "unknown"


@dataclass(frozen=True)
class StoreOptions:
    """How :func:`run_on_store` opens the store (see :func:`open_store`)."""

    migrated: bool = True
    pool_size: int = 2
    lock_timeout: timedelta | None = None
    across: bool = True
    #: The command only reads: it keeps the role's or the database's statement_timeout.
    reads_only: bool = False


def run_on_store(
    url: str | None,
    schema: str,
    work: Callable[[PostgresStore, Target], Coroutine[Any, Any, T]],
    *,
    prepare: Callable[[], StoreOptions | None] | None = None,
    lock_wait: str | None = None,
) -> T:
    """A command's database work, under :func:`run`: call ``prepare`` (checks of the
    other options, before the target is resolved, which may start the embedded Postgres;
    it may say how to open the store), resolve ``--url``/``--schema``, open the store and
    run ``work`` on it. ``lock_wait`` is the
    command's ``--lock-wait`` (see :func:`open_store`); a lock not granted within it ends
    the command with :data:`BUSY_EXIT_CODE`."""

    async def main() -> T:
        wait = None
        if lock_wait is not None:
            wait = parse_duration(lock_wait, "--lock-wait", at_most=MAX_TIMEOUT)
        options = (prepare() if prepare is not None else None) or StoreOptions()
        target = resolve_target(url, schema)
        async with open_store(
            target,
            migrated=options.migrated,
            pool_size=options.pool_size,
            lock_timeout=options.lock_timeout,
            across=options.across,
            lock_wait=wait,
            reads_only=options.reads_only,
        ) as store:
            try:
                return await work(store, target)
            except SchemaNotMigrated as exc:
                behind = await _behind_head(store, target)
                if behind is None:
                    raise
                raise behind from exc
            except Exception as exc:
                if wait is None or sqlstate(exc) != LOCK_NOT_AVAILABLE:
                    raise
                raise CliError(
                    f"{_LOCKED_OUT} past --lock-wait: run it again later, or wait longer "
                    "with --lock-wait",
                    BUSY_EXIT_CODE,
                ) from exc

    return run(main, schema)


async def require_identity(store: PostgresStore, identity_id: str) -> None:
    """Fail with "unknown identity" unless it has a checkpoint, a fact or an observation."""
    if not await maintenance.identity_exists(store, identity_id):
        raise CliError(f"unknown identity: {identity_id!r}")


async def require_writable(store: PostgresStore) -> None:
    """Fail unless the server takes writes (a command that writes, given a read replica
    for the primary), before any work: not half-way, nor "done" with nothing to do."""
    if await maintenance.reads_only(store):
        raise CliError(_READS_ONLY)


async def require_head(store: PostgresStore, target: Target, command: str) -> None:
    """Fail unless the schema is at the latest revision (a command that writes what the
    latest migration added; the others work on any revision this release knows)."""
    revision, head = await _revision(store), head_revision()
    if revision not in (head, "unknown"):
        raise CliError(_behind(target.schema, revision, f"{command} needs {head}"))


async def require_revision(
    store: PostgresStore, target: Target, command: str, minimum: str
) -> None:
    """Fail unless the schema is at ``minimum`` or a later revision: the newest migration
    whose tables ``command`` uses. Not the latest: between a package's upgrade and the
    deploy's migrate step, an erasure or a prune must not wait for a migration that adds
    nothing it touches. (A schema not migrated, or one an analyst may not read the
    revision of, is left to the command.)"""
    revision = await _revision(store)
    if revision in (None, "unknown") or _at_least(revision, minimum):
        return
    raise CliError(_behind(target.schema, revision, f"{command} needs {minimum} or later"))


def _at_least(revision: str, minimum: str) -> bool:
    """Whether ``revision`` (or one of its heads, comma-separated) is ``minimum`` or a later
    one of coda-memory's migrations, which are one line, oldest first; one this release
    does not know, a newer coda-memory's, counts as later."""
    from coda_memory.postgres.migrate import revisions

    known = revisions()
    heads = [head.strip() for head in revision.split(",")]
    if any(head not in known for head in heads):
        return True
    return max(known.index(head) for head in heads) >= known.index(minimum)


async def _behind_head(store: PostgresStore, target: Target) -> CliError | None:
    """What to say of a table found missing as a command ran, when the schema is behind
    the latest revision: it lacks what a later migration added, and "not migrated" sent
    the operator looking for the wrong thing. None for any other schema."""
    revision, head = await _revision(store), head_revision()
    if revision in (None, "unknown", head):
        return None
    return CliError(
        _behind(target.schema, revision, f"this command needs a later one (the latest is {head})")
    )


def _behind(schema: str, revision: str | None, needs: str) -> str:
    option = "" if schema == DEFAULT_SCHEMA else f" --schema {schema}"
    return (
        f"schema {schema} is at revision {revision}, and {needs}: run coda-memory migrate{option}"
    )


def head_revision() -> str | None:
    """The latest revision of the packaged migrations."""
    from alembic.script import ScriptDirectory

    from coda_memory.postgres.migrate import alembic_config

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _foreign_revision(schema: str, revision: str) -> str:
    return (
        f"schema {schema} is at Alembic revision {revision!r}, which is not one of this "
        "coda-memory's migrations: another application's history (give coda-memory's own "
        "schema with --schema; the default is coda_memory), or a newer coda-memory's "
        "(upgrade this one)"
    )


def head_label(revision: str | None) -> str:
    """How ``revision`` compares with the latest migration, for people."""
    from coda_memory.postgres.migrate import known_revision

    head = head_revision()
    if revision is None:
        return f"not migrated; the latest is {head}"
    if revision != "unknown" and not known_revision(revision):
        return f"not one of this coda-memory's migrations; the latest is {head}"
    return "the latest" if revision == head else f"the latest is {head}: run coda-memory migrate"
