"""Operations across identities, for operators: what the command line runs.

Everything here reads the consolidation cursor the way the store writes it (see the
docstring of :mod:`coda_memory.postgres.store`): an observation is *consolidated*
once its ``xid`` is visible in its identity's checkpoint snapshot, and *pending* while it
is not (or while the identity has no checkpoint snapshot yet). Statements are built from
the Core tables, so they land in the store's schema, and every value is a bound parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import (
    Boolean,
    Column,
    ColumnElement,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    any_,
    bindparam,
    case,
    cast,
    column,
    delete,
    exists,
    func,
    literal,
    or_,
    select,
    table,
    text,
    union,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import Select

from coda_memory.core.model import MAX_INT32
from coda_memory.errors import AccessDenied
from coda_memory.postgres.durability import flush_commits
from coda_memory.postgres.engine import driver_connection
from coda_memory.postgres.rollup import connection_shard
from coda_memory.postgres.rollup_owed import FOLD_ROWS, fold_owed
from coda_memory.postgres.schema import (
    DEFAULT_SCHEMA,
    PgSnapshot,
    checkpoints,
    domain_users,
    entity_users,
    fact_events,
    facts,
    metadata,
    observations,
    redis_imports,
    rollup_owed,
    tool_users,
)
from coda_memory.postgres.sql import fragment
from coda_memory.postgres.store import PostgresStore

#: Alembic's version table, which the migrations keep in the store's schema (a Table, not
#: a lightweight ``table()``, so that ``schema_translate_map`` moves it with the others).
alembic_version = Table(
    "alembic_version",
    MetaData(schema=DEFAULT_SCHEMA),
    Column("version_num", String(32), primary_key=True),
)

_pg_class = table(
    "pg_class",
    column("oid", Integer),
    column("relname", Text),
    column("relnamespace", Integer),
    column("relkind", Text),
    schema="pg_catalog",
)
_pg_namespace = table(
    "pg_namespace", column("oid", Integer), column("nspname", Text), schema="pg_catalog"
)


def _tables() -> list[Table]:
    """Every coda-memory table, in the metadata's order: those ``stats`` sizes up."""
    return list(metadata.tables.values())


def _checkpoint_snapshot() -> ColumnElement[str]:
    # The snapshot is stored in text form; asyncpg has no pg_snapshot codec.
    return cast(checkpoints.c.snapshot, PgSnapshot())


def _visible(xid: ColumnElement[int], snapshot: ColumnElement[str]) -> ColumnElement[bool]:
    return func.pg_visible_in_snapshot(xid, snapshot, type_=Boolean)


def _unconsumed() -> TextClause:
    """True for an observation row whose transaction its identity's checkpoint snapshot
    did not see: the predicate of ``sql/fragments/unconsumed.sql``, which the hot path
    shares (the statement must have ``observations`` and ``checkpoints`` in scope)."""
    snapshot = "checkpoints.snapshot::pg_snapshot"
    return text(fragment("unconsumed", xid="observations.xid", snapshot=snapshot))


def _pending_condition() -> ColumnElement[bool]:
    """True for an observation row (joined with its identity's checkpoint, if any) that no
    committed consolidation has consumed."""
    return or_(checkpoints.c.snapshot.is_(None), _unconsumed())


async def pending_identities(
    store: PostgresStore,
    *,
    scan_batch: int = 1_000,
    on_scanned: Callable[[int], None] | None = None,
) -> list[str]:
    """Identities with observations that no consolidation has consumed yet, sorted.

    Distinct identities are enumerated with a loose index scan of the observations'
    ``(identity_id, xid)`` index, ``scan_batch`` at a time, so each statement does a
    bounded amount of work however many rows an identity has; for each one, the pending
    test is a range scan of that index from the checkpoint snapshot's ``xmin``.
    ``on_scanned`` is told how many identities each batch looked at.
    """
    if scan_batch < 1:
        raise ValueError("scan_batch must be at least 1")
    found: list[str] = []
    after: str | None = None
    while True:
        # One short read-only transaction per batch.
        batch = await store.run(partial(_scan_pending, after=after, limit=scan_batch))
        if not batch:
            return found
        found.extend(identity for identity, pending in batch if pending)
        after = batch[-1][0]
        if on_scanned is not None:
            on_scanned(len(batch))


