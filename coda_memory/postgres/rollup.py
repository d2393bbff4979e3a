"""The rollup: compact usage counts that outlive the raw observations.

Raw observations are pruned once consolidated and older than ``retention`` (a week by
default), but analytics answer over months, so every append also folds the rows it
stored into a rollup, in the same transaction: the counts can never disagree with what
was stored, and a refused row (see ``append``) is never counted because the rollup reads
the rows back from the table.
When a rollup table is locked, the append owes the rollup instead, and a later
transaction folds it by running the same statements on the owed transactions' rows (by
their ``xid``): :mod:`.rollup_owed`. Until then the counts lag by those rows.

Design
------
* **Global, anonymous, per UTC day.** ``tool_daily`` (successes, failures),
  ``tool_durations`` (calls per duration bucket), ``entity_daily`` (accesses) and
  ``domain_daily`` (queries) hold no identity. Their size follows tools, entities and
  domains times days, not observations, so the analytics read thousands of rows where the
  raw log would need millions.
* **Durations as a histogram.** A call with ``durationMs`` lands in bucket 0 below 1 ms,
  else in bucket ``1 + floor(4 * log2(ms))`` (four buckets per doubling, capped at 127).
  A percentile is reported as the geometric middle of the bucket that holds it, so it is
  within ``2 ** (1/8) - 1`` (about 9.1 %) of a duration in that bucket; below 1 ms it is
  0.5 ms. The views in migration 0002 decode the same layout.
* **Distinct users from per-identity rows.** ``tool_users`` and ``entity_users`` keep the
  last day each identity used each tool or entity; the statement that moves ``last_day``
  forward also moves the identity between the days' ``latest_users`` counters (-1 on the
  day it leaves, kept in ``previous_day`` because RETURNING cannot see the old row, +1 on
  the new one). The identities whose latest use falls on or after a day are then a sum
  over the daily rows: the distinct users of any window that ends at the latest data (a
  window ending today), without counting identities at read time. ``domain_users`` keeps
  (identity, domain, day); a row that is new feeds ``domain_daily.users`` (distinct users
  per day) in the same statement.
* **Contention.** Few tools and domains take most calls, so their daily rows are hot:
  ``tool_daily``, ``tool_durations`` and ``domain_daily`` have a ``shard`` column, set to
  the writing connection's backend pid modulo :data:`SHARDS`, and readers sum the shards.
  The pid rather than a hash of the identity, because a batch carries many identities and
  would touch every shard; a connection writes its batches one after another. Entities
  are many, each rarely hot, and an entity query reads them all, so ``entity_daily`` is
  not sharded. Every statement upserts in key order, per-identity rows before the global
  rows they feed, and ``forget`` follows the same order (it locks an identity's rows in
  key order before deleting them, see ``rollup_upkeep``), so concurrent batches wait for
  each other but never deadlock.
* **Forget.** :func:`.rollup_upkeep.forget_identity` deletes the identity's per-identity
  rows and takes the identity out of the user counters they fed, in ``forget``'s
  transaction; the anonymous call, access and query counts stay. An identity that comes
  back is counted afresh, once.
* **Filling it.** Migration 0002 backfills the rollup from the observations stored when
  it runs; :func:`.rollup_upkeep.rebuild` recomputes it from them (for bulk loads that
  bypass append), and drops the owed rollups, which it recomputes too.
  Per-identity rows are one per identity and tool or entity, and one per identity, domain
  and active day for domains; nothing prunes them but ``forget``.

Keys come from the stored metadata (``toolName``, ``entityType``/``entityId``,
``domain``); a row whose key is missing or longer than :data:`MAX_KEY_CHARS` is not
counted. Days are UTC days of ``created_at``.

This module builds the statements; :mod:`.rollup_batch` compiles and runs them for each
appended batch (and for owed ones), :mod:`.rollup_owed` defers and folds owed rollups,
:mod:`.rollup_upkeep` forgets an identity's rows and rebuilds the rollup.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Date,
    Double,
    Numeric,
    SmallInteger,
    Table,
    Text,
    any_,
    bindparam,
    case,
    cast,
    func,
    literal,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.selectable import CTE, Select

from coda_memory.core.model import ObservationType
from coda_memory.postgres.schema import (
    Xid8,
    domain_daily,
    domain_users,
    entity_daily,
    entity_users,
    observations,
    tool_daily,
    tool_durations,
    tool_users,
)
from coda_memory.postgres.tenancy import WRITER_SETTING

#: How many rows share the load of one hot (day, tool) or (day, domain) counter.
SHARDS = 8
#: Duration buckets per doubling; bucket 0 holds everything below 1 ms.
BUCKETS_PER_DOUBLING = 4
#: The last duration bucket (about 35 days); longer durations are counted in it.
MAX_BUCKET = 127
#: Longer keys are not counted (a B-tree entry has a size limit).
MAX_KEY_CHARS = 200

TOOL_TYPES = (ObservationType.TOOL_SUCCESS, ObservationType.TOOL_FAILURE)


def duration_bucket(duration_ms: ColumnElement[Any]) -> ColumnElement[int]:
    """The histogram bucket of a duration in milliseconds (the module docstring)."""
    doublings = func.ln(duration_ms) / math.log(2)
    bucket = func.least(MAX_BUCKET, 1 + func.floor(BUCKETS_PER_DOUBLING * doublings))
    # No ELSE: a missing duration has no bucket (least() would ignore the NULL).
    return cast(case((duration_ms < 1, 0), (duration_ms >= 1, bucket)), SmallInteger)


def _duration_ms(value: ColumnElement[Any]) -> ColumnElement[Any]:
    """A JSON number as milliseconds, clamped to [0, 1e15] first, so that no number
    (sanitising allows none outside it, but the table would) fails the cast; else NULL."""
    clamped = func.greatest(func.least(cast(value, Numeric), literal(10**15, BigInteger)), 0)
    return case((func.jsonb_typeof(value) == "number", cast(clamped, Double)))


def _shard(shard: int) -> ColumnElement[Any]:
    # A named parameter, so that a compiled statement takes each writer's own shard.
    return bindparam("shard", shard, SmallInteger)


def _utc_day(column: ColumnElement[Any]) -> ColumnElement[Any]:
    return cast(func.timezone("UTC", column), Date)


def _is_key(value: ColumnElement[Any]) -> ColumnElement[bool]:
    return func.length(value).between(1, MAX_KEY_CHARS)


def _stored(
    identities: Sequence[str] | None,
    types: Iterable[str],
    ids: Sequence[int] | None = None,
    *,
    owed: bool = False,
    extra: dict[str, ColumnElement[Any]] | None = None,
    **keys: Any,
) -> Select[Any]:
    """This transaction's observations of ``types`` whose ``keys`` are usable (every
    stored one when ``identities`` is None: a rebuild), with the ``extra`` columns too;
    with ``owed``, those of earlier transactions whose rollup was owed, given as pairs by
    the ``identities`` and ``xids`` parameters.

    A row refused by the server was never written, so it cannot be read back here;
    ``(identity_id, xid)`` is indexed, and subtransactions write the top-level xid.
    """
    o = observations
    columns = [
        o.c.identity_id,
        o.c.type,
        _utc_day(o.c.created_at).label("day"),
        *(value.label(name) for name, value in keys.items()),
        *(value.label(name) for name, value in (extra or {}).items()),
    ]
    usable = [o.c.type.in_(list(types)), *(_is_key(value) for value in keys.values())]
    if identities is not None and owed:
        # The owed records being folded, as (identity_id, xid) pairs: of each owed
        # transaction only the identities whose records this folding claimed (another
        # folding may hold the others). Each pair's rows are read by a lateral subquery,
        # one index probe per pair: as a plain join the planner, which cannot estimate
        # the key filters, may pick a nested loop over a scan of the whole table (OFFSET
        # 0 keeps the subquery from being flattened into such a join).
        named = bindparam("identities", list(identities), ARRAY(Text))
        xids = bindparam("xids", [], ARRAY(Xid8()))
        pairs = func.unnest(named, xids).table_valued("identity_id", "xid")
        pairs = pairs.render_derived(name="owed")
        of_pair = [o.c.identity_id == pairs.c.identity_id, o.c.xid == pairs.c.xid]
        rows = select(*columns).where(*of_pair, *usable).offset(0).lateral("owed_rows")
        return select(*rows.c).select_from(pairs.join(rows, true()))
    batch: list[ColumnElement[bool]] = []
    if identities is not None:
        named = bindparam("identities", list(identities), ARRAY(Text))
        batch += [o.c.identity_id == any_(named), o.c.xid == func.pg_current_xact_id()]
    if ids is not None:
        # Part of the transaction's rows only: a part of a batch being bisected.
        batch.append(o.c.id == any_(bindparam("ids", list(ids), ARRAY(BigInteger))))
    return select(*columns).where(*batch, *usable)


def _move_latest_day(stored: CTE, users: Table, keys: Sequence[str]) -> CTE:
    """Upsert each (identity, key)'s latest day; returns the rows whose day moved."""
    key_columns = [stored.c.identity_id, *(stored.c[k] for k in keys)]
    # One row per key, as ON CONFLICT requires, in key order, so that concurrent batches
    # lock shared rows in the same order.
    latest = (
        select(*key_columns, func.max(stored.c.day)).group_by(*key_columns).order_by(*key_columns)
    )
    upsert = insert(users).from_select(["identity_id", *keys, "last_day"], latest)
    upsert = upsert.on_conflict_do_update(
        index_elements=[users.c.identity_id, *(users.c[k] for k in keys)],
        set_={"previous_day": users.c.last_day, "last_day": upsert.excluded.last_day},
        where=upsert.excluded.last_day > users.c.last_day,
    )
    returned = [*(users.c[k] for k in keys), users.c.last_day, users.c.previous_day]
    return upsert.returning(*returned).cte("moved")