async def _scan_pending(
    conn: AsyncConnection, *, after: str | None, limit: int
) -> list[tuple[str, bool]]:
    result = await conn.execute(pending_scan(after, limit))
    return [(str(row.identity_id), bool(row.pending)) for row in result]


async def _scalar(store: PostgresStore, statement: Select[Any]) -> Any:
    async def read(conn: AsyncConnection) -> Any:
        return (await conn.execute(statement)).scalar_one()

    return await store.run(read)


def pending_scan(after: str | None, limit: int) -> Select[Any]:
    """(identity_id, pending) for the next ``limit`` identities with observations after
    ``after`` (from the first when None), in identity order."""
    # scanned: the next ``limit`` distinct identities after ``after``, one index probe
    # each (``min(identity_id) WHERE identity_id > previous`` is answered from the index),
    # instead of a DISTINCT over every observation row.
    first = select(
        func.min(observations.c.identity_id).label("identity_id"),
        literal(1, Integer).label("n"),
    )
    if after is not None:
        first = first.where(observations.c.identity_id > bindparam("after", after, Text))
    scanned = first.cte("scanned", recursive=True)
    following = observations.alias("following")
    next_identity = (
        select(func.min(following.c.identity_id))
        .where(following.c.identity_id > scanned.c.identity_id)
        .scalar_subquery()
    )
    scanned = scanned.union_all(
        select(next_identity, scanned.c.n + 1).where(
            scanned.c.identity_id.is_not(None), scanned.c.n < bindparam("limit", limit, Integer)
        )
    )
    # pending: some row of the identity is not consumed by its checkpoint snapshot (the
    # shared predicate bounds the index range by the snapshot's xmin).
    unconsumed = exists().where(observations.c.identity_id == scanned.c.identity_id, _unconsumed())
    statement = (
        select(
            scanned.c.identity_id,
            or_(checkpoints.c.snapshot.is_(None), unconsumed).label("pending"),
        )
        .select_from(
            scanned.outerjoin(checkpoints, checkpoints.c.identity_id == scanned.c.identity_id)
        )
        .where(scanned.c.identity_id.is_not(None))
        .order_by(scanned.c.identity_id)
    )
    return statement


async def pending_observations(store: PostgresStore, identity_id: str | None = None) -> int:
    """How many stored observations (of one identity, if given) are not consolidated."""
    statement = (
        select(func.count())
        .select_from(
            observations.outerjoin(
                checkpoints, checkpoints.c.identity_id == observations.c.identity_id
            )
        )
        .where(_pending_condition())
    )
    if identity_id is not None:
        statement = statement.where(observations.c.identity_id == identity_id)
    return int(await _scalar(store, statement))


async def identity_exists(store: PostgresStore, identity_id: str) -> bool:
    """True when the identity has a checkpoint, a fact or an observation."""
    return await _has_rows(store, identity_id, (checkpoints, facts, observations))


async def identity_anywhere(store: PostgresStore, identity_id: str) -> bool:
    """True when anything of the identity is stored: what :func:`identity_exists` looks
    for, its fact history, its rows of the rollup's user counts, its owed rollups or its
    import ledger (what ``forget`` erases; rows an earlier version's forget could leave
    behind when an append raced it)."""
    tables = [checkpoints, facts, observations, fact_events, tool_users, entity_users]
    tables += [domain_users, rollup_owed, redis_imports]
    return await _has_rows(store, identity_id, tables)