def _latest_user_changes(moved: CTE, keys: Sequence[str], counts: Sequence[str]) -> list[Any]:
    """+1 on the day each moved identity arrives at, -1 on the day it left."""
    zeros = [literal(0, BigInteger).label(name) for name in counts]
    key_columns = [moved.c[k] for k in keys]
    arrived = select(
        moved.c.last_day.label("day"),
        *key_columns,
        *zeros,
        literal(1, BigInteger).label("latest_users"),
    )
    left = select(
        moved.c.previous_day.label("day"),
        *key_columns,
        *zeros,
        literal(-1, BigInteger).label("latest_users"),
    ).where(moved.c.previous_day.is_not(None))
    return [arrived, left]


def add_to_daily(
    daily: Table,
    changes: Any,
    keys: Sequence[str],
    counts: Sequence[str],
    shard: int | None,
) -> Insert:
    """Add the summed ``changes`` to ``daily``'s rows, in key order."""
    group = [changes.c.day, *(changes.c[k] for k in keys)]
    sharding = [] if shard is None else [_shard(shard)]
    source = (
        select(*group, *sharding, *(func.sum(changes.c[c]) for c in counts))
        .group_by(*group)
        .order_by(*group)
    )
    names = ["day", *keys, *(["shard"] if shard is not None else []), *counts]
    upsert = insert(daily).from_select(names, source)
    return upsert.on_conflict_do_update(
        index_elements=[daily.c[name] for name in names[: len(names) - len(counts)]],
        set_={c: daily.c[c] + upsert.excluded[c] for c in counts},
    )