async def _has_rows(store: PostgresStore, identity_id: str, tables: Sequence[Table]) -> bool:
    """Whether any of ``tables`` holds a row of the identity (one statement)."""
    statement = select(or_(*(exists().where(t.c.identity_id == identity_id) for t in tables)))
    return bool(await _scalar(store, statement))


#: The largest batch: the statements take it as an integer.
MAX_BATCH_SIZE = MAX_INT32


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise ValueError(f"batch_size must be an integer, not {batch_size!r}")
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be from 1 to {MAX_BATCH_SIZE}, not {batch_size}")


async def fold_owed_rollups(store: PostgresStore, *, batch_size: int = FOLD_ROWS) -> int:
    """Fold the rollups appends owe into the rollup (see :mod:`.rollup_owed`), up to
    ``batch_size`` records per transaction, as the owner (every identity); returns the
    owed transactions folded. Records still held back by a lock on a rollup table (or
    being folded by an append right now) stay, for a later append or run."""
    _check_batch_size(batch_size)

    async def batch(conn: AsyncConnection) -> tuple[int, bool]:
        async with conn.begin():
            shard = await connection_shard(conn)
            folded = await fold_owed(
                await driver_connection(conn), store.schema, shard, limit=batch_size
            )
        return folded.transactions, folded.full and not folded.blocked

    total = 0
    more = True
    while more:
        # A batch folds and deletes its records in one transaction: retried when its
        # connection turns out to be dead.
        transactions, more = await store.run(batch)
        total += transactions
    return total


class PruneOutcome(BaseModel):
    """What :func:`prune_consolidated` did."""

    model_config = ConfigDict(frozen=True)

    #: Owed rollup transactions folded first (see :func:`fold_owed_rollups`).
    owed_folded: int = 0

    #: Observation rows deleted.
    deleted: int
    #: Identities with a checkpoint that were looked at.
    identities: int
    #: Identities skipped because a consolidation held their checkpoint at the time.
    busy: int


#: The prefix of the WAL message that :func:`settle_consolidations` writes.
SETTLE_MESSAGE_PREFIX = "coda_memory.consolidate"


async def settle_consolidations(store: PostgresStore) -> None:
    """Make the consolidations committed so far durable (see
    :mod:`coda_memory.postgres.durability`): they commit with ``synchronous_commit`` off,
    and ``consolidate`` ended with the last of them unflushed, having reported them done."""
    await flush_commits(store, SETTLE_MESSAGE_PREFIX)


async def count_checkpointed(store: PostgresStore) -> int:
    """Identities whose checkpoint has a snapshot: those :func:`prune_consolidated` visits."""
    statement = select(func.count()).where(checkpoints.c.snapshot.is_not(None))
    return int(await _scalar(store, statement))


async def prune_consolidated(
    store: PostgresStore,
    *,
    before: datetime,
    batch_size: int = 100,
    on_batch: Callable[[int, int], None] | None = None,
) -> PruneOutcome:
    """Delete observations created before ``before`` that a committed consolidation has
    consumed (visible in their identity's checkpoint snapshot); never a pending one.

    Identities are visited ``batch_size`` at a time, each batch in a transaction of its
    own that locks their checkpoint rows with ``SKIP LOCKED``: an identity being
    consolidated (or forgotten) right now is skipped and counted as busy, so live traffic
    never waits on the prune for longer than one batch, and the consolidation prunes
    its own old rows anyway. ``on_batch`` gets (identities visited, rows deleted).
    Owed rollups are folded first, and an observation whose rollup is still owed stays.
    """
    _check_batch_size(batch_size)
    owed_folded = await fold_owed_rollups(store)
    deleted = visited = busy = 0
    after: str | None = None
    while True:
        # A batch deletes only consumed rows, in one transaction: retried when its
        # connection turns out to be dead.
        batch = partial(_prune_batch, after=after, limit=batch_size, before=before)
        candidates, locked, rows = await store.run(batch)
        if not candidates:
            break
        deleted += rows
        visited += len(candidates)
        busy += len(candidates) - len(locked)
        after = candidates[-1]
        if on_batch is not None:
            on_batch(len(candidates), rows)
    return PruneOutcome(owed_folded=owed_folded, deleted=deleted, identities=visited, busy=busy)