def tool_rollup(
    identities: Sequence[str] | None,
    shard: int,
    ids: Sequence[int] | None = None,
    *,
    owed: bool = False,
) -> Insert:
    """Fold this transaction's tool observations into the tool rollup (``owed``: those
    of the owed records given by the ``identities`` and ``xids`` parameters)."""
    metadata = observations.c.metadata
    duration = _duration_ms(metadata["durationMs"])
    # The batch as stored, read once and shared by the three writes below.
    stored = _stored(
        identities,
        [t.value for t in TOOL_TYPES],
        ids,
        owed=owed,
        extra={"bucket": duration_bucket(duration)},
        tool_name=metadata["toolName"].astext,
    ).cte("stored")
    # Calls per day: the anonymous counts.
    calls = select(
        stored.c.day,
        stored.c.tool_name,
        func.count().filter(stored.c.type == ObservationType.TOOL_SUCCESS.value).label("successes"),
        func.count().filter(stored.c.type == ObservationType.TOOL_FAILURE.value).label("failures"),
        literal(0, BigInteger).label("latest_users"),
    ).group_by(stored.c.day, stored.c.tool_name)
    # Identities whose latest call of a tool moved to a later day.
    moved = _move_latest_day(stored, tool_users, ["tool_name"])
    counts = ["successes", "failures", "latest_users"]
    # Both kinds of change per (day, tool), summed into one upsert of the daily rows.
    changes = union_all(calls, *_latest_user_changes(moved, ["tool_name"], counts[:2]))
    daily = add_to_daily(tool_daily, changes.subquery("changes"), ["tool_name"], counts, shard)
    # The duration histogram; calls without a duration have no bucket.
    group = [stored.c.day, stored.c.tool_name, stored.c.bucket]
    histogram = (
        select(*group[:2], _shard(shard), group[2], func.count())
        .where(stored.c.bucket.is_not(None))
        .group_by(*group)
        .order_by(*group)
    )
    names = ["day", "tool_name", "shard", "bucket", "calls"]
    durations = insert(tool_durations).from_select(names, histogram)
    durations = durations.on_conflict_do_update(
        index_elements=[tool_durations.c[name] for name in names[:-1]],
        set_={"calls": tool_durations.c.calls + durations.excluded.calls},
    )
    return daily.add_cte(durations.cte("durations"))


def entity_rollup(
    identities: Sequence[str] | None, ids: Sequence[int] | None = None, *, owed: bool = False
) -> Insert:
    """Fold this transaction's entity accesses into the entity rollup (``owed``: as in
    :func:`tool_rollup`)."""
    metadata = observations.c.metadata
    keys = ["entity_type", "entity_id"]
    stored = _stored(
        identities,
        [ObservationType.ENTITY_ACCESS.value],
        ids,
        owed=owed,
        entity_type=metadata["entityType"].astext,
        entity_id=metadata["entityId"].astext,
    ).cte("stored")
    group = [stored.c.day, stored.c.entity_type, stored.c.entity_id]
    # Accesses per day: the anonymous counts.
    accesses = select(
        *group, func.count().label("accesses"), literal(0, BigInteger).label("latest_users")
    ).group_by(*group)
    # Identities whose latest access of an entity moved to a later day.
    moved = _move_latest_day(stored, entity_users, keys)
    # Both kinds of change per (day, entity), summed into one upsert of the daily rows.
    changes = union_all(accesses, *_latest_user_changes(moved, keys, ["accesses"]))
    return add_to_daily(
        entity_daily, changes.subquery("changes"), keys, ["accesses", "latest_users"], None
    )


def domain_rollup(
    identities: Sequence[str] | None,
    shard: int,
    ids: Sequence[int] | None = None,
    *,
    owed: bool = False,
) -> Insert:
    """Fold this transaction's query patterns into the domain rollup (``owed``: as in
    :func:`tool_rollup`)."""
    stored = _stored(
        identities,
        [ObservationType.QUERY_PATTERN.value],
        ids,
        owed=owed,
        domain=observations.c.metadata["domain"].astext,
    ).cte("stored")
    # An identity's first query of a domain on a day inserts a row; later ones conflict,
    # so the rows returned are exactly the new (identity, domain, day) users.
    seen = [stored.c.identity_id, stored.c.domain, stored.c.day]
    first = (
        insert(domain_users)
        .from_select(["identity_id", "domain", "day"], select(*seen).distinct().order_by(*seen))
        .on_conflict_do_nothing()
        .returning(domain_users.c.day, domain_users.c.domain)
        .cte("first_of_day")
    )
    queries = select(
        stored.c.day,
        stored.c.domain,
        func.count().label("queries"),
        literal(0, BigInteger).label("users"),
    ).group_by(stored.c.day, stored.c.domain)
    users = select(first.c.day, first.c.domain, literal(0, BigInteger), literal(1, BigInteger))
    # Queries and new users per (day, domain), summed into one upsert of the daily rows.
    changes = union_all(queries, users).subquery("changes")
    return add_to_daily(domain_daily, changes, ["domain"], ["queries", "users"], shard)


async def connection_shard(conn: AsyncConnection, *, writer: bool = False) -> int:
    """The shard this connection writes (one statement: it also opens the transaction).
    ``writer``: the transaction also becomes the writer's, which may store rows of any
    identity (row-level security; see :mod:`~coda_memory.postgres.tenancy`)."""
    columns = [func.pg_backend_pid() % SHARDS]
    if writer:
        columns.append(func.set_config(WRITER_SETTING, "on", True))
    result = await conn.execute(select(*columns))
    return int(result.one()[0])