async def _prune_batch(
    conn: AsyncConnection, *, after: str | None, limit: int, before: datetime
) -> tuple[list[str], list[str], int]:
    """(identities looked at, those locked, rows deleted) of one batch."""
    async with conn.begin():
        candidates = await _checkpoint_batch(conn, after, limit)
        if not candidates:
            return [], [], 0
        locked = await _lock_checkpoints(conn, candidates)
        rows = await _delete_consumed(conn, locked, before) if locked else 0
    return candidates, locked, rows


async def _checkpoint_batch(conn: AsyncConnection, after: str | None, limit: int) -> list[str]:
    statement = (
        select(checkpoints.c.identity_id)
        .where(checkpoints.c.snapshot.is_not(None))
        .order_by(checkpoints.c.identity_id)
        .limit(bindparam("limit", limit, Integer))
    )
    if after is not None:
        statement = statement.where(checkpoints.c.identity_id > bindparam("after", after, Text))
    return list((await conn.execute(statement)).scalars())


def _among(identities: Sequence[str]) -> ColumnElement[bool]:
    return checkpoints.c.identity_id == any_(bindparam("identities", list(identities), ARRAY(Text)))


async def _lock_checkpoints(conn: AsyncConnection, identities: Sequence[str]) -> list[str]:
    statement = (
        select(checkpoints.c.identity_id)
        .where(_among(identities))
        .order_by(checkpoints.c.identity_id)
        .with_for_update(skip_locked=True)
    )
    return list((await conn.execute(statement)).scalars())


async def _delete_consumed(
    conn: AsyncConnection, identities: Sequence[str], before: datetime
) -> int:
    snapshot = _checkpoint_snapshot()
    statement = delete(observations).where(
        observations.c.identity_id == checkpoints.c.identity_id,
        _among(identities),
        observations.c.created_at < bindparam("before", before, observations.c.created_at.type),
        # Range bound on (identity_id, xid): everything visible is below xmax.
        observations.c.xid < func.pg_snapshot_xmax(snapshot),
        _visible(observations.c.xid, snapshot),
        # Kept until its owed rollup is folded: the folding reads it back.
        ~exists().where(
            rollup_owed.c.identity_id == observations.c.identity_id,
            rollup_owed.c.xid == observations.c.xid,
        ),
    )
    result = await conn.execute(statement)
    return int(result.rowcount)


class StoreStats(BaseModel):
    """Counts and sizes of one store's schema."""

    model_config = ConfigDict(frozen=True)

    schema_name: str
    revision: str | None
    identities: int
    observations: int
    pending_observations: int
    facts: int
    fact_events: int
    #: Table name -> total size in bytes (indexes and TOAST included), for the tables
    #: that exist (a schema behind the latest migration lacks the newer ones).
    table_bytes: dict[str, int]


async def schema_revision(store: PostgresStore) -> str | None:
    """The Alembic revision of the store's schema, or None when it was never migrated;
    :class:`AccessDenied` for a role that may not read the version table (an analyst),
    asked before it is read: the refused ``SELECT`` left an ERROR line in the server's log
    at every command an analyst ran."""
    qualified = bindparam("name", f"{store.schema}.{alembic_version.name}", Text)
    version_table = func.to_regclass(qualified)

    async def read(conn: AsyncConnection) -> str | None:
        readable = (
            await conn.execute(
                select(
                    case(
                        (version_table.is_(None), None),
                        else_=func.has_table_privilege(version_table, "SELECT"),
                    )
                )
            )
        ).scalar()
        if readable is None:
            return None
        if not readable:
            raise AccessDenied(
                f"the role may not read {store.schema}.{alembic_version.name} (the schema's "
                "revision): analysts are granted the views only"
            )
        result = await conn.execute(select(alembic_version.c.version_num))
        return result.scalar_one_or_none()

    return await store.run(read)


#: Whether the connected role reads every identity's rows through row-level security: a
#: superuser, a ``BYPASSRLS`` role, any role while the table has no row-level security
#: (before migration 0004), or a role with the privileges of one that the policy
#: ``all_identities`` names (the role that ran the migration, which may no longer own the
#: tables after ``ALTER … OWNER``); NULL before the schema exists.
_SEES_EVERY_IDENTITY = text(
    "SELECT CASE WHEN c.oid IS NULL THEN NULL ELSE"
    " r.rolsuper OR r.rolbypassrls OR NOT c.relrowsecurity OR EXISTS ("
    "  SELECT FROM pg_catalog.pg_policy p, unnest(p.polroles) AS named(role)"
    "  WHERE p.polrelid = c.oid AND p.polname = 'all_identities'"
    "  AND CASE WHEN named.role = 0 THEN true ELSE pg_has_role(named.role, 'USAGE') END"
    " ) END"
    " FROM pg_catalog.pg_roles r LEFT JOIN pg_catalog.pg_class c ON c.oid = to_regclass(:facts)"
    " WHERE r.rolname = current_user"
)


async def sees_every_identity(store: PostgresStore) -> bool:
    """Whether the store's role reads every identity's rows when it asks for all
    identities (the command line's maintenance needs it); True before the schema exists."""
    name = f"{store.schema}.{facts.name}"

    async def read(conn: AsyncConnection) -> bool:
        result = await conn.execute(_SEES_EVERY_IDENTITY, {"facts": name})
        return result.scalar() is not False

    return await store.run(read)


async def reads_only(store: PostgresStore) -> bool:
    """Whether the store's server takes no write: a hot standby or read replica, a writer
    that a failover demoted, ``default_transaction_read_only``. A maintenance command
    given such a server for the primary failed on its first write, or, with nothing to
    write, reported its work done."""

    async def read(conn: AsyncConnection) -> bool:
        setting = await conn.scalar(select(func.current_setting("transaction_read_only")))
        return bool(setting == "on")

    return await store.run(read)


async def store_stats(store: PostgresStore) -> StoreStats:
    """Identities, observations (all and pending), facts, events, table sizes, revision."""
    revision = await schema_revision(store)
    known = union(
        select(checkpoints.c.identity_id),
        select(facts.c.identity_id),
        select(observations.c.identity_id),
    ).subquery("known")
    counts = select(
        select(func.count()).select_from(known).scalar_subquery().label("identities"),
        select(func.count()).select_from(observations).scalar_subquery().label("observations"),
        select(func.count()).select_from(facts).scalar_subquery().label("facts"),
        select(func.count()).select_from(fact_events).scalar_subquery().label("fact_events"),
    )
    names = [t.name for t in _tables()]
    sizes = (
        select(_pg_class.c.relname, func.pg_total_relation_size(_pg_class.c.oid))
        .join(_pg_namespace, _pg_namespace.c.oid == _pg_class.c.relnamespace)
        .where(
            _pg_namespace.c.nspname == bindparam("schema", store.schema, Text),
            _pg_class.c.relname == any_(bindparam("tables", names, ARRAY(Text))),
        )
    )

    async def read(conn: AsyncConnection) -> tuple[Any, dict[str, int]]:
        row = (await conn.execute(counts)).one()
        return row, {str(name): int(size) for name, size in await conn.execute(sizes)}

    row, table_bytes = await store.run(read)
    pending = await pending_observations(store)
    return StoreStats(
        schema_name=store.schema,
        revision=revision,
        identities=row.identities,
        observations=row.observations,
        pending_observations=pending,
        facts=row.facts,
        fact_events=row.fact_events,
        table_bytes={t.name: table_bytes[t.name] for t in _tables() if t.name in table_bytes},
    )
